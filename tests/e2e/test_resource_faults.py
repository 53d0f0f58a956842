"""Resource faults: a log file that cannot be written does not stop supervision, and the capture
recovers once the file can be written again.

Tests run as root, and root ignores file modes, so each fault is one that really fails as root:
* a full file system: a 64 KiB tmpfs mounted as the log directory, filled up (ENOSPC on write);
* the log file is a symlink to /dev/full (ENOSPC on every write);
* a directory sits where the log file should be (EISDIR on open);
* the log file is immutable (`chattr +i`: EPERM on open, even for root).
While the fault lasts, the engine still starts, serves, is restarted after a SIGKILL, and its lines
still reach `enginectl logs` and the exit's log tail (from the in-memory ring); the daemon warns
once. When the fault is removed, new lines reach the file again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from testkit.driver import Daemon

ECHO2 = {"name": "echo", "replicas": 2, "model": "builtin:echo"}
RECOVER_WITHIN_S = 20.0


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


# Each fault: prepare(log_dir) -> (when to break it: "before" or "after" start, break, repair).
Fault = tuple[str, Callable[[Path], None], Callable[[Path], None]]


@contextlib.contextmanager
def _tmpfs_full(log_dir: Path) -> Iterator[Fault]:
    log_dir.mkdir()
    mounted = _run("mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(log_dir))
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    filler = log_dir / "filler"

    def fill(_: Path) -> None:
        _fill(filler)
        for log in log_dir.glob("*.log"):  # the slack in each log file's last page too
            _fill(log)
        assert _write_fails(log_dir / "probe", errno.ENOSPC)

    try:
        yield "after", fill, lambda _: filler.unlink()
    finally:
        _run("umount", "-l", str(log_dir))  # lazy: the daemon may still hold files open


@contextlib.contextmanager
def _dev_full(log_dir: Path) -> Iterator[Fault]:
    log_dir.mkdir()
    target = log_dir / "echo-0.log"
    yield "before", lambda _: target.symlink_to("/dev/full"), lambda _: target.unlink()


@contextlib.contextmanager
def _directory(log_dir: Path) -> Iterator[Fault]:
    log_dir.mkdir()
    target = log_dir / "echo-0.log"
    yield "before", lambda _: target.mkdir(), lambda _: target.rmdir()


@contextlib.contextmanager
def _immutable(log_dir: Path) -> Iterator[Fault]:
    log_dir.mkdir()
    target = log_dir / "echo-0.log"
    target.touch()
    done = _run("chattr", "+i", str(target)) if shutil.which("chattr") else None
    if done is None or done.returncode != 0:
        pytest.skip("chattr +i is not available on this file system")
    _run("chattr", "-i", str(target))

    def breaks(_: Path) -> None:
        assert _run("chattr", "+i", str(target)).returncode == 0
        assert _write_fails(target, errno.EPERM)

    try:
        yield "before", breaks, lambda _: _run("chattr", "-i", str(target))
    finally:
        _run("chattr", "-i", str(target))  # or the temporary directory cannot be removed


def _fill(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    try:
        for size in (4096, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size):
                    pass
    finally:
        os.close(fd)


def _write_fails(path: Path, code: int) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        try:
            os.write(fd, b"x" * 8192)
        finally:
            os.close(fd)
    except OSError as exc:
        return exc.errno == code
    return False


FAULTS = {"tmpfs-full": _tmpfs_full, "dev-full": _dev_full, "directory": _directory,
          "immutable": _immutable}


def _log_file_text(path: Path) -> str:
    try:
        return path.read_text("utf-8", "replace") if path.is_file() else ""
    except OSError:
        return ""


@pytest.mark.parametrize("fault", list(FAULTS))
def test_unwritable_log_does_not_stop_supervision_and_capture_recovers(engined, short_tmp, fault):
    log_dir = short_tmp / "logs"
    with FAULTS[fault](log_dir) as (when, breaks, repair):
        if when == "before":
            breaks(log_dir)
        d = engined([ECHO2], supervisor={"log_dir": str(log_dir)}, ready=False)
        d.log_dir = log_dir  # the driver reads logs (and spawned pids) from here
        d.wait_all_ready()
        if when == "after":
            breaks(log_dir)
        _supervision_goes_on(d, log_dir / "echo-0.log", fault)
        repair(log_dir)
        _capture_recovers(d, log_dir / "echo-0.log")
        d.spawned_pids()  # note them while the logs can still be read


def _supervision_goes_on(d: Daemon, path: Path, fault: str) -> None:
    first = d.engine("echo-0")
    if fault == "tmpfs-full":  # the file was fine until now: make echo-0 write into the full fs
        assert d.ctl("restart", "echo-0").returncode == 0
        first = d.engine("echo-0")
    d.wait_for(lambda: f"[logs] cannot write {path}" in d.stderr_text(), 10,
               "the daemon's warning about the log file")
    before_kill = _log_file_text(path)
    assert f"spawned pid {first['pid']}" not in before_kill  # the fault is real

    os.kill(first["pid"], signal.SIGKILL)
    again = d.wait_restarted("echo-0", first["pid"])
    expected = {"signal": 1, **({"manual": 1} if fault == "tmpfs-full" else {})}
    assert again["restarts_by_reason"] == expected, again
    assert again["last_exit"]["signal"] == "SIGKILL"
    # The lines did not vanish: the ring serves the exit's tail and `enginectl logs`.
    assert any(f"spawned pid {first['pid']}" in line for line in again["last_exit"]["log_tail"])
    logs = d.ctl("logs", "echo-0", "-n", "50")
    assert logs.returncode == 0 and f"spawned pid {again['pid']}" in logs.stdout, logs
    assert d.ctl("generate", "--engine", "echo-0", "despite").stdout.strip() == "despite"
    assert d.engine("echo-1")["state"] == "READY"
    warnings = d.stderr_text().count(f"[logs] cannot write {path}")
    assert warnings == 1, warnings  # warned once, not per line
    assert "Traceback" not in d.stderr_text()


def _capture_recovers(d: Daemon, path: Path) -> None:
    """After the repair, new lines reach the file (the sink retries within a second)."""
    deadline = time.monotonic() + RECOVER_WITHIN_S
    while True:
        old = d.engine("echo-0")["pid"]
        assert d.ctl("restart", "echo-0").returncode == 0
        new = d.engine("echo-0")["pid"]
        text = _log_file_text(path)
        if f"spawned pid {new}" in text:
            break
        assert time.monotonic() < deadline, f"no new lines in {path}: {text[-2000:]!r}"
        time.sleep(0.3)  # the sink retries a failed file once a second
    assert new != old
    ready = f"[ready] echo-0 incarnation {d.engine('echo-0')['incarnation']}"
    d.wait_for(lambda: ready in _log_file_text(path), 10, "the child's own lines in the file")
    assert d.engine("echo-0")["state"] == "READY"
