"""End to end: data-parallel groups (torch.distributed on CPU with gloo) and gang restart."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("torch")

READY_S = 120.0
SUPERVISOR = {"heartbeat_interval": "0.2s", "heartbeat_timeout": "5s"}


def _dp(cache: Path, **extra) -> dict:
    env = {"ENGINED_CACHE_DIR": str(cache), **extra.pop("env", {})}
    return {"name": "dp", "replicas": 2, "data_parallel": True, "model": "builtin:tiny-llama",
            "env": env, **extra}


@pytest.fixture
def dp_group(engined, tiny_cache):
    defaults = {"stall_timeout": "3s", "stop_timeout": "3s", "startup_timeout": "120s",
                "backoff": {"initial": "0.5s", "max": "2s", "jitter": 0, "reset_after": "60s"}}
    daemon = engined(engines=[_dp(tiny_cache)], supervisor=SUPERVISOR, defaults=defaults,
                     ready=False)
    daemon.wait_all_ready(READY_S)
    return daemon


def _generate(daemon, engine: str, prompt: str = "hello") -> subprocess.CompletedProcess:
    return daemon.ctl("generate", "--engine", engine, "--max-tokens", "8", prompt)


def test_group_reaches_ready_and_both_ranks_serve(dp_group):
    engines = dp_group.engines()
    assert [(e["group"], e["rank"]) for e in engines.values()] == [("dp", 0), ("dp", 1)]
    for name in ("dp-0", "dp-1"):
        done = _generate(dp_group, name)
        assert done.returncode == 0 and done.stdout.strip(), done.stderr
    assert "group 2 ranks joined (gloo)" in dp_group.log_text("dp-0")


def test_sigkill_of_one_rank_restarts_the_whole_group(dp_group):
    before = dp_group.engines()
    os.kill(before["dp-1"]["pid"], signal.SIGKILL)
    after = dp_group.wait_for(
        lambda: (e := dp_group.engines()) and all(
            e[n]["state"] == "READY" and e[n]["pid"] not in (None, before[n]["pid"])
            for n in e) and e, READY_S, "both ranks READY with new pids")
    assert after["dp-1"]["restarts_by_reason"] == {"signal": 1}
    assert after["dp-0"]["restarts_by_reason"] == {"group": 1}
    assert after["dp-1"]["last_exit"]["reason"] == "signal"
    assert after["dp-0"]["last_exit"]["reason"] == "group"
    for name in ("dp-0", "dp-1"):
        assert _generate(dp_group, name).returncode == 0


def test_sigstop_of_one_rank_stalls_the_serving_rank_and_restarts_the_group(dp_group):
    before = dp_group.engines()
    os.kill(before["dp-1"]["pid"], signal.SIGSTOP)
    stopped_at = time.time()
    try:
        # dp-0 takes the request and blocks in its first collective with the frozen dp-1.
        done = _generate(dp_group, "dp-0")
        assert done.returncode == 1  # failed (the rank was killed), not hung
        after = dp_group.wait_for(
            lambda: (e := dp_group.engines()) and all(
                e[n]["state"] == "READY" and e[n]["pid"] not in (None, before[n]["pid"])
                for n in e) and e, READY_S, "the group READY again")
    finally:
        try:
            os.kill(before["dp-1"]["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    first = min((after[n]["last_exit"] for n in after), key=lambda x: x["at"])
    # stall (dp-0 in a collective with the frozen rank) or hang (dp-1 frozen), whichever came
    # first, after the SIGSTOP; the other rank's exit counts as the group's. When each verdict
    # falls is pinned by tests/lifecycle/test_replica.py (test_stall_needs_work_queued_and_no_
    # loop_progress, test_hang_is_declared_exactly_heartbeat_timeout_after_the_last_heartbeat,
    # test_a_failed_rank_stops_its_peers_and_the_gang_restarts_once).
    assert first["reason"] in ("stall", "hang")
    assert first["at"] >= stopped_at, (first, stopped_at)
    reasons = {n: after[n]["last_exit"]["reason"] for n in after}
    assert sorted(reasons.values()) == sorted([first["reason"], "group"])


def test_group_that_cannot_form_ends_failed_with_every_rank_stopped(engined, tiny_cache):
    defaults = {"stop_timeout": "2s", "startup_timeout": "60s",
                "backoff": {"initial": "0.2s", "max": "1s", "jitter": 0},
                "start_limit": {"burst": 2, "interval": "120s"}}
    daemon = engined(engines=[_dp(tiny_cache, model="builtin:echo",
                                  env={"ENGINED_FAULT_BUILD_RANK": "1"})],
                     supervisor=SUPERVISOR, defaults=defaults, ready=False)
    engines = daemon.wait_for(
        lambda: (e := daemon.engines()) and all(x["state"] == "FAILED" for x in e.values())
        and e, 120, "every rank FAILED")
    assert all(e["pid"] is None for e in engines.values())
    assert "start limit" in engines["dp-0"]["fail_reason"]
    assert engines["dp-1"]["last_exit"]["reason"] == "exit"
    # 1 start + 2 restarts (burst 2), each spawning both ranks
    assert len(daemon.spawned_pids()) == 6
    assert daemon.ctl("status", "dp").returncode == 3
