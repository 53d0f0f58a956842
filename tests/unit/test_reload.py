"""Pure tables for reload planning and the sd_notify client's parsing."""

from __future__ import annotations

import os
import socket

import pytest

from engined.supervisor.observe.systemd import Notifier
from engined.supervisor.spec import parse_fleet
from engined.supervisor.spec.reload import plan_reload


def fleet(engines: str, supervisor: str = "") -> object:
    return parse_fleet(f"version: 1\n{supervisor}engines:\n{engines}")


A2 = "  - {name: a, replicas: 2, model: 'builtin:echo'}\n"
B1 = "  - {name: b, model: 'builtin:echo'}\n"


@pytest.mark.parametrize("old, new, added, removed, changed, unchanged", [
    (A2 + B1, A2 + B1, [], [], [], ["a-0", "a-1", "b-0"]),
    (A2, A2 + B1, ["b-0"], [], [], ["a-0", "a-1"]),
    (A2 + B1, A2, [], ["b-0"], [], ["a-0", "a-1"]),
    (A2 + B1, A2 + "  - {name: b, model: 'builtin:echo', max_batch_size: 4}\n",
     [], [], ["b-0"], ["a-0", "a-1"]),
    # replicas 2 -> 3 and 3 -> 1 only add or remove replicas
    (A2, "  - {name: a, replicas: 3, model: 'builtin:echo'}\n", ["a-2"], [], [], ["a-0", "a-1"]),
    ("  - {name: a, replicas: 3, model: 'builtin:echo'}\n",
     "  - {name: a, model: 'builtin:echo'}\n", [], ["a-1", "a-2"], [], ["a-0"]),
    # a data-parallel group's size is every rank's world size: a resize changes them all
    ("  - {name: d, replicas: 2, data_parallel: true, model: 'builtin:echo'}\n",
     "  - {name: d, replicas: 3, data_parallel: true, model: 'builtin:echo'}\n",
     ["d-2"], [], ["d-0", "d-1"], []),
    # GPUs split per replica: growing the list for a new replica leaves the others' GPUs alone
    ("  - {name: g, replicas: 2, gpus: [0, 1], gpus_per_replica: 1, model: 'builtin:echo'}\n",
     "  - {name: g, replicas: 3, gpus: [0, 1, 2], gpus_per_replica: 1, model: 'builtin:echo'}\n",
     ["g-2"], [], [], ["g-0", "g-1"]),
    # an env change is a change; defaults changes reach every engine they apply to
    (A2, "  - {name: a, replicas: 2, model: 'builtin:echo', env: {X: '1'}}\n",
     [], [], ["a-0", "a-1"], []),
])
def test_plan(old, new, added, removed, changed, unchanged):
    summary = plan_reload(fleet(old), fleet(new)).summary()
    assert (summary["added"], summary["removed"], summary["changed"], summary["unchanged"]) == \
        (added, removed, changed, unchanged)
    assert summary["restart_required"] == []


def test_supervisor_changes_need_a_restart():
    old = fleet(A2, "supervisor: {http: '127.0.0.1:9400'}\n")
    new = fleet(A2, "supervisor: {http: '127.0.0.1:9500', heartbeat_timeout: 20s}\n")
    assert plan_reload(old, new).summary()["restart_required"] == [
        "supervisor.http", "supervisor.heartbeat_timeout"]


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"WATCHDOG_USEC": "2000000"}, 2.0),
    ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}, 2.0),
    ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
])
def test_watchdog_interval(env, expected):
    assert Notifier(env).watchdog_s == expected


def test_notifier_without_socket_is_a_no_op():
    notifier = Notifier({})
    assert not notifier.enabled
    notifier.ready("1/1 engines ready")  # must not raise


@pytest.mark.parametrize("abstract", [False, True])
def test_notifier_sends_datagrams(tmp_path, abstract):
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"engined-test-{os.getpid()}"
    if abstract:
        server.bind("\0" + name)
        env = {"NOTIFY_SOCKET": "@" + name}
    else:
        server.bind(str(tmp_path / "notify"))
        env = {"NOTIFY_SOCKET": str(tmp_path / "notify")}
    server.settimeout(5)
    notifier = Notifier(env)
    notifier.ready("0/2 engines ready")
    notifier.status("1/2 engines ready")
    notifier.status("1/2 engines ready")  # unchanged: not sent again
    notifier.reloading()
    notifier.stopping()
    got = [server.recv(4096).decode() for _ in range(4)]
    server.close()
    notifier.close()
    assert got[0] == "READY=1\nSTATUS=0/2 engines ready"
    assert got[1] == "STATUS=1/2 engines ready"
    assert got[2].startswith("RELOADING=1\nMONOTONIC_USEC=")
    assert got[3].startswith("STOPPING=1")
