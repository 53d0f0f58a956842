"""The daemon itself is SIGKILLed at awkward moments: no engine may outlive it, and a new daemon on
the same spec and runtime directory takes over (the lock died with the old one).

tests/e2e/test_daemon.py covers a SIGKILL of an idle, READY fleet; here the daemon dies while an
engine is mid-restart (loading), while a request is mid-flight, during its own graceful shutdown,
and moments after it started spawning.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time

import pytest
import yaml

from chaos.procs import fleet_processes
from testkit.driver import PYTHON, REPO_ROOT, _clean_env, wait_engines_gone

pytestmark = pytest.mark.slow

NO_ORPHANS_WITHIN_S = 5.0
LOAD_S = 3.0  # the loading engine's "model load": long enough to be caught STARTING
TOKEN_MS = 100  # the slow engine's per-token time: a 200-token request takes 20 s


def _assert_fleet_gone(daemon_pid: int, pids: set[int], orphan_s: float = 0.0) -> None:
    """Within 5 s (after `orphan_s`, the orphan_timeout): not one engine process of that daemon
    remains (by pid, and by environment)."""
    deadline = time.monotonic() + NO_ORPHANS_WITHIN_S + orphan_s
    assert wait_engines_gone(pids, daemon_pid, NO_ORPHANS_WITHIN_S + orphan_s) == []
    while (left := fleet_processes(daemon_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == [], f"engines of the SIGKILLed daemon {daemon_pid} remain: {left}"


def _saved(d, name: str) -> tuple[int, int] | None:
    """(incarnation, restarts) of `name` in the daemon's state snapshot, if it is there."""
    try:
        saved = json.loads((d.runtime_dir / "state.json").read_text())
    except (OSError, ValueError):
        return None
    for r in saved["replicas"]:
        if r["name"] == name:
            return r["incarnation"], sum(r["restarts"].values())
    return None


def test_sigkill_mid_restart_and_mid_request_then_a_new_daemon_takes_over(engined):
    d = engined([{"name": "load", "replicas": 1, "model": "builtin:echo",
                  "env": {"ENGINED_ECHO_LOAD_S": str(LOAD_S)}},
                 {"name": "slow", "replicas": 1, "model": "builtin:echo",
                  "env": {"ENGINED_ECHO_TOKEN_MS": str(TOKEN_MS)}},
                 {"name": "echo", "replicas": 2, "model": "builtin:echo"}],
                ready=False, supervisor={"orphan_timeout": "0s"})
    d.wait_all_ready(30)
    # Mid-request: a 20 s generation running on slow-0.
    gen = d.ctl_popen("generate", "--engine", "slow-0", "--max-tokens", "200", "y" * 200,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        d.wait_for(lambda: (d.engine("slow-0").get("queue") or {}).get("running") == 1, 20,
                   "the slow request to be running")
        # Mid-restart: load-0 is loading its next incarnation.
        old = d.engine("load-0")
        assert d.ctl("restart", "load-0", "--no-wait").returncode == 0
        loading = d.wait_state("load-0", "STARTING",
                               where=lambda e: e["incarnation"] > old["incarnation"] and e["pid"])
        engines = d.engines()
        assert engines["slow-0"]["state"] == "READY" and engines["echo-0"]["state"] == "READY"
        assert loading["phase"] in ("spawned", "weights"), loading
        # the state snapshot (written within milliseconds of a change) has the restart: what
        # changed in the very instant of a death is not carried over, and that is not tested here
        d.wait_for(lambda: _saved(d, "load-0") == (loading["incarnation"], 1), 10,
                   "the state snapshot to show load-0's restart")
        pids = d.spawned_pids()

        d.expect_unclean_exit = True
        d.signal(signal.SIGKILL)
        assert d.wait_exit(timeout_s=10) == -signal.SIGKILL
        _assert_fleet_gone(d.pid, pids)
        # The client of the in-flight request learns the daemon is gone (exit 4), not a hang.
        _, err = gen.communicate(timeout=20)
        assert gen.returncode == 4, err
    finally:
        if gen.poll() is None:
            gen.kill()
            gen.wait()

    # Same spec, same runtime directory: the lock is free and the stale sockets are replaced.
    d.expect_unclean_exit = False
    d.start()
    fresh = d.wait_all_ready(30)
    assert set(fresh) == {"load-0", "slow-0", "echo-0", "echo-1"}
    for e in fresh.values():  # new processes; the history goes on (the state snapshot)
        assert e["pid"] not in pids and e["adopted_at"] is None, e
        assert e["restarts"] == (1 if e["name"] == "load-0" else 0), e  # its manual restart
        assert e["incarnation"] == (3 if e["name"] == "load-0" else 2), e
    assert d.status()["supervisor"]["pid"] == d.pid
    assert d.ctl("generate", "--engine", "slow-0", "--max-tokens", "3", "back").stdout.strip() \
        == "bac"


def test_sigkill_during_a_slow_graceful_shutdown_leaves_no_engine(engined):
    d = engined([{"name": "echo", "replicas": 2, "model": "builtin:echo"}],
                defaults={"stop_timeout": "30s", "stall_timeout": "60s"},
                supervisor={"orphan_timeout": "0s"})
    # echo-0 ignores its SIGTERM (its busy loop is wedged): the graceful stop would take 30 s.
    gen = d.ctl_popen("generate", "--engine", "echo-0", "!stall", stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE)
    try:
        d.wait_for(lambda: (d.engine("echo-0").get("queue") or {}).get("running") == 1, 20,
                   "the !stall request to be running")
        pids = d.spawned_pids()
        d.signal(signal.SIGTERM)
        d.wait_for(lambda: "[shutdown] stopping" in d.stderr_text(), 20, "shutdown to begin")
        d.expect_unclean_exit = True
        d.signal(signal.SIGKILL)
        assert d.wait_exit(timeout_s=10) == -signal.SIGKILL
        _assert_fleet_gone(d.pid, pids)
        gen.communicate(timeout=20)
        assert gen.returncode != 0
    finally:
        if gen.poll() is None:
            gen.kill()
            gen.wait()
    d.expect_unclean_exit = False
    d.start()
    d.wait_all_ready()


@pytest.mark.parametrize("orphan_s", [0, 1])
def test_sigkill_moments_after_start_leaves_no_engine(short_tmp, rng: random.Random, orphan_s):
    """Killed while it is still spawning: a child that started its interpreter after the daemon
    died must notice (PR_SET_PDEATHSIG plus the getppid() check) and exit; with an
    orphan_timeout, the guard ends what it held and what carries the daemon's mark once that
    has passed. The moments are drawn from `rng` (its seed is printed; ENGINED_TEST_SEED
    replays them)."""
    spec = {"version": 1,
            "supervisor": {"http": "off", "runtime_dir": str(short_tmp / "rt"),
                           "heartbeat_interval": "0.2s", "heartbeat_timeout": "1.5s",
                           "orphan_timeout": f"{orphan_s}s"},
            "engines": [{"name": "echo", "replicas": 6, "model": "builtin:echo"}]}
    path = short_tmp / "fleet.yaml"
    path.write_text(yaml.safe_dump(spec))
    for attempt in range(4):
        with open(short_tmp / f"engined-{attempt}.stderr", "wb") as err:
            proc = subprocess.Popen([PYTHON, "-m", "engined.supervisor.daemon", "-c", str(path)],
                                    cwd=REPO_ROOT, env=_clean_env(), stdin=subprocess.DEVNULL,
                                    stdout=err, stderr=err)
        # Even attempts: at a random moment of start-up (before or while spawning); odd ones:
        # just after the first spawn, while the others are being spawned.
        deadline = time.monotonic() + 20
        while attempt % 2 and time.monotonic() < deadline \
                and "[spawn]" not in (short_tmp / f"engined-{attempt}.stderr").read_text():
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.3) if attempt % 2 == 0 else rng.uniform(0.0, 0.02))
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        _assert_fleet_gone(proc.pid, set(), orphan_s)

    # The last one's lock and sockets are stale: a daemon starts on that directory cleanly.
    final = subprocess.Popen([PYTHON, "-m", "engined.supervisor.daemon", "-c", str(path)],
                             cwd=REPO_ROOT, env=_clean_env(), stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        sock = str(short_tmp / "rt" / "control.sock")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            out = subprocess.run([PYTHON, "-m", "engined.supervisor.ctl.cli", "--socket", sock,
                                  "status", "--json"], cwd=REPO_ROOT, env=_clean_env(),
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                break
            time.sleep(0.1)
        assert out.returncode == 0, out
        assert len(json.loads(out.stdout)["engines"]) == 6
    finally:
        final.send_signal(signal.SIGTERM)
        assert final.wait(timeout=30) == 0, final.stderr.read()
        _assert_fleet_gone(final.pid, set())
