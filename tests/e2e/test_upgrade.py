"""`enginectl upgrade` and SIGUSR2 through the real daemon: the same pid re-executes the installed
engined, which takes over every engine as it runs (same pids, same process start times, counts
and history kept), with the gateway's clients streaming throughout: none fails, none is
refused. A spec file that no longer matches the running fleet refuses the upgrade (exit 1) and
changes nothing."""

from __future__ import annotations

import json
import signal
import time

import psutil
import pytest

from testkit.driver import free_port
from testkit.handover import FLEET, Clients, identity, metric

pytestmark = pytest.mark.slow


def test_upgrade_keeps_every_engine_and_every_request(engined):
    gateway, http = free_port(), free_port()
    d = engined(FLEET, ready=False, supervisor={"gateway": f"127.0.0.1:{gateway}",
                                                "http": f"127.0.0.1:{http}"})
    d.wait_state("bad-0", "FAILED", timeout_s=30)
    for name in ("echo-0", "echo-1", "echo-standby-0", "ex-0", "web-0"):
        d.wait_state(name, "READY", timeout_s=30)
    d.ctl("stop", "ex-0")
    d.wait_state("ex-0", "STOPPED")
    assert d.ctl("start", "ex-0").returncode == 0
    before = identity(d)
    bad = d.engine("bad-0")
    forks = d.status()["supervisor"]["fork_servers"]
    events_before = d.ctl("events", "-n", "1000").stdout.splitlines()
    with Clients(gateway, threads=8) as clients:
        d.wait_for(lambda: clients.ok >= 16, 30, "requests flowing")
        served_before = metric(http, 'engined_gateway_requests_total{model="echo",outcome="ok"}')
        done = d.ctl("upgrade")
        assert done.returncode == 0, done.stderr
        assert "engined upgraded in place" in done.stdout, done.stdout
        ok_at_upgrade = clients.ok
        d.wait_for(lambda: clients.ok >= ok_at_upgrade + 16, 30, "requests after the upgrade")
    assert clients.errors == [], clients.errors[:5]

    status = d.status()
    sup = status["supervisor"]
    assert sup["pid"] == d.pid and sup["handovers"] == 1, sup
    assert sup["handover_s"] is not None and sup["handover_s"] > 0, sup
    assert sup["upgraded_from"] == sup["version"], sup
    assert identity(d) == before  # same processes, same counts
    engines = d.engines()
    for name in before:
        assert engines[name]["state"] == "READY" and engines[name]["adopted_at"], engines[name]
    assert engines["bad-0"]["state"] == "FAILED" and engines["bad-0"]["pid"] is None
    for key in ("restarts_by_reason", "last_exit", "fail_reason", "incarnation"):
        assert engines["bad-0"][key] == bad[key], (key, engines["bad-0"], bad)
    assert engines["ex-0"]["incarnation"] == 2  # its operator restart is history too
    # the counters go on (Prometheus counters never go back), the history is kept
    assert metric(http, 'engined_gateway_requests_total{model="echo",outcome="ok"}') \
        >= served_before + 16
    events_after = d.ctl("events", "-n", "1000").stdout.splitlines()
    assert events_after[:len(events_before)] == events_before
    upgrade = [json.loads(e) for e in events_after if '"upgrade"' in e]
    assert len(upgrade) == 1 and upgrade[0]["handovers"] == 1, upgrade
    assert upgrade[0]["adopted"] == sorted(before) and upgrade[0]["late"] == [], upgrade
    assert metric(http, "engined_handovers_total") == 1
    assert metric(http, "engined_handover_seconds") == sup["handover_s"]
    assert metric(http, "engined_engine_adopted_timestamp_seconds") > 0
    assert "[upgrade] engined" in d.stderr_text()
    # the engines are still supervised by the new code: a kill is a restart as ever, forked by
    # the fork server the old code started (handed over: no new preload)
    servers = sup["fork_servers"]
    assert servers == forks and all(s["state"] == "ready" for s in servers), (servers, forks)
    victim = engines["echo-0"]["pid"]
    psutil.Process(victim).kill()
    now = d.wait_restarted("echo-0", victim)
    assert now["restarts"] == before["echo-0"][3] + 1, now
    assert now["launcher"] == "forkserver", now
    assert d.status()["supervisor"]["fork_servers"] == servers


def test_sigusr2_upgrades_too_and_a_second_upgrade_follows(engined):
    d = engined([FLEET[0]])
    before = identity(d)
    d.signal(signal.SIGUSR2)
    d.wait_for(lambda: d.status()["supervisor"]["handovers"] == 1, 30, "the hand-over")
    d.wait_all_ready()
    assert identity(d) == before
    assert d.ctl("upgrade").returncode == 0
    assert d.status()["supervisor"]["handovers"] == 2
    assert identity(d) == before
    assert d.ctl("generate", "hi").stdout.strip() == "hi"


def test_an_upgrade_the_spec_file_no_longer_matches_is_refused_and_changes_nothing(engined):
    d = engined([FLEET[1]])
    before = identity(d)
    d.spec_path.write_text(d.spec_path.read_text().replace("replicas: 1", "replicas: 2"))
    refused = d.ctl("upgrade")
    assert refused.returncode == 1, refused
    assert "changed since it was loaded" in refused.stderr and "ex" in refused.stderr, refused
    d.spec_path.write_text(d.spec_path.read_text().replace("replicas: 2", "replicas: 1"))
    d.spec_path.write_text(d.spec_path.read_text().replace("launcher: exec", "launcher: 9"))
    invalid = d.ctl("upgrade")
    assert invalid.returncode == 1 and "launcher" in invalid.stderr, invalid
    time.sleep(0.2)
    assert d.status()["supervisor"]["handovers"] == 0
    assert identity(d) == before
    assert d.ctl("generate", "still here").stdout.strip() == "still here"


def test_a_hand_over_that_cannot_be_used_never_stops_engined_from_starting(engined, short_tmp):
    corrupt = short_tmp / "corrupt.json"
    corrupt.write_bytes(b'{"format": 1, "pid": ')
    d = engined([FLEET[1]], env={"ENGINED_HANDOVER": str(corrupt)})
    assert "cannot be used" in d.stderr_text() and "starting fresh" in d.stderr_text()
    assert d.status()["supervisor"]["handovers"] == 0
    environ = open(f"/proc/{d.engine('ex-0')['pid']}/environ", "rb").read()
    assert b"ENGINED_HANDOVER" not in environ  # no engine inherits it
    foreign = short_tmp / "foreign.json"  # another process's hand-over is not ours to take
    foreign.write_text('{"format": 1, "pid": 1, "handovers": 5}')
    other = engined([FLEET[1]], env={"ENGINED_HANDOVER": str(foreign)})
    assert "is pid 1's, not ours" in other.stderr_text()
    assert other.status()["supervisor"]["handovers"] == 0


def test_a_crash_loop_keeps_its_start_limit_across_an_upgrade(engined):
    """The owner's failure record (backoff streak, start-limit window) is handed over: the
    engine is parked FAILED at the same failure as without the upgrade."""
    bad = {"name": "bad", "model": "builtin:echo", "env": {"ENGINED_ECHO_FAIL": "build"},
           "backoff": {"initial": "1s", "factor": 1, "jitter": 0},
           "start_limit": {"burst": 3, "interval": "120s"}}
    d = engined([bad], ready=False)
    d.wait_for(lambda: d.engine("bad-0")["restarts"] >= 1, 30, "a first failure")
    assert d.ctl("upgrade").returncode == 0
    failed = d.wait_state("bad-0", "FAILED", timeout_s=60)
    assert failed["incarnation"] == 4, failed  # burst 3: the 4th failure gives up
    assert d.status()["supervisor"]["handovers"] == 1


@pytest.mark.parametrize("when", ["as it begins", "during the exec"])
def test_an_engine_that_dies_during_the_hand_over_is_restarted_once(engined, when):
    """Killed as the upgrade begins, the old code restarts it (the upgrade waits for it to
    settle); killed once the old code has exec'd, the new code finds its exit (our child's
    zombie, with its status) and restarts it: exactly one restart either way."""
    d = engined([dict(FLEET[1], replicas=2)])
    before = identity(d)
    victim = before["ex-0"][0]
    d.signal(signal.SIGUSR2)
    if when == "during the exec":
        d.wait_for(lambda: "[upgrade] exec " in d.stderr_text(), 30, "the exec", interval_s=0.001)
    psutil.Process(victim).kill()
    d.wait_for(lambda: d.status()["supervisor"]["handovers"] == 1, 60, "the hand-over")
    now = d.wait_restarted("ex-0", victim)
    assert now["restarts_by_reason"] == {"signal": 1} and now["incarnation"] == 2, now
    assert now["last_exit"]["signal"] == "SIGKILL", now
    assert identity(d)["ex-1"] == before["ex-1"]
    if when == "during the exec":  # the new code adopted what was left of it, then its exit
        assert f"adopted pid {victim} " in d.log_text("ex-0"), d.log_text("ex-0")


def test_engines_that_do_not_settle_in_time_refuse_the_upgrade(engined):
    slow = {"name": "slow", "model": "builtin:echo", "env": {"ENGINED_ECHO_LOAD_S": "60"}}
    d = engined([FLEET[1], slow], ready=False)
    d.wait_state("ex-0", "READY")
    d.wait_state("slow-0", "STARTING")
    refused = d.ctl("upgrade", "--timeout", "1")
    assert refused.returncode == 1, refused
    assert "starting or stopping: slow-0 (STARTING)" in refused.stderr, refused.stderr
    assert d.status()["supervisor"]["handovers"] == 0
    assert d.ctl("generate", "--engine", "ex-0", "served").stdout.strip() == "served"
