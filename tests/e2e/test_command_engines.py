"""Command engines: servers engined did not write, kept alive from outside (probes, progress,
the whole process tree), driven through the real daemon. The server is testkit/commandserver.py:
a stdlib HTTP server whose tokens come from a separate core process, like vLLM's EngineCore."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from testkit.driver import PYTHON, REPO_ROOT, process_gone

SERVER = str(REPO_ROOT / "testkit" / "commandserver.py")
FAST_PROBE = {"interval": "200ms", "timeout": "300ms", "failures": 3}
PROGRESS = {"busy": "fake:num_requests_running", "counter": "fake:generation_tokens"}


def server(name: str, *flags: str, **keys: object) -> dict[str, object]:
    spec: dict[str, object] = {"name": name, "command": [PYTHON, SERVER, "--port", "{port}",
                                                         *flags],
                               "port": "auto", "probe": FAST_PROBE}
    spec.update(keys)
    return spec


def get(port: int, path: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def read_pid(directory: Path, name: str, d) -> int:
    path = directory / f"{name}.pid"
    d.wait_for(lambda: path.exists() and path.read_text().strip(), 20, f"{path} written")
    return int(path.read_text())


@pytest.mark.smoke
def test_ready_after_a_slow_start_on_its_port_with_its_environment(engined, short_tmp):
    d = engined([server("web", "--start-delay", "1", replicas=2,
                        env={"FLAVOUR": "plain"})], ready=False)
    d.wait_for(lambda: d.engine("web-0")["state"] == "STARTING", 10, "STARTING while it loads")
    engines = d.wait_all_ready()
    ports = {e["port"] for e in engines.values()}
    assert len(ports) == 2 and None not in ports, engines  # a free loopback port per replica
    for e in engines.values():
        assert get(e["port"], "/health")[0] == 200
        env = Path(f"/proc/{e['pid']}/environ").read_bytes().split(b"\0")
        env = dict(item.decode().split("=", 1) for item in env if b"=" in item)
        assert env["PORT"] == str(e["port"]) and env["FLAVOUR"] == "plain"
        assert env["CUDA_VISIBLE_DEVICES"] == ""
        # none of the engine child's knobs: the server is not ours
        for ours in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE", "ENGINED_CONFIG", "ENGINED_PARENT_PID"):
            assert ours not in env, ours
        assert "engined" not in env.get("PYTHONPATH", "")
    assert d.engine("web-0")["startup_s"] >= 1.0  # READY came with the first passing probe
    code = d.ctl("generate", "--engine", "web", "hi")
    assert code.returncode != 0 and "command engine" in code.stderr


def test_a_fixed_port_counts_up_per_replica_and_port_in_use_fails_clearly(engined):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        d = engined([server("web", port=taken, start_limit={"burst": 2, "interval": "1m"},
                            backoff={"initial": "100ms", "max": "200ms"})], ready=False)
        failed = d.wait_state("web-0", "FAILED", 30)
        assert failed["last_exit"]["reason"] == "spawn_error", failed
        assert f"port {taken} is in use" in failed["last_exit"]["description"], failed
        assert failed["restarts_by_reason"].get("spawn_error", 0) >= 2
    # the port is free again: an operator starts it, and it runs on that very port
    assert d.ctl("start", "web").returncode == 0
    assert d.wait_state("web-0", "READY", 20)["port"] == taken


def test_never_ready_is_a_startup_timeout(engined):
    d = engined([server("web", "--never-ready", startup_timeout="1500ms")], ready=False)
    d.wait_for(lambda: d.engine("web-0")["restarts_by_reason"].get("startup_timeout"), 30,
               "a startup_timeout restart")
    assert d.engine("web-0")["last_exit"]["reason"] == "startup_timeout"


@pytest.mark.smoke
def test_a_frozen_server_fails_its_probes_and_is_restarted_as_hung(engined):
    d = engined([server("web")])
    old = d.engine("web-0")["pid"]
    os.kill(old, signal.SIGSTOP)
    d.wait_restarted("web-0", old, 30)
    e = d.engine("web-0")
    assert e["last_exit"]["reason"] == "hang" and e["restarts_by_reason"] == {"hang": 1}, e
    assert "probes failed in a row" in d.stderr_text()


def test_a_frozen_core_with_a_request_in_flight_is_a_stall(engined, short_tmp):
    """The case probes never catch: /health answers 200 while every request hangs."""
    d = engined([server("web", "--pidfile-dir", str(short_tmp), progress=PROGRESS,
                        stall_timeout="1500ms")])
    e = d.engine("web-0")
    core = read_pid(short_tmp, "core", d)
    body = json.dumps({"model": "fake-model", "prompt": "x", "max_tokens": 100000,
                       "stream": True}).encode()
    received: list[bytes] = []

    def long_request() -> None:
        request = urllib.request.Request(f"http://127.0.0.1:{e['port']}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                while chunk := answer.read(4096):
                    received.append(chunk)
        except OSError:  # it ends when the server is killed
            pass

    client = threading.Thread(target=long_request, daemon=True)
    client.start()
    d.wait_for(lambda: d.engine("web-0")["queue"]["running"] == 1, 20, "the request running")
    os.kill(core, signal.SIGSTOP)
    assert get(e["port"], "/health")[0] == 200  # hung but healthy
    d.wait_restarted("web-0", e["pid"], 30)
    assert d.engine("web-0")["last_exit"]["reason"] == "stall"
    assert process_gone(core)  # the frozen core went with its server
    client.join(30)
    assert not client.is_alive() and b"[DONE]" not in b"".join(received)  # cut off, unfinished


def test_an_idle_frozen_core_is_no_stall(engined, short_tmp):
    d = engined([server("web", "--pidfile-dir", str(short_tmp), progress=PROGRESS,
                        stall_timeout="500ms")])
    pid = d.engine("web-0")["pid"]
    core = read_pid(short_tmp, "core", d)
    os.kill(core, signal.SIGSTOP)
    try:
        d.holds(lambda: d.engine("web-0")["pid"] == pid, 2.0, "an idle engine left alone")
    finally:
        os.kill(core, signal.SIGCONT)


def test_a_core_frozen_while_idle_is_caught_by_a_canary(engined, short_tmp):
    """No client sends anything: after `idle` the prober sends the server a one-token request;
    its core is frozen (/health still 200), so no token comes within `timeout`: restarted with
    the reason canary. Before the freeze, canaries are answered and change nothing."""
    d = engined([server("web", "--pidfile-dir", str(short_tmp), progress=PROGRESS,
                        openai=True, canary={"idle": "1s", "timeout": "2s"})])
    e = d.engine("web-0")
    served = int(get(e["port"], "/metrics")[1].decode().split(
        "fake:generation_tokens_total ")[1].split()[0])
    d.wait_for(lambda: int(get(e["port"], "/metrics")[1].decode().split(
        "fake:generation_tokens_total ")[1].split()[0]) > served, 30, "an answered canary")
    assert d.engine("web-0")["pid"] == e["pid"]  # answered: nothing changes
    os.kill(read_pid(short_tmp, "core", d), signal.SIGSTOP)
    assert get(e["port"], "/health")[0] == 200  # hung but healthy
    d.wait_restarted("web-0", e["pid"], 60)
    after = d.engine("web-0")
    assert after["last_exit"]["reason"] == "canary", after
    assert after["restarts_by_reason"] == {"canary": 1}, after
    assert "answer to its canary" in d.stderr_text()


def test_a_crash_loop_backs_off_and_fails_even_with_exit_0(engined):
    """vLLM's API server exits 0 after its engine core died: under restart: always that is a
    failure (backoff, start limit), not an endless loop of model loads."""
    d = engined([server("web", "--exit-after", "0.3", "--exit-code", "0",
                        start_limit={"burst": 3, "interval": "1m"},
                        backoff={"initial": "200ms", "max": "400ms"})], ready=False)
    failed = d.wait_state("web-0", "FAILED", 60)
    assert failed["last_exit"]["code"] == 0 and "start limit" in failed["fail_reason"], failed
    assert failed["restarts_by_reason"] == {"exit": 3}, failed


def test_a_grandchild_that_left_the_group_dies_with_its_engine(engined, short_tmp):
    d = engined([server("web", "--orphan", "--pidfile-dir", str(short_tmp))])
    old = d.engine("web-0")["pid"]
    orphan, core = read_pid(short_tmp, "orphan", d), read_pid(short_tmp, "core", d)
    assert os.getsid(orphan) != os.getsid(old)  # out of the engine's session and group
    (short_tmp / "orphan.pid").unlink()
    os.kill(old, signal.SIGKILL)
    d.wait_restarted("web-0", old, 30)
    d.wait_for(lambda: process_gone(orphan) and process_gone(core), 10,
               "the old incarnation's descendants gone")
    new_orphan = read_pid(short_tmp, "orphan", d)  # the new incarnation's own
    assert not process_gone(new_orphan)


@pytest.mark.parametrize("orphan_s", [0, 1])
def test_after_a_daemon_sigkill_no_process_of_the_tree_survives(engined, short_tmp, orphan_s):
    d = engined([server("web", "--orphan", "--pidfile-dir", str(short_tmp))],
                supervisor={"orphan_timeout": f"{orphan_s}s"})
    pids = [d.engine("web-0")["pid"], read_pid(short_tmp, "orphan", d),
            read_pid(short_tmp, "core", d)]
    # the core overwrote its environment (as a process title does): only its group tells
    assert b"ENGINED_OWNER" not in Path(f"/proc/{pids[2]}/environ").read_bytes()
    d.expect_unclean_exit = True
    d.signal(signal.SIGKILL)
    d.wait_exit()
    deadline = time.monotonic() + 5.0 + orphan_s
    while time.monotonic() < deadline and not all(process_gone(p) for p in pids):
        time.sleep(0.05)
    assert all(process_gone(p) for p in pids), [p for p in pids if not process_gone(p)]


def test_without_a_probe_it_is_ready_once_started(engined, short_tmp):
    out = short_tmp / "env.txt"
    script = f"import os, time; open({str(out)!r}, 'w').write(os.environ['PORT']); time.sleep(600)"
    d = engined([{"name": "plain", "command": [PYTHON, "-c", script], "port": 20101,
                  "probe": "off"}])
    assert d.engine("plain-0")["state"] == "READY"
    d.wait_for(lambda: out.exists() and out.read_text() == "20101", 10, "PORT exported")


@pytest.mark.parametrize("engine, message", [
    ({"command": [PYTHON], "model": "builtin:echo"}, "engines[0].model: model and command"),
    ({"command": []}, "engines[0].command: must not be empty"),
    ({"command": "vllm serve x"}, "engines[0].command: must be a list of arguments"),
    ({"command": [PYTHON], "port": "auto", "probe": {"interval": "0s"}},
     "engines[0].probe.interval: must be greater than 0"),
    ({"command": [PYTHON], "port": "auto", "probe": {"failures": 0}},
     "engines[0].probe.failures: must be between 1 and 1000"),
    ({"command": [PYTHON, "{port}"]},
     "engines[0].command: uses {port} but the engine has no port"),
    ({"command": [PYTHON], "progress": "vllm"},
     "engines[0].progress: progress needs the engine's port"),
    ({"command": [PYTHON], "port": 70000}, "engines[0].port: must be auto or a port number"),
    ({"model": "builtin:echo", "probe": {}}, "engines[0].probe: probe applies to command engines"),
    ({"command": ["/nonexistent/server"]},
     "engines[0].command[0]: program /nonexistent/server not found"),
    ({"command": [PYTHON], "data_parallel": True},
     "engines[0].data_parallel: data_parallel: true is not supported"),
])
def test_bad_command_specs_are_78_naming_the_key(tmp_path, engine, message):
    import subprocess

    import yaml

    spec = tmp_path / "fleet.yaml"
    spec.write_text(yaml.safe_dump({"version": 1, "engines": [{"name": "x", **engine}]}))
    done = subprocess.run([PYTHON, "-m", "engined.supervisor.daemon", "--check", "-c", str(spec)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 78 and message in done.stderr, done.stderr
