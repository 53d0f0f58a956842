"""After engined dies unplanned (SIGKILL), its engines keep running for `orphan_timeout` and the
next engined started on the same runtime directory adopts them: the same processes, READY
again, nothing restarted, FAILED and stopped engines still so, counts and history continued. An
engine that died meanwhile is said once and restarted; with no new engined, nothing outlives
`orphan_timeout`; a snapshot that cannot be used starts the fleet fresh, killing what the guard
proves was engined's."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import time

import psutil
import pytest

from testkit.driver import PYTHON, REPO_ROOT, _clean_env, free_port, process_gone
from testkit.handover import FLEET, Clients, identity, metric
from testkit.probes import spawned_tree

pytestmark = pytest.mark.slow


def _saved(d) -> set[tuple[int, str]]:
    try:
        saved = json.loads((d.runtime_dir / "state.json").read_text())
    except (OSError, ValueError):
        return set()
    return {(r["process"]["pid"], r["state"]) for r in saved["replicas"] if r["process"]}


def _kill_daemon(d) -> set[int]:
    """SIGKILL the daemon once its state snapshot shows every live engine as status does (it
    is written within milliseconds of a change; what changed in the very instant of a death is
    lost); the pids of everything it had started (engines' descendants too)."""
    def same() -> bool:
        live = {(e["pid"], e["state"]) for e in d.engines().values()
                if e["pid"] is not None and e["state"] != "STOPPING"}
        return _saved(d) == live
    d.wait_for(same, 10, "the snapshot to show every live engine")
    tree = spawned_tree(d)
    d.expect_unclean_exit = True
    d.signal(signal.SIGKILL)
    assert d.wait_exit(timeout_s=10) == -signal.SIGKILL
    return tree


def _mixed_fleet(engined, orphan_timeout: str):
    """Forked replicas, an exec'd engine and a command engine, every one READY."""
    d = engined(FLEET[:3], ready=False, supervisor={"orphan_timeout": orphan_timeout})
    for name in ("echo-0", "echo-1", "ex-0", "web-0"):
        d.wait_state(name, "READY", timeout_s=30)
    return d


def _still_running(pids: set[int], timeout_s: float) -> list[int]:
    """Wait (bounded) until none of `pids` runs; those that still do."""
    alive = sorted(p for p in pids if not process_gone(p))
    deadline = time.monotonic() + timeout_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if not process_gone(p)]
    return alive


def _wait_adopted(d, names, what: str = "every adopted engine READY") -> None:
    d.wait_for(lambda: all(d.engine(n)["state"] == "READY" for n in names), 30, what)


def _cleanup(pids: set[int]) -> None:
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


def test_a_new_engined_adopts_every_engine_after_a_sigkill(engined):
    gateway, http = free_port(), free_port()
    d = engined(FLEET, ready=False, supervisor={"gateway": f"127.0.0.1:{gateway}",
                                                "http": f"127.0.0.1:{http}",
                                                "orphan_timeout": "60s"})
    d.wait_state("bad-0", "FAILED", timeout_s=30)
    for name in ("echo-0", "echo-1", "echo-standby-0", "ex-0", "web-0"):
        d.wait_state(name, "READY", timeout_s=30)
    d.ctl("stop", "ex-0")
    d.wait_state("ex-0", "STOPPED")
    before = identity(d)
    bad = d.engine("bad-0")
    with Clients(gateway, threads=4) as clients:
        d.wait_for(lambda: clients.ok >= 8, 30, "requests flowing")
    assert clients.errors == [], clients.errors[:5]
    served = metric(http, 'engined_gateway_requests_total{model="echo",outcome="ok"}')

    def saved_count() -> float:  # the snapshot on disk is kept current (within milliseconds)
        try:
            saved = json.loads((d.runtime_dir / "state.json").read_text())
        except (OSError, ValueError):
            return -1
        return sum(n for m, o, n in saved["counters"]["gateway_requests"]
                   if (m, o) == ("echo", "ok"))

    d.wait_for(lambda: saved_count() == served, 10, "the snapshot to have every request")
    events_before = d.ctl("events", "-n", "1000").stdout.splitlines()
    old_pid = d.pid
    tree = _kill_daemon(d)
    try:
        time.sleep(1.0)  # the engines outlive their daemon
        assert all(psutil.Process(p).is_running() for p, *_ in before.values()), before
        d.expect_unclean_exit = False
        started = time.monotonic()
        d.start()
        _wait_adopted(d, before)
        print(f"adopted and READY {time.monotonic() - started:.2f}s after the new engined "
              f"started")
        assert identity(d) == before  # same processes, same start times, counts unchanged
        engines = d.engines()
        for name in before:
            assert engines[name]["adopted_at"], engines[name]
        assert engines["ex-0"]["state"] == "STOPPED" and engines["ex-0"]["pid"] is None
        assert engines["bad-0"]["state"] == "FAILED", engines["bad-0"]
        for key in ("restarts_by_reason", "last_exit", "fail_reason", "incarnation"):
            assert engines["bad-0"][key] == bad[key], (key, engines["bad-0"], bad)
        sup = d.status()["supervisor"]
        assert sup["handovers"] == 1 and sup["recovered_from"] == old_pid, sup
        # served through the new daemon by the adopted engines; the counters went on
        with Clients(gateway, threads=4) as clients:
            d.wait_for(lambda: clients.ok >= 8, 30, "requests after the adoption")
        assert clients.errors == [], clients.errors[:5]
        assert metric(http, 'engined_gateway_requests_total{model="echo",outcome="ok"}') \
            >= served + 8
        assert metric(http, "engined_handovers_total") == 1
        events = d.ctl("events", "-n", "1000").stdout.splitlines()
        assert events[:len(events_before)] == events_before
        recovery = [json.loads(e) for e in events if '"recovery"' in e]
        assert len(recovery) == 1 and recovery[0]["pid"] == old_pid, recovery
        assert recovery[0]["adopted"] == sorted(before), recovery
        # still supervised: a kill is a restart as ever
        victim = engines["echo-0"]["pid"]
        psutil.Process(victim).kill()
        now = d.wait_restarted("echo-0", victim)
        assert now["restarts"] == before["echo-0"][3] + 1, now
        assert "exited while no engined" not in d.log_text("echo-0")
        # a clean stop stops the adopted engines too, and leaves nothing
        assert d.stop() == 0
        assert _still_running(tree, 10) == []
        assert not (d.runtime_dir / "state.json").exists()
    finally:
        _cleanup(tree)


def test_an_engine_that_died_unwatched_is_said_once_and_restarted(engined):
    d = engined([FLEET[1], {**FLEET[1], "name": "other"}],
                supervisor={"orphan_timeout": "60s"})
    before = identity(d)
    tree = _kill_daemon(d)
    try:
        victim = before["ex-0"][0]
        psutil.Process(victim).kill()
        d.expect_unclean_exit = False
        d.start()
        now = d.wait_restarted("ex-0", victim)
        assert now["restarts"] == before["ex-0"][3] + 1, now
        assert now["last_exit"]["reason"] == "exit", now["last_exit"]  # its status is lost
        assert now["last_exit"]["code"] is None and now["last_exit"]["signal"] is None
        assert d.log_text("ex-0").count("exited while no engined was watching") == 1
        d.wait_state("other-0", "READY")
        assert identity(d)["other-0"] == before["other-0"]
    finally:
        d.stop()
        _cleanup(tree)


def test_with_no_new_engined_nothing_outlives_orphan_timeout(engined):
    d = _mixed_fleet(engined, "2s")
    tree = _kill_daemon(d)
    try:
        assert any(not process_gone(p) for p in tree)  # kept for a while
        assert _still_running(tree, 2 + 5) == []
        assert not (d.runtime_dir / "orphans.sock").exists()
    finally:
        _cleanup(tree)


def test_a_corrupt_snapshot_starts_fresh_and_kills_what_the_guard_proves_ours(engined):
    d = engined([FLEET[1]], supervisor={"orphan_timeout": "60s"})
    old = d.engine("ex-0")["pid"]
    tree = _kill_daemon(d)
    try:
        (d.runtime_dir / "state.json").write_bytes(b'{"format": 1, "replicas": [')
        d.expect_unclean_exit = False
        d.start()
        fresh = d.wait_all_ready()
        assert fresh["ex-0"]["pid"] != old and fresh["ex-0"]["adopted_at"] is None
        assert "cannot be used" in d.stderr_text() and "starting fresh" in d.stderr_text()
        d.wait_for(lambda: process_gone(old), 10, "the unadoptable engine killed")
        assert d.status()["supervisor"]["handovers"] == 0
    finally:
        d.stop()
        _cleanup(tree)


def _unit_stop_post(d, result: str) -> subprocess.CompletedProcess[str]:
    """The shipped unit's ExecStopPost=, run as systemd runs it after the main process ended
    (with SERVICE_RESULT), pointed at this daemon's spec and this checkout's engined."""
    unit = (REPO_ROOT / "systemd" / "engined.service").read_text()
    (line,) = [x for x in unit.splitlines() if x.startswith("ExecStopPost=")]
    command = line.removeprefix("ExecStopPost=") \
        .replace("/opt/engined/bin/engined", f"{PYTHON} -m engined.supervisor.daemon") \
        .replace("/etc/engined/fleet.yaml", str(d.spec_path))
    return subprocess.run(shlex.split(command), cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**_clean_env(), "SERVICE_RESULT": result}, timeout=60)


def test_under_the_unit_a_crash_is_adopted_and_a_stop_leaves_nothing(engined):
    """What systemd does with the shipped unit (KillMode=process: engined alone is signalled):
    after a crash (SERVICE_RESULT=signal) ExecStopPost leaves the engines to the restarted
    engined; after a stop whose engined had to be SIGKILLed (SERVICE_RESULT=timeout) it stops
    them at once."""
    d = _mixed_fleet(engined, "60s")
    before = identity(d)
    tree = _kill_daemon(d)
    try:
        crashed = _unit_stop_post(d, "signal")
        assert crashed.returncode == 0 and crashed.stdout == "", crashed
        d.expect_unclean_exit = False
        d.start()  # Restart=on-failure
        _wait_adopted(d, before, "the restarted engined to adopt every engine")
        assert identity(d) == before
        tree |= _kill_daemon(d)  # killed again, now by TimeoutStopSec's SIGKILL in a stop
        stopped = _unit_stop_post(d, "timeout")
        assert stopped.returncode == 0 and "were stopped" in stopped.stdout, stopped
        assert _still_running(tree, 10) == []
        clean = _unit_stop_post(d, "success")  # nothing was waiting: said, nothing done
        assert clean.returncode == 0 and "no engines are waiting" in clean.stdout, clean
    finally:
        _cleanup(tree)


def test_an_engine_whose_spec_changed_meanwhile_is_started_again_not_adopted(engined):
    d = engined([FLEET[1], {**FLEET[1], "name": "other", "env": dict(FLEET[1]["env"])}],
                supervisor={"orphan_timeout": "60s"})
    before = identity(d)
    tree = _kill_daemon(d)
    try:
        spec = d.spec_path.read_text()
        d.spec_path.write_text(spec.replace("ENGINED_ECHO_TOKEN_MS: '15'",
                                            "ENGINED_ECHO_TOKEN_MS: '16'", 1))
        assert d.spec_path.read_text() != spec
        d.expect_unclean_exit = False
        d.start()
        now = d.wait_all_ready()
        assert now["ex-0"]["pid"] != before["ex-0"][0] and now["ex-0"]["adopted_at"] is None
        assert "its spec changed" in d.stderr_text()
        assert identity(d)["other-0"] == before["other-0"]
        d.wait_for(lambda: process_gone(before["ex-0"][0]), 10, "the old ex-0 gone")
    finally:
        d.stop()
        _cleanup(tree)


def test_engines_adopted_after_a_crash_are_kept_by_an_upgrade_in_place(engined):
    """Adopted engines are not engined's children: across an upgrade's exec their pidfds
    (the proof of them) are handed over too, so they are kept, not restarted."""
    d = _mixed_fleet(engined, "60s")
    before = identity(d)
    tree = _kill_daemon(d)
    try:
        d.expect_unclean_exit = False
        d.start()
        _wait_adopted(d, before)
        assert identity(d) == before
        done = d.ctl("upgrade")
        assert done.returncode == 0, done.stderr
        _wait_adopted(d, before, "every engine READY after the upgrade")
        assert identity(d) == before
        assert d.status()["supervisor"]["handovers"] == 2
        assert d.ctl("generate", "still here").stdout.strip() == "still here"
        victim = before["ex-0"][0]  # still supervised: a kill is a restart as ever
        psutil.Process(victim).kill()
        assert d.wait_restarted("ex-0", victim)["restarts"] == before["ex-0"][3] + 1
    finally:
        d.stop()
        _cleanup(tree)


def test_an_engine_still_loading_at_the_crash_is_adopted_and_becomes_ready_itself(engined):
    """Adopted while loading: it is not called READY on reconnecting; its own READY, once its
    load is done, makes it READY: the same process, never restarted."""
    slow = {"name": "slow", "model": "builtin:echo", "launcher": "exec",
            "env": {"ENGINED_ECHO_LOAD_S": "4"}}
    d = engined([slow], ready=False, supervisor={"orphan_timeout": "60s"})
    loading = d.wait_state("slow-0", "STARTING", where=lambda e: e["pid"] is not None)
    tree = _kill_daemon(d)
    try:
        d.expect_unclean_exit = False
        d.start()
        e = d.engine("slow-0")
        assert e["pid"] == loading["pid"] and e["adopted_at"], e
        ready = d.wait_state("slow-0", "READY", timeout_s=30)
        assert ready["pid"] == loading["pid"] and ready["restarts"] == 0, ready
        assert ready["incarnation"] == loading["incarnation"], ready
    finally:
        d.stop()
        _cleanup(tree)


def test_an_engine_whose_ready_died_with_engined_is_ready_by_its_heartbeats(engined):
    """READY reached the engined that died but not its snapshot (the very instant of the
    death, made certain here by editing the snapshot): the engine's heartbeats, which begin
    only after its READY, make it READY under the new engined: the same process."""
    d = engined([FLEET[1]], supervisor={"orphan_timeout": "60s"})
    before = identity(d)
    tree = _kill_daemon(d)
    try:
        path = d.runtime_dir / "state.json"
        saved = json.loads(path.read_text())
        for r in saved["replicas"]:
            r["state"], r["process"]["ready_ago_s"], r["process"]["ready"] = "STARTING", None, None
        path.write_text(json.dumps(saved))
        d.expect_unclean_exit = False
        d.start()
        d.wait_state("ex-0", "READY", timeout_s=30)
        assert identity(d) == before
    finally:
        d.stop()
        _cleanup(tree)
