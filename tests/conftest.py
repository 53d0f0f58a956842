"""Shared fixtures. The end-to-end tier's `engined` factory lives here.

`engined(...)` writes a fleet spec into a short temporary directory (ZeroMQ ipc:// paths must stay
under ~100 characters), starts the real daemon (`python -m supervisor.daemon -c SPEC`), waits with
a deadline until its control socket answers, and returns a `Daemon` driver: `ctl(...)` runs
`enginectl` as a subprocess, `status()` reads GET /v1/status over the unix socket, `wait_for(...)`
polls a condition with a deadline. Teardown stops the daemon (SIGTERM, then SIGKILL), requires a
clean exit, and fails the test if any engine process it ever spawned is still alive (killing
such leftovers by pid).
"""

from __future__ import annotations

import contextlib
import datetime
import http.client
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import psutil
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

DAEMON_START_TIMEOUT_S = 20.0
DAEMON_STOP_TIMEOUT_S = 30.0
DEFAULT_WAIT_S = 20.0
CTL_TIMEOUT_S = 60.0
ORPHAN_GRACE_S = 5.0  # PR_SET_PDEATHSIG is asynchronous: the kernel kills, init reaps

T = TypeVar("T")

_SPAWN_RE = re.compile(r"\bspawned pid (\d+)")
_DAEMON_LOG_RE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\w+) (.*)$")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NOTIFY_SOCKET", "ENGINED_SOCKET", "ENGINED_CONFIG_FILE",
                        "RUNTIME_DIRECTORY", "LOGS_DIRECTORY", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# --- HTTP over the control socket -------------------------------------------------------------


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout_s: float) -> None:
        super().__init__("engined", timeout=timeout_s)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def http_request(sock_path: str, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None,
                 timeout_s: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """One request on its own connection; returns (status, headers, body)."""
    conn = _UnixHTTPConnection(sock_path, timeout_s)
    try:
        conn.request(method, path, body=body, headers={"Connection": "close", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


# --- the daemon driver ------------------------------------------------------------------------


class Daemon:
    """One running engined, its files, and helpers to drive it like a user would."""

    def __init__(self, root: Path, spec: dict[str, Any]) -> None:
        self.root = root
        self.spec = spec
        self.spec_path = root / "fleet.yaml"
        self.runtime_dir = root / "rt"
        self.log_dir = self.runtime_dir / "logs"
        self.socket = str(self.runtime_dir / "control.sock")
        self.stderr_path = root / "engined.stderr"
        self.proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None
        self.seen_pids: set[int] = set()
        self.expect_unclean_exit = False  # set by tests that kill the daemon on purpose
        self.spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))

    # --- process ---------------------------------------------------------------------------
    def start(self) -> None:
        self.returncode = None
        with open(self.stderr_path, "ab") as err:
            self.proc = subprocess.Popen(
                [PYTHON, "-m", "supervisor.daemon", "-c", str(self.spec_path)],
                cwd=REPO_ROOT, env=_clean_env(), stdin=subprocess.DEVNULL,
                stdout=err, stderr=err)
        self.wait_for(self._answers, DAEMON_START_TIMEOUT_S, "the control socket to answer")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _answers(self) -> bool:
        if not os.path.exists(self.socket):
            return False
        try:
            status, _, _ = http_request(self.socket, "GET", "/v1/status", timeout_s=5.0)
        except OSError:
            return False
        return status == 200

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout_s: float = DAEMON_STOP_TIMEOUT_S) -> int:
        assert self.proc is not None
        self.returncode = self.proc.wait(timeout=timeout_s)
        return self.returncode

    def stop(self) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; returns the exit code of a graceful stop, else None."""
        if self.proc is None:
            return None
        if self.proc.poll() is not None:
            self.returncode = self.proc.returncode
            return self.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.wait_exit()
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            return None

    # --- driving it ------------------------------------------------------------------------
    def ctl(self, *args: str, timeout_s: float = CTL_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """Run `enginectl --socket SOCK ARGS...`; never raises on a non-zero exit."""
        return subprocess.run([PYTHON, "-m", "supervisor.cli", "--socket", self.socket, *args],
                              cwd=REPO_ROOT, env=_clean_env(), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout_s)

    def ctl_popen(self, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
        return subprocess.Popen([PYTHON, "-m", "supervisor.cli", "--socket", self.socket, *args],
                                cwd=REPO_ROOT, env=_clean_env(), stdin=subprocess.DEVNULL,
                                text=True, **kwargs)

    def http(self, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        return http_request(self.socket, method, path, body, headers)

    def status(self) -> dict[str, Any]:
        code, _, body = http_request(self.socket, "GET", "/v1/status")
        assert code == 200, f"GET /v1/status -> {code}: {body!r}"
        data = json.loads(body)
        self.seen_pids.update(e["pid"] for e in data["engines"] if e.get("pid"))
        return data

    def engines(self) -> dict[str, dict[str, Any]]:
        return {e["name"]: e for e in self.status()["engines"]}

    def engine(self, name: str) -> dict[str, Any]:
        return self.engines()[name]

    def wait_for(self, predicate: Callable[[], T], timeout_s: float = DEFAULT_WAIT_S,
                 what: str = "condition", interval_s: float = 0.05) -> T:
        """Poll `predicate` until truthy (returned) or the deadline (AssertionError)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate()
            if value:
                return value
            if self.proc is not None and self.proc.poll() is not None and not self.expect_unclean_exit:
                raise AssertionError(f"engined exited with {self.proc.returncode} while waiting "
                                     f"for {what}")
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what} "
                                     f"(last value {value!r})")
            time.sleep(interval_s)

    def holds(self, predicate: Callable[[], Any], duration_s: float, what: str,
              interval_s: float = 0.05) -> None:
        """Assert `predicate` stays truthy for `duration_s` (for "nothing else happens")."""
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            assert predicate(), f"{what} stopped holding"
            time.sleep(interval_s)

    def wait_state(self, name: str, state: str, timeout_s: float = DEFAULT_WAIT_S,
                   where: Callable[[dict[str, Any]], bool] = lambda e: True) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            e = self.engine(name)
            return e if e["state"] == state and where(e) else None
        return self.wait_for(check, timeout_s, f"{name} to be {state}")

    def wait_all_ready(self, timeout_s: float = DEFAULT_WAIT_S) -> dict[str, dict[str, Any]]:
        def check() -> dict[str, dict[str, Any]] | None:
            engines = self.engines()
            ok = all(e["state"] == "READY" and e["pid"] for e in engines.values())
            return engines if ok else None
        return self.wait_for(check, timeout_s, "every engine READY")

    def wait_restarted(self, name: str, old_pid: int,
                       timeout_s: float = DEFAULT_WAIT_S) -> dict[str, Any]:
        """READY again with a pid other than `old_pid`."""
        return self.wait_state(name, "READY", timeout_s,
                               lambda e: e["pid"] is not None and e["pid"] != old_pid)

    # --- files -----------------------------------------------------------------------------
    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def log_text(self, name: str) -> str:
        try:
            return self.log_path(name).read_text("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def stderr_text(self) -> str:
        try:
            return self.stderr_path.read_text("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def daemon_log(self) -> list[tuple[float, str, str]]:
        """(unix time, level, message) for each line of the daemon's stderr log."""
        out = []
        for line in self.stderr_text().splitlines():
            m = _DAEMON_LOG_RE.match(line)
            if m:
                stamp = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                out.append((stamp, m.group(2), m.group(3)))
        return out

    def spawned_pids(self) -> set[int]:
        """Every engine pid the daemon ever spawned, from the per-engine log files."""
        pids = set(self.seen_pids)
        if self.log_dir.is_dir():
            for path in self.log_dir.glob("*.log*"):
                pids.update(int(p) for p in _SPAWN_RE.findall(path.read_text("utf-8", "replace")))
        pids.update(int(p) for p in re.findall(r"\[spawn\] \S+ pid (\d+)", self.stderr_text()))
        return pids

    def dump(self) -> None:
        """Print what helps diagnose a failure (pytest shows it for failing tests only)."""
        print(f"===== engined stderr ({self.stderr_path}) =====")
        print(self.stderr_text()[-20000:])
        if self.log_dir.is_dir():
            for path in sorted(self.log_dir.glob("*.log")):
                print(f"===== {path.name} =====")
                print(path.read_text("utf-8", "replace")[-5000:])


# --- process helpers --------------------------------------------------------------------------


def process_gone(pid: int) -> bool:
    """Gone, or a zombie (an orphan waiting for an init that may not reap in a container)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def is_engine_of(pid: int, daemon_pid: int) -> bool:
    """Still alive, not a zombie, and an engine child of that daemon (not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        try:
            return proc.environ().get("ENGINED_PARENT_PID") == str(daemon_pid)
        except psutil.AccessDenied:
            return proc.cmdline()[-2:] == ["-m", "engine"]
    except psutil.NoSuchProcess:
        return False


def leftover_engines(pids: set[int], daemon_pid: int) -> list[int]:
    return sorted(pid for pid in pids if is_engine_of(pid, daemon_pid))


def wait_engines_gone(pids: set[int], daemon_pid: int, timeout_s: float) -> list[int]:
    """Poll until none of `pids` is a live engine of `daemon_pid`; return those still alive."""
    deadline = time.monotonic() + timeout_s
    while (alive := leftover_engines(pids, daemon_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def stream_lines(stream: IO[str]) -> queue.Queue[str | None]:
    """Lines of a subprocess's text stream as they arrive (None at EOF), read by a thread."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def read_until(lines: queue.Queue[str | None], needle: str, timeout_s: float) -> list[str]:
    """Lines up to and including the first containing `needle`; AssertionError at the deadline
    or at EOF."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"{needle!r} not seen within {timeout_s:g}s; got {seen}")


def _dur(seconds: float) -> str:
    return f"{seconds:g}s"


def build_spec(root: Path, engines: list[dict[str, Any]] | None,
               supervisor: dict[str, Any] | None, defaults: dict[str, Any] | None) -> dict[str, Any]:
    sup = {"http": "off", "runtime_dir": str(root / "rt"),
           "heartbeat_interval": _dur(0.2), "heartbeat_timeout": _dur(1.5)}
    sup.update(supervisor or {})
    spec: dict[str, Any] = {"version": 1, "supervisor": sup}
    if defaults:
        spec["defaults"] = defaults
    spec["engines"] = engines if engines is not None else [
        {"name": "echo", "replicas": 1, "model": "builtin:echo"}]
    return spec


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary directory with a short path (ZeroMQ ipc:// paths are limited to ~100 chars)."""
    root = Path(tempfile.mkdtemp(prefix="eg", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def engined(short_tmp: Path) -> Iterator[Callable[..., Daemon]]:
    """Factory: engined(engines=[...], supervisor={...}, defaults={...}, ready=True) -> Daemon."""
    daemons: list[Daemon] = []

    def start(engines: list[dict[str, Any]] | None = None,
              supervisor: dict[str, Any] | None = None,
              defaults: dict[str, Any] | None = None, ready: bool = True) -> Daemon:
        root = short_tmp / f"d{len(daemons)}"
        root.mkdir()
        daemon = Daemon(root, build_spec(root, engines, supervisor, defaults))
        daemons.append(daemon)
        daemon.start()
        if ready:
            daemon.wait_all_ready()
        return daemon

    yield start

    problems = []
    for daemon in daemons:
        try:
            if daemon.alive():
                daemon.spawned_pids()  # note the pids while the daemon can still say
                with contextlib.suppress(Exception):
                    daemon.status()
            was_running = daemon.alive()
            code = daemon.stop()
            if was_running and code != 0 and not daemon.expect_unclean_exit:
                problems.append(f"engined pid {daemon.pid} did not exit cleanly on SIGTERM "
                                f"(exit {code})")
            if daemon.proc is not None:
                alive = wait_engines_gone(daemon.spawned_pids(), daemon.pid, ORPHAN_GRACE_S)
                for pid in alive:
                    with contextlib.suppress(Exception):
                        os.kill(pid, signal.SIGKILL)
                if alive:
                    problems.append(f"engine processes outlived engined pid {daemon.pid}: {alive}")
        finally:
            daemon.dump()
    assert not problems, "; ".join(problems)



@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A session-wide ENGINED_CACHE_DIR with the tiny-llama checkpoint built once, up front."""
    cache = tmp_path_factory.mktemp("engined-cache")
    env = {**_clean_env(), "ENGINED_CACHE_DIR": str(cache)}
    done = subprocess.run(
        [PYTHON, "-c", "from engine.llm import tiny_llama_dir; "
                       "print(tiny_llama_dir(lambda phase, detail: None))"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (Path(done.stdout.strip()) / "config.json").is_file(), done.stdout
    return cache


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_cache: Path) -> Path:
    """The built checkpoint directory: a valid `{path: DIR}` model."""
    (path,) = tiny_cache.glob("tiny-llama-*")
    return path
