"""The fork-server launcher through the real daemon: engines forked from a preloaded parent,
adopted by engined, restarted through it; its death costs no engine; exec where it is unsafe."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from testkit.driver import process_gone

ECHO = {"name": "echo", "replicas": 2, "model": "builtin:echo", "backoff": {"initial": "0s"}}


def fork_servers(d) -> list[dict]:
    return d.status()["supervisor"]["fork_servers"]


def ready_server(d) -> dict:
    def check():
        up = [s for s in fork_servers(d) if s["state"] == "ready"]
        return up[0] if up else None
    return d.wait_for(check, 30, "a ready fork server")


def generate(d, name: str) -> str:
    done = d.ctl("generate", name, "hello", "--max-tokens", "64")
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.smoke
def test_engines_are_forked_children_of_the_daemon_and_restart_through_the_server(engined):
    d = engined([ECHO])
    server = ready_server(d)
    engines = d.engines()
    for e in engines.values():
        assert e["launcher"] == "forkserver", e
        proc = psutil.Process(e["pid"])
        assert proc.ppid() == d.pid  # adopted: a child of the daemon, not of the server
        assert os.getpgid(e["pid"]) == e["pid"]  # its own session and process group
        assert proc.name() == e["name"]  # PR_SET_NAME: ps and top tell the engines apart
    # the server held only the threads it had after preloading, and no GPU device
    server_proc = psutil.Process(server["pid"])
    assert server_proc.num_threads() == server["tasks"], server
    assert not [f for f in server_proc.open_files() if f.path.startswith("/dev/nvidia")]

    victim, sibling = engines["echo-1"], engines["echo-0"]
    os.kill(victim["pid"], signal.SIGKILL)
    new = d.wait_restarted("echo-1", victim["pid"])
    assert new["launcher"] == "forkserver" and new["incarnation"] == 2, new
    assert new["last_exit"]["signal"] == "SIGKILL", new
    assert d.engine("echo-0")["pid"] == sibling["pid"]  # the sibling is left alone
    assert ready_server(d)["pid"] == server["pid"]  # and so is the server
    assert "hello" in generate(d, "echo-1")


def test_a_dead_fork_server_costs_no_engine_and_is_replaced(engined):
    d = engined([ECHO])
    server = ready_server(d)
    pids = {n: e["pid"] for n, e in d.engines().items()}
    os.kill(server["pid"], signal.SIGKILL)
    d.wait_for(lambda: process_gone(server["pid"]), 10, "the fork server gone")
    replaced = d.wait_for(lambda: next((s for s in fork_servers(d) if s["state"] == "ready"
                                        and s["pid"] != server["pid"]), None),
                          30, "a new fork server")
    d.holds(lambda: {n: e["pid"] for n, e in d.engines().items()} == pids, 1.0,
            "every engine keeps running")
    for name in pids:
        assert "hello" in generate(d, name)
    os.kill(pids["echo-0"], signal.SIGKILL)
    new = d.wait_restarted("echo-0", pids["echo-0"])
    assert new["launcher"] == "forkserver", new
    assert psutil.Process(new["pid"]).ppid() == d.pid
    assert replaced["pid"] in {s["pid"] for s in fork_servers(d)}


def test_launcher_exec_still_works_per_engine_and_per_supervisor(engined):
    d = engined([dict(ECHO, launcher="exec"), {"name": "other", "model": "builtin:echo"}])
    engines = d.engines()
    assert engines["echo-0"]["launcher"] == engines["echo-1"]["launcher"] == "exec"
    assert engines["other-0"]["launcher"] == "forkserver"
    exec_child = psutil.Process(engines["echo-0"]["pid"])
    assert exec_child.ppid() == d.pid and exec_child.exe() == psutil.Process(d.pid).exe()
    d2 = engined([ECHO], supervisor={"launcher": "exec"})
    assert {e["launcher"] for e in d2.engines().values()} == {"exec"}
    assert fork_servers(d2) == []
    old = d2.engine("echo-0")["pid"]
    os.kill(old, signal.SIGKILL)
    assert d2.wait_restarted("echo-0", old)["launcher"] == "exec"


def test_an_unsafe_fork_server_is_refused_and_engines_start_by_exec(engined):
    """A thread the server did not have after preloading may hold a lock a child would inherit:
    the server refuses to fork, exits, and the engine starts by exec, saying why."""
    d = engined([dict(ECHO, replicas=1, env={"ENGINED_FAULT_FORKSERVER_THREAD": "1"})])
    e = d.engine("echo-0")
    assert e["launcher"].startswith("exec (fork server: unsafe:"), e
    assert "thread" in e["launcher"], e
    assert "hello" in generate(d, "echo-0")


@pytest.mark.parametrize("orphan_s", [0, 1])
def test_after_a_daemon_sigkill_no_fork_server_engine_or_standby_survives(engined, orphan_s):
    d = engined([dict(ECHO, standby=1)], supervisor={"orphan_timeout": f"{orphan_s}s"})
    assert d.engine("echo-standby-0")["role"] == "standby"
    server = ready_server(d)
    pids = {e["pid"] for e in d.engines().values()} | {server["pid"]}
    d.expect_unclean_exit = True
    d.signal(signal.SIGKILL)
    d.wait_exit()
    d.wait_for(lambda: all(process_gone(p) for p in pids), 20 + orphan_s,
               "the fork server and every engine gone")


@pytest.mark.timeout(300)
def test_tiny_llama_crash_to_ready_through_the_fork_server(engined, tiny_cache):
    d = engined([{"name": "tiny", "model": "builtin:tiny-llama", "backoff": {"initial": "0s"},
                  "env": {"ENGINED_CACHE_DIR": str(tiny_cache)}}],
                supervisor={"heartbeat_timeout": "30s"})
    e = d.engine("tiny-0")
    assert e["launcher"] == "forkserver", e
    server = ready_server(d)
    assert server["kind"] == "transformers" and server["import_s"] > 0, server
    os.kill(e["pid"], signal.SIGKILL)
    new = d.wait_restarted("tiny-0", e["pid"], 120)
    assert new["launcher"] == "forkserver", new
    done = d.ctl("generate", "tiny-0", "hello", "--max-tokens", "4")
    assert done.returncode == 0 and done.stdout.strip(), done
