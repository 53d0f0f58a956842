"""supervisor.recovery's proofs: a saved pid the guard did not hand over is signalled only when
its start time and owner mark prove it is the engine; a reused pid never is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from engined.engine.contract import ENV_OWNER
from engined.supervisor.upgrade import snapshot
from engined.supervisor.upgrade.recovery import Claimer, Orphan

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def spawn():
    procs: list[subprocess.Popen] = []

    def start(env: dict[str, str] | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(SLEEP, env={**os.environ, **(env or {})},
                                start_new_session=True)
        procs.append(proc)
        deadline = time.monotonic() + 10  # until the interpreter has its own environment
        while time.monotonic() < deadline and _environ(proc.pid) is None:
            time.sleep(0.01)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _environ(pid: int) -> bytes | None:
    try:
        data = open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        return None
    return data or None


def _saved(pid: int, ticks: int, token: str) -> snapshot.Process:
    return snapshot.Process(pid=pid, start_ticks=ticks, token=token, address=("x-0", 1))


def _replica() -> SimpleNamespace:
    return SimpleNamespace(name="x-0", log=None)


def test_a_reused_pid_is_never_signalled(spawn):
    proc = spawn({ENV_OWNER: "999/x-0/1"})
    ticks = snapshot.start_ticks(proc.pid)
    assert ticks is not None
    claimer = Claimer({}, 999)
    assert claimer(_replica(), _saved(proc.pid, ticks - 1, "999/x-0/1")) is None
    time.sleep(0.2)
    assert proc.poll() is None  # another process has that pid now: left alone


def test_a_pid_without_the_engines_mark_is_never_signalled(spawn):
    proc = spawn()  # the right start time, but nothing says it is the engine
    ticks = snapshot.start_ticks(proc.pid)
    assert Claimer({}, 999)(_replica(), _saved(proc.pid, ticks, "999/x-0/1")) is None
    time.sleep(0.2)
    assert proc.poll() is None


def test_a_proven_engine_no_guard_handed_over_is_killed(spawn):
    proc = spawn({ENV_OWNER: "999/x-0/1"})
    ticks = snapshot.start_ticks(proc.pid)
    assert Claimer({}, 999)(_replica(), _saved(proc.pid, ticks, "999/x-0/1")) is None
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_a_handed_over_process_with_another_start_time_is_killed_not_adopted(spawn):
    """The guard's pidfd proves the dead engined spawned it; it is not the engine saved."""
    proc = spawn()
    pidfd = os.pidfd_open(proc.pid)
    read_end, write_end = os.pipe()
    os.close(write_end)
    orphan = Orphan(proc.pid, True, pidfd, read_end)
    ticks = snapshot.start_ticks(proc.pid)
    assert Claimer({proc.pid: orphan}, 999)(
        _replica(), _saved(proc.pid, ticks + 5, "999/x-0/1")) is None
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert orphan.pidfd is None and orphan.output_fd is None  # closed


def test_leftovers_the_snapshot_does_not_know_are_killed(spawn):
    proc = spawn()
    claimer = Claimer({proc.pid: Orphan(proc.pid, True, os.pidfd_open(proc.pid), None)}, 999)
    claimer.leftovers()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert claimer.orphans == {}
