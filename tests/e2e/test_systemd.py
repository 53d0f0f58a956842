"""End to end: sd_notify over a real datagram socket, the unit file, and live reload."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from testkit import driver

REPO = Path(__file__).resolve().parents[2]


class NotifyListener:
    """A real NOTIFY_SOCKET: collects (monotonic time, datagram) pairs in a thread."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(0.2)
        self.address = address
        self.messages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            self.messages.append((time.monotonic(), data.decode()))

    def having(self, field: str) -> list[tuple[float, str]]:
        return [(t, m) for t, m in self.messages if field in m.split("\n")
                or any(line.startswith(field) for line in m.split("\n"))]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


@pytest.fixture
def notify_daemon(engined, monkeypatch, short_tmp):
    """engined(...) with NOTIFY_SOCKET (path or abstract) and WATCHDOG_USEC in its environment."""
    listeners: list[NotifyListener] = []

    def start(address: str, watchdog_usec: int = 400_000, **kwargs):
        listener = NotifyListener(address)
        listeners.append(listener)
        extra = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": str(watchdog_usec)}
        clean = driver._clean_env
        monkeypatch.setattr(driver, "_clean_env", lambda: {**clean(), **extra})
        daemon = engined(**kwargs)
        monkeypatch.setattr(driver, "_clean_env", clean)
        return daemon, listener

    yield start
    for listener in listeners:
        listener.close()


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.smoke
def test_notify_over_a_path_socket(notify_daemon, short_tmp):
    daemon, notify = notify_daemon(str(short_tmp / "notify.sock"), engines=[
        {"name": "echo", "replicas": 2, "model": "builtin:echo"}])
    ready = _wait(lambda: notify.having("READY=1"), 10, "READY=1")
    # READY=1 is sent only once the control socket serves: it answered before we got here,
    # and the first datagram is READY (nothing claims readiness before control is up).
    assert notify.messages[0][1].startswith("READY=1")
    assert ready
    _wait(lambda: any("STATUS=2/2 engines ready" in m for _, m in notify.messages), 10,
          "STATUS=2/2 engines ready")

    # The watchdog keeps beating over the real socket (at half of WATCHDOG_USEC, and none while
    # the loop is wedged: pinned by tests/lifecycle/test_timing_pins.py
    # test_the_watchdog_beats_every_half_watchdog_usec_and_never_while_unhealthy).
    start = len(notify.having("WATCHDOG=1"))
    _wait(lambda: len(notify.having("WATCHDOG=1")) >= start + 5, 20, "five more WATCHDOG=1")

    # STATUS follows state: a stopped engine is no longer counted as expected.
    assert daemon.ctl("stop", "echo-1").returncode == 0
    _wait(lambda: any("STATUS=1/1 engines ready" in m for _, m in notify.messages), 10,
          "STATUS=1/1 after a stop")

    # Children never see NOTIFY_SOCKET or WATCHDOG_*.
    pid = daemon.engine("echo-0")["pid"]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert not any(e.startswith((b"NOTIFY_SOCKET=", b"WATCHDOG_")) for e in environ)

    # RELOADING=1 (with MONOTONIC_USEC) then READY=1 around a reload.
    before = len(notify.messages)
    daemon.signal(signal.SIGHUP)
    _wait(lambda: any(m.startswith("READY=1") for _, m in notify.messages[before:]), 10,
          "READY=1 after the reload")
    after = [m for _, m in notify.messages[before:]]
    reloading = next(i for i, m in enumerate(after) if m.startswith("RELOADING=1"))
    assert "MONOTONIC_USEC=" in after[reloading]
    usec = int(after[reloading].split("MONOTONIC_USEC=")[1].split("\n")[0])
    assert abs(usec / 1e6 - time.clock_gettime(time.CLOCK_MONOTONIC)) < 30
    assert any(m.startswith("READY=1") for m in after[reloading + 1:])

    # STOPPING=1 at shutdown.
    assert daemon.stop() == 0
    _wait(lambda: notify.having("STOPPING=1"), 5, "STOPPING=1")


def test_an_upgrade_in_place_keeps_the_main_pid_and_tells_systemd(notify_daemon, short_tmp):
    """`enginectl upgrade` under Type=notify: RELOADING=1, then the exec'd code's READY=1 from
    the same pid (systemd's MAINPID), and the watchdog goes on beating."""
    daemon, notify = notify_daemon(str(short_tmp / "notify.sock"), engines=[
        {"name": "echo", "replicas": 1, "model": "builtin:echo"}])
    _wait(lambda: notify.having("READY=1"), 10, "READY=1")
    pid = daemon.engine("echo-0")["pid"]
    before = len(notify.messages)
    assert daemon.ctl("upgrade").returncode == 0
    _wait(lambda: any(m.startswith("READY=1") for _, m in notify.messages[before:]), 10,
          "READY=1 from the new code")
    after = [m for _, m in notify.messages[before:]]
    reloading = next(i for i, m in enumerate(after) if m.startswith("RELOADING=1"))
    assert any(m.startswith("READY=1") for m in after[reloading + 1:]), after
    start = len(notify.having("WATCHDOG=1"))
    _wait(lambda: len(notify.having("WATCHDOG=1")) >= start + 3, 20, "the watchdog beating on")
    assert daemon.status()["supervisor"]["pid"] == daemon.pid
    assert daemon.engine("echo-0")["pid"] == pid


def test_notify_over_an_abstract_socket(notify_daemon):
    name = f"@engined-test-{os.getpid()}-{time.monotonic_ns()}"
    daemon, notify = notify_daemon(name, watchdog_usec=1_000_000)
    _wait(lambda: notify.having("READY=1"), 10, "READY=1 on the abstract socket")
    _wait(lambda: notify.having("WATCHDOG=1"), 5, "WATCHDOG=1 on the abstract socket")
    assert daemon.stop() == 0
    _wait(lambda: notify.having("STOPPING=1"), 5, "STOPPING=1")


@pytest.mark.smoke
def test_unit_file_passes_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-analyze missing in CI: .ci/run must install Debian's systemd")
        pytest.skip("systemd-analyze not installed")
    # The unit runs the venv /opt/engined's engined (the README's install); point it at this
    # environment's venv, installed the same way, so verify checks the unit against a real
    # installed path.
    engined = shutil.which("engined") or str(Path(sys.executable).with_name("engined"))
    if not os.access(engined, os.X_OK):
        engined = sys.executable
    unit = (REPO / "systemd/engined.service").read_text()
    assert "ExecStart=/opt/engined/bin/engined -c /etc/engined/fleet.yaml" in unit
    assert "/usr/local/bin/engined" not in unit
    (tmp_path / "engined.service").write_text(unit.replace("/opt/engined/bin/engined", engined))
    done = subprocess.run([analyze, "verify", str(tmp_path / "engined.service")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), (
        done.stdout + done.stderr)
    for line in ("Type=notify", "KillMode=process", "RestartPreventExitStatus=78",
                 "ExecStopPost=", "--stop-orphans",
                 "ExecReload=/bin/kill -HUP $MAINPID", "NotifyAccess=main", "WatchdogSec=",
                 "RuntimeDirectory=engined", "LogsDirectory=engined", "LimitNOFILE="):
        assert line in unit, line
    assert "\nPrivateDevices=" not in unit  # it would hide /dev/nvidia*


@pytest.mark.smoke
@pytest.mark.parametrize("example", sorted((REPO / "etc").rglob("*.yaml")), ids=lambda p: p.name)
def test_example_fleets_pass_check(example):
    """Every shipped spec is valid. One whose interpreter or server program is not on this
    machine (the vLLM examples: .venv-vllm, /opt/vllm) must fail on that alone: the host check
    runs only on a spec that parsed, so everything else in it was valid."""
    done = subprocess.run([sys.executable, "-m", "engined.supervisor.daemon", "-c", str(example),
                           "--check"], cwd=REPO, capture_output=True, text=True, timeout=60)
    engines = [e for e in (yaml.safe_load(example.read_text()) or {}).get("engines", [])
               if isinstance(e, dict)]
    missing = [e["python"] for e in engines
               if "python" in e and not (example.parent / e["python"]).exists()]
    missing += [e["command"][0] for e in engines
                if "command" in e and "/" in e["command"][0]
                and not (example.parent / e["command"][0]).exists()]
    if not missing:
        assert done.returncode == 0, done.stderr
        return
    assert done.returncode == 78, done
    problems = [line for line in done.stderr.splitlines()[1:] if line.strip()]
    assert problems and all(("python: interpreter" in p and "does not exist" in p)
                            or ("command[0]: program" in p and "not found" in p)
                            for p in problems), done.stderr


# --- reload ---------------------------------------------------------------------------------


def _pids(daemon) -> dict[str, tuple[int, int]]:
    return {n: (e["pid"], e["incarnation"]) for n, e in daemon.engines().items()}


def _rewrite(daemon, engines) -> None:
    spec = dict(daemon.spec)
    spec["engines"] = engines
    daemon.spec = spec
    daemon.spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))


def _reload(daemon) -> str:
    done = daemon.ctl("reload")
    assert done.returncode == 0, done.stderr
    return done.stdout


def _line(output: str, key: str) -> list[str]:
    for line in output.splitlines():
        if line.startswith(f"{key}:"):
            return [x.strip() for x in line.split(":", 1)[1].split(",")]
    return []


A = {"name": "a", "replicas": 2, "model": "builtin:echo"}
B = {"name": "b", "model": "builtin:echo"}


@pytest.mark.smoke
def test_reload_applies_only_the_difference(engined):
    daemon = engined(engines=[A, B])
    start = _pids(daemon)

    out = _reload(daemon)  # nothing changed
    assert "no changes" in out
    assert _pids(daemon) == start

    _rewrite(daemon, [A, B, {"name": "c", "model": "builtin:echo"}])  # add
    out = _reload(daemon)
    assert _line(out, "added") == ["c-0"]
    daemon.wait_all_ready()
    now = _pids(daemon)
    assert {n: now[n] for n in start} == start

    _rewrite(daemon, [A, {"name": "c", "model": "builtin:echo"}])  # remove b
    out = _reload(daemon)
    assert _line(out, "removed") == ["b-0"]
    daemon.wait_for(lambda: "b-0" not in daemon.engines(), 20, "b-0 gone from status")
    daemon.wait_for(lambda: driver.process_gone(start["b-0"][0]), 20, "b-0's process gone")
    assert {n: _pids(daemon)[n] for n in ("a-0", "a-1")} == {n: start[n] for n in ("a-0", "a-1")}

    c_before = _pids(daemon)["c-0"]
    _rewrite(daemon, [A, {"name": "c", "model": "builtin:echo", "max_batch_size": 4}])  # change c
    out = _reload(daemon)
    assert _line(out, "changed") == ["c-0"]
    c = daemon.wait_restarted("c-0", c_before[0])
    assert c["restarts_by_reason"] == {"reload": 1}
    assert {n: _pids(daemon)[n] for n in ("a-0", "a-1")} == {n: start[n] for n in ("a-0", "a-1")}
    assert daemon.status()["supervisor"]["generation"] == 5


def test_reload_resizes_a_group_without_touching_the_others(engined):
    daemon = engined(engines=[A])
    start = _pids(daemon)
    _rewrite(daemon, [{**A, "replicas": 3}])  # 2 -> 3
    out = _reload(daemon)
    assert _line(out, "added") == ["a-2"] and _line(out, "unchanged") == ["a-0", "a-1"]
    daemon.wait_all_ready()
    assert {n: _pids(daemon)[n] for n in start} == start

    three = _pids(daemon)
    _rewrite(daemon, [{**A, "replicas": 1}])  # 3 -> 1
    out = _reload(daemon)
    assert _line(out, "removed") == ["a-1", "a-2"]
    daemon.wait_for(lambda: list(daemon.engines()) == ["a-0"], 20, "only a-0 left")
    assert _pids(daemon)["a-0"] == start["a-0"]
    daemon.wait_for(lambda: all(driver.process_gone(three[n][0]) for n in ("a-1", "a-2")), 20,
                    "the removed replicas' processes gone")


def test_invalid_spec_leaves_the_fleet_exactly_as_it_was(engined):
    daemon = engined(engines=[A, B])
    before = daemon.status()
    good = daemon.spec_path.read_text()
    daemon.spec_path.write_text(good.replace("replicas: 2", "replicas: -1"))
    done = daemon.ctl("reload")
    assert done.returncode == 1
    assert "engines[0].replicas" in done.stderr and "nothing changed" in done.stderr
    daemon.signal(signal.SIGHUP)  # the same through the signal path
    daemon.wait_for(lambda: daemon.stderr_text().count("[reload] invalid spec") >= 2, 10,
                    "the SIGHUP reload's error in the log")
    after = daemon.status()
    strip = lambda s: [(e["name"], e["pid"], e["incarnation"], e["restarts"], e["state"])  # noqa
                       for e in s["engines"]]
    assert strip(after) == strip(before)
    assert after["supervisor"]["generation"] == before["supervisor"]["generation"]


def test_supervisor_changes_are_reported_as_needing_a_restart(engined):
    daemon = engined(engines=[B])
    spec = dict(daemon.spec)
    spec["supervisor"] = {**spec["supervisor"], "heartbeat_timeout": "3s"}
    daemon.spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    out = _reload(daemon)
    assert _line(out, "restart required") == ["supervisor.heartbeat_timeout"]


def test_the_docs_install_where_the_unit_looks():
    """The operations page's systemd commands make the venv the unit's ExecStart runs, and never
    ask for `sudo pip install` into the system Python (PEP 668 refuses it on current
    Debian/Ubuntu)."""
    page = (REPO / "docs" / "operations.md").read_text()
    section = page.split("## Run under systemd", 1)[1].split("\n## ", 1)[0]
    commands = section.split("```sh", 1)[1].split("```", 1)[0]
    unit = (REPO / "systemd/engined.service").read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    engined = exec_start.removeprefix("ExecStart=").split()[0]
    venv = str(Path(engined).parent.parent)
    assert f"python3 -m venv {venv}" in commands, commands
    assert f"{venv}/bin/pip install" in commands, commands
    assert "sudo pip install" not in commands and "sudo pip3 install" not in commands
    assert "systemd/engined.service /etc/systemd/system/" in commands
