"""Warm standbys through the real daemon: a spare replica, built and heartbeating but never
routed, takes over a replica that dies (its name, routable at once), and a new spare is built."""

from __future__ import annotations

import os
import signal

import openai
import pytest

from testkit.driver import free_port, process_gone

GROUP = {"name": "echo", "replicas": 2, "standby": 1, "model": "builtin:echo",
         "backoff": {"initial": "0s"}}
TEXT = "the quick brown fox jumps over the lazy dog"


@pytest.mark.smoke
def test_a_standby_takes_over_a_sigkilled_replica_under_its_name(engined):
    d = engined([GROUP])
    engines = d.engines()
    assert [(n, e["role"]) for n, e in engines.items()] == [
        ("echo-0", "serving"), ("echo-1", "serving"), ("echo-standby-0", "standby")]
    spare = engines["echo-standby-0"]
    table = d.ctl("status").stdout
    assert "READY (standby)" in table, table
    # never routed: requests without a name go to serving replicas only
    for _ in range(6):
        assert d.ctl("generate", "x").returncode == 0
    assert d.engine("echo-standby-0")["queue"] in (None, {"waiting": 0, "running": 0})

    victim = engines["echo-1"]
    os.kill(victim["pid"], signal.SIGKILL)
    now = d.wait_restarted("echo-1", victim["pid"])
    assert now["pid"] == spare["pid"], (now, spare)  # the spare's process, promoted
    assert now["incarnation"] == 2 and now["restarts_by_reason"] == {"signal": 1}, now
    assert now["last_exit"]["signal"] == "SIGKILL" and now["role"] == "serving"
    assert d.ctl("generate", "--engine", "echo-1", "mine").stdout.strip() == "mine"
    # heartbeats of the promoted process reach the replica it now is
    d.wait_for(lambda: (d.engine("echo-1")["heartbeat_age_s"] or 9) < 1.0, 10, "a heartbeat")
    assert "promoted standby echo-standby-0" in d.log_text("echo-1")
    assert "promoting standby echo-standby-0" in d.stderr_text()
    # a new spare is built in the background
    rebuilt = d.wait_restarted("echo-standby-0", spare["pid"])
    assert rebuilt["role"] == "standby" and rebuilt["incarnation"] == 2
    assert d.engine("echo-0")["pid"] == engines["echo-0"]["pid"]  # the sibling untouched

    # the promoted process dies in turn: its exit is the replica's, the next spare takes over
    os.kill(now["pid"], signal.SIGKILL)
    again = d.wait_restarted("echo-1", now["pid"])
    assert again["pid"] == rebuilt["pid"] and again["restarts"] == 2, again
    d.wait_for(lambda: process_gone(now["pid"]), 10, "the promoted process reaped")


def test_without_a_ready_standby_a_replica_restarts_as_usual_and_a_dead_spare_is_rebuilt(
        engined):
    d = engined([dict(GROUP, replicas=1)])
    spare = d.engine("echo-standby-0")
    os.kill(spare["pid"], signal.SIGKILL)  # the spare itself: rebuilt, nobody promoted
    rebuilt = d.wait_restarted("echo-standby-0", spare["pid"])
    assert rebuilt["restarts_by_reason"] == {"signal": 1}
    d.ctl("stop", "echo-standby-0")
    d.wait_state("echo-standby-0", "STOPPED")
    victim = d.engine("echo-0")
    os.kill(victim["pid"], signal.SIGKILL)
    now = d.wait_restarted("echo-0", victim["pid"])
    assert now["launcher"] == "forkserver" and now["pid"] != rebuilt["pid"], now
    assert d.engine("echo-standby-0")["state"] == "STOPPED"


def test_with_the_gateway_a_stream_on_a_killed_replica_loses_nothing(engined):
    port = free_port()
    slow = dict(GROUP, env={"ENGINED_ECHO_TOKEN_MS": "40"})
    d = engined([slow], supervisor={"gateway": f"127.0.0.1:{port}"})
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0, timeout=60)
    spare = d.engine("echo-standby-0")["pid"]
    stream = client.completions.create(model="echo", prompt=TEXT, max_tokens=100, stream=True)
    chunks: list[str] = []
    killed = None
    for chunk in stream:
        if chunk.choices:
            chunks.append(chunk.choices[0].text)
        if killed is None and len("".join(chunks)) >= 5:
            busy = d.wait_for(lambda: next((n for n, e in d.engines().items()
                                            if (e["queue"] or {}).get("running")), None),
                              10, "the replica running the stream")
            assert busy != "echo-standby-0"
            killed = busy
            os.kill(d.engine(busy)["pid"], signal.SIGKILL)
    assert "".join(chunks) == TEXT  # every token, none twice
    d.wait_for(lambda: d.engine(killed)["pid"] == spare, 10, f"{killed} served by the spare")
    done = client.completions.create(model="echo", prompt="after", max_tokens=10)
    assert done.choices[0].text == "after"


@pytest.mark.smoke
def test_spec_rules_for_standbys(tmp_path):
    from engined.supervisor.spec import SpecError, load_fleet

    def problems(engine: dict) -> str:
        import yaml

        path = tmp_path / "fleet.yaml"
        path.write_text(yaml.safe_dump({"version": 1, "engines": [engine]}))
        try:
            load_fleet(path)
        except SpecError as exc:
            return str(exc)
        return ""

    assert "data_parallel" in problems(dict(GROUP, data_parallel=True))
    assert "command engine" in problems({"name": "c", "command": ["/bin/true"], "standby": 1})
    gpus = problems(dict(GROUP, gpus=[0, 1], gpus_per_replica=1))
    assert "(replicas (2) + standby (1)) x gpus_per_replica (1) = 3" in gpus, gpus
    assert problems(dict(GROUP, gpus=[0, 1, 2], gpus_per_replica=1)) == ""
    assert problems(dict(GROUP)) == ""
    path = tmp_path / "fleet.yaml"
    path.write_text("version: 1\nengines:\n  - {name: echo, model: 'builtin:echo', standby: 1}\n"
                    "  - {name: echo-standby, model: 'builtin:echo'}\n")
    try:
        load_fleet(path)
        raise AssertionError("a replica named like a standby was accepted")
    except SpecError as exc:
        assert "standby echo-standby-0" in str(exc), exc
