"""Sleep in place (sleep_mode level1/level2: vLLM's sleep mode, docs/on-demand.md) through the
real daemon, with builtin:echo mimicking vLLM's sleep and wake_up: an idle engine is drained and
put to sleep keeping its process (ASLEEP with its pid, its requests refused by the engine while
it sleeps, routed nothing), a gateway request wakes the same process, counted as any wake; a
process that dies asleep is respawned asleep by nothing (ASLEEP, no pid) and the next request
starts a fresh one. vLLM's own sleep mode runs on CUDA and ROCm only: tests/gpu.sh."""

from __future__ import annotations

import os
import signal

import pytest

from testkit.driver import free_port
from tests.e2e.test_ondemand import client, complete, samples, sleeps_and_wakes


@pytest.mark.smoke
def test_an_idle_engine_sleeps_in_place_and_a_request_wakes_the_same_process(engined):
    gateway, http = free_port(), free_port()
    d = engined([{"name": "m", "model": "builtin:echo", "idle_timeout": "2s",
                  "min_replicas": 1, "sleep_mode": "level1"}],
                supervisor={"gateway": f"127.0.0.1:{gateway}", "http": f"127.0.0.1:{http}"})
    api = client(gateway)
    assert complete(api, "m", "ab") == "ab"
    pid = d.engines()["m-0"]["pid"]
    assert pid is not None
    # min_replicas 1 keeps it awake; an operator's sleep is in place all the same
    done = d.ctl("sleep", "m")
    assert done.returncode == 0, done
    d.wait_for(lambda: d.engines()["m-0"]["state"] == "ASLEEP", 20, "m-0 asleep in place")
    view = d.engines()["m-0"]
    assert view["pid"] == pid, view  # the process is kept
    assert view["on_demand"]["in_place"] is True and view["on_demand"]["sleep_mode"] == "level1"
    assert "asleep (level 1)" in d.log_text("m-0")
    assert "ASLEEP (by an operator, sleep level 1, wakes on request)" in d.ctl("status").stdout
    # a request wakes it: the same process, READY again, the answer as before
    assert complete(api, "m", "cd") == "cd"
    view = d.engines()["m-0"]
    assert view["state"] == "READY" and view["pid"] == pid, view
    assert sleeps_and_wakes(d) == [("m-0", "sleep", "operator"), ("m-0", "wake", "request")]
    metrics = samples(http)
    assert metrics[("engined_engine_wakes_total", (("engine", "m-0"), ("reason", "request")))] \
        == 1
    assert metrics[("engined_engine_wake_seconds_count", (("engine", "m-0"),))] == 1
    assert view["restarts"] == 0, view  # neither a sleep nor a wake is a restart


@pytest.mark.smoke
def test_an_engine_that_dies_asleep_in_place_is_woken_by_a_fresh_process(engined):
    gateway = free_port()
    d = engined([{"name": "m", "model": "builtin:echo", "idle_timeout": "1s",
                  "sleep_mode": "level2"}],
                supervisor={"gateway": f"127.0.0.1:{gateway}"}, ready=False)
    api = client(gateway)
    assert complete(api, "m", "ab") == "ab"  # it starts asleep (no process): a start wakes it
    pid = d.engines()["m-0"]["pid"]
    d.wait_for(lambda: d.engines()["m-0"]["state"] == "ASLEEP", 20, "m-0 asleep when idle")
    assert d.engines()["m-0"]["pid"] == pid
    os.kill(pid, signal.SIGKILL)
    d.wait_for(lambda: d.engines()["m-0"]["pid"] is None, 20, "its death handled")
    view = d.engines()["m-0"]
    assert view["state"] == "ASLEEP" and view["restarts"] == 0, view  # not restarted asleep
    assert complete(api, "m", "cd") == "cd"
    assert d.engines()["m-0"]["pid"] not in (None, pid)
