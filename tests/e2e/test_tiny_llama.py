"""End to end: the real daemon serving real tiny-llama engines (torch on CPU) through enginectl
and HTTP.

The tiny model is built once per session into its own cache directory, which every engine gets
through the spec's `env: {ENGINED_CACHE_DIR: ...}`. The read-only checks and the single-replica
crash checks share one module-scoped fleet (each crash test waits until the fleet is READY again);
the model-error tests start their own daemon. The GPU tests are in test_gpu.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import psutil
import pytest

from testkit.driver import (
    Daemon,
    free_port,
    process_gone,
    running_daemon,
)
from testkit.logprob_cases import check_logprobs, check_tokenize
from testkit.sampling_cases import check_sampling_fields

pytestmark = pytest.mark.slow

READY_TIMEOUT_S = 120.0  # torch import + load + warm-up, two replicas sharing a small CPU box
FAILED_TIMEOUT_S = 60.0
TORCH_LIBS = ("libtorch", "libc10")  # libtorch_cpu.so, libtorch_python.so, libc10.so, ...

# Faster and sturdier than the fixture defaults for torch children: every restart is immediate
# (so a restart loop would show at once), and a box busy with other tests does not look hung.
SUPERVISOR = {"heartbeat_interval": "0.2s", "heartbeat_timeout": "5s"}
DEFAULTS = {"backoff": {"initial": "0s", "max": "0s", "jitter": 0, "reset_after": "0s"},
            "start_limit": {"burst": 20, "interval": "120s"}}


# --- fixtures -----------------------------------------------------------------------------------


def _tiny(name: str, cache: Path, replicas: int = 1, **extra: Any) -> dict[str, Any]:
    env = {"ENGINED_CACHE_DIR": str(cache), **extra.pop("env", {})}
    return {"name": name, "replicas": replicas, "model": "builtin:tiny-llama", "env": env, **extra}


def _daemon(engines: list[dict[str, Any]], **supervisor: Any
            ) -> contextlib.AbstractContextManager[Daemon]:
    return running_daemon(engines, {**SUPERVISOR, **supervisor}, DEFAULTS, prefix="eg")


@pytest.fixture(scope="module")
def fleet(tiny_cache: Path) -> Iterator[Daemon]:
    """tiny-0 and tiny-1, with the `!raise` / `!stall` fault-injection prompts enabled, and the
    gateway (its port in `gateway_port`)."""
    engines = [_tiny("tiny", tiny_cache, replicas=2, env={"ENGINED_FAULT_INJECTION": "1"})]
    port = free_port()
    with _daemon(engines, gateway=f"127.0.0.1:{port}") as daemon:
        daemon.wait_all_ready(READY_TIMEOUT_S)
        daemon.gateway_port = port  # type: ignore[attr-defined]
        yield daemon


@pytest.fixture
def ready_fleet(fleet: Daemon) -> Daemon:
    """The shared fleet, READY (a previous test may have just restarted a replica)."""
    fleet.wait_all_ready(READY_TIMEOUT_S)
    return fleet


# --- helpers ------------------------------------------------------------------------------------


def _mapped_libraries(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
        return {os.path.basename(line.split()[-1]) for line in maps if "/" in line}


def _torch_libraries(pid: int) -> list[str]:
    return sorted(lib for lib in _mapped_libraries(pid) if lib.startswith(TORCH_LIBS))


async def _generate_many(sock: str, prompts: list[str], max_tokens: int,
                         engine: str | None = None) -> list[tuple[int, dict[str, Any]]]:
    """POST /v1/generate for every prompt at once over the unix socket."""
    connector = aiohttp.UnixConnector(path=sock)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def one(prompt: str) -> tuple[int, dict[str, Any]]:
            body = {"prompt": prompt, "max_tokens": max_tokens, "engine": engine}
            async with session.post("http://engined/v1/generate", json=body) as resp:
                return resp.status, await resp.json()
        return list(await asyncio.gather(*(one(p) for p in prompts)))


def _generate_text(d: Daemon, *args: str) -> str:
    out = d.ctl("generate", *args)
    assert out.returncode == 0, out
    assert out.stdout.strip(), out
    return out.stdout.strip()


def _cleanup_line(log: str, name: str, incarnation: int) -> str:
    match = re.search(rf"^\[cleanup\] {name} incarnation {incarnation} reason=.*$", log, re.M)
    assert match, log[-4000:]
    return match.group(0)


# --- the shared fleet: read-only checks ---------------------------------------------------------


def test_fleet_ready_generates_and_reports_startup(ready_fleet: Daemon):
    d = ready_fleet
    assert d.ctl("status", "tiny").returncode == 0

    assert _generate_text(d, "hello")
    js = d.ctl("generate", "--json", "--max-tokens", "8", "hello")
    assert js.returncode == 0, js
    result = json.loads(js.stdout)
    assert result["engine"] in ("tiny-0", "tiny-1")

    status = d.ctl("status", "--json", "tiny")
    assert status.returncode == 0, status
    engines = json.loads(status.stdout)["engines"]
    assert [e["name"] for e in engines] == ["tiny-0", "tiny-1"]
    for e in engines:
        assert e["state"] == "READY" and e["pid"], e
        assert e["model"] == "builtin:tiny-llama", e
        assert e["startup_s"] > 0, e
        assert e["device"] == "cpu" and e["dtype"] == "float32", e  # from its READY
        assert e["gpus"] == [] and e["gpu_memory"] == [], e

    pinned = d.ctl("generate", "--json", "--engine", "tiny-1", "--max-tokens", "8", "hello")
    assert pinned.returncode == 0, pinned
    data = json.loads(pinned.stdout)
    assert data["engine"] == "tiny-1"
    assert data["text"].strip()
    assert data["prompt_tokens"] == len("hello")  # byte-level tokenizer
    assert 0 < data["completion_tokens"] <= 8
    assert data["batch_size"] == 1


def test_vllms_sampling_fields_on_the_transformers_backend(ready_fleet: Daemon,
                                                           tiny_checkpoint: Path):
    def post(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        code, _, raw = ready_fleet.http("POST", "/v1/generate", json.dumps(body).encode(),
                                        {"Content-Type": "application/json"})
        return code, json.loads(raw)

    check_sampling_fields(post, "tiny-0", tiny_checkpoint)


def test_logprobs_and_what_the_transformers_backend_refuses(ready_fleet: Daemon,
                                                            tiny_checkpoint: Path):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ready_fleet.gateway_port}/v1",
                           api_key="none", max_retries=0, timeout=120)
    check_logprobs(client, "tiny", tiny_checkpoint)
    check_tokenize(ready_fleet.gateway_port, "tiny", tiny_checkpoint)
    with pytest.raises(openai.BadRequestError) as err:  # what this backend cannot do: named
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       extra_body={"structured_outputs": {"regex": "[0-9]+"}})
    assert err.value.param == "structured_outputs" and "transformers" in err.value.message


def test_daemon_never_maps_torch(ready_fleet: Daemon):
    d = ready_fleet
    _generate_text(d, "--engine", "tiny-0", "hello")  # the daemon has served a torch result
    assert _torch_libraries(d.pid) == []
    for name in ("tiny-0", "tiny-1"):
        # The same check finds torch in an engine: it can fail.
        assert _torch_libraries(d.engine(name)["pid"]), name


def test_children_have_bounded_threads_and_no_gpus(ready_fleet: Daemon):
    engines = ready_fleet.engines()
    for name in ("tiny-0", "tiny-1"):
        env = psutil.Process(engines[name]["pid"]).environ()
        assert env["OMP_NUM_THREADS"] == "1", name  # the default
        assert env["CUDA_VISIBLE_DEVICES"] == "", name  # a CPU engine cannot reach a GPU
        assert env["HF_HUB_OFFLINE"] == "1", name


def test_threads_setting_reaches_the_child(engined):
    # The launcher sets the bound whatever the model; echo starts in milliseconds.
    d = engined([{"name": "echo", "replicas": 1, "model": "builtin:echo", "threads": 2}])
    env = psutil.Process(d.engine("echo-0")["pid"]).environ()
    assert env["OMP_NUM_THREADS"] == "2" and env["ENGINED_NUM_THREADS"] == "2"


def test_concurrent_requests_are_batched(ready_fleet: Daemon):
    d = ready_fleet
    prompts = [f"prompt number {i}" for i in range(16)]
    results = asyncio.run(_generate_many(d.socket, prompts, 64))
    assert [code for code, _ in results] == [200] * 16, results
    for _, body in results:
        assert body["engine"] in ("tiny-0", "tiny-1"), body
        assert 0 < body["completion_tokens"] <= 64, body
        assert 1 <= body["batch_size"] <= 8, body  # max_batch_size
    sizes = sorted(body["batch_size"] for _, body in results)
    assert sizes[-1] > 1, sizes


# --- the shared fleet: one replica at a time crashes and comes back -----------------------------


def test_sigkilled_replica_comes_back_and_serves(ready_fleet: Daemon):
    d = ready_fleet
    old = d.engine("tiny-1")
    os.kill(old["pid"], signal.SIGKILL)
    new = d.wait_restarted("tiny-1", old["pid"], READY_TIMEOUT_S)
    assert process_gone(old["pid"])
    assert new["incarnation"] == old["incarnation"] + 1
    assert new["restarts"] == old["restarts"] + 1
    assert new["last_exit"]["signal"] == "SIGKILL", new["last_exit"]
    assert new["startup_s"] > 0
    assert _generate_text(d, "--engine", "tiny-1", "hello again")
    assert d.engine("tiny-1")["pid"] == new["pid"]


def test_sigterm_runs_cleanup_and_reports_it(ready_fleet: Daemon):
    d = ready_fleet
    old = d.engine("tiny-1")
    os.kill(old["pid"], signal.SIGTERM)  # external: the daemon did not ask for it
    new = d.wait_restarted("tiny-1", old["pid"], READY_TIMEOUT_S)
    last = new["last_exit"]
    assert last["code"] == 143 and last["signal"] == "SIGTERM", last
    assert last["reason"] == "signal", last
    line = _cleanup_line(d.log_text("tiny-1"), "tiny-1", old["incarnation"])
    assert "reason=signal SIGTERM" in line and "model_freed=1" in line, line
    assert any(x.startswith("[cleanup] tiny-1") for x in last["log_tail"]), last["log_tail"]
    assert new["last_cleanup"], new  # the child's Goodbye report, kept across the restart
    assert new["last_cleanup"].get("model_freed") == 1, new["last_cleanup"]
    assert _generate_text(d, "--engine", "tiny-1", "hello")


def test_exception_in_busy_loop_runs_cleanup_and_restarts(ready_fleet: Daemon):
    d = ready_fleet
    old = d.engine("tiny-0")
    failed = d.ctl("generate", "--engine", "tiny-0", "!raise")
    assert failed.returncode == 1, failed
    assert "tiny-0" in failed.stderr, failed
    new = d.wait_restarted("tiny-0", old["pid"], READY_TIMEOUT_S)
    last = new["last_exit"]
    assert last["code"] == 1 and last["signal"] is None and last["reason"] == "exit", last
    log = d.log_text("tiny-0")
    assert "Traceback (most recent call last)" in log
    assert "RuntimeError: fault injected by request" in log
    line = _cleanup_line(log, "tiny-0", old["incarnation"])
    assert "reason=exception" in line and "model_freed=1" in line, line
    assert any("RuntimeError: fault injected" in x for x in last["log_tail"]), last["log_tail"]
    assert new["last_cleanup"].get("model_freed") == 1, new
    assert _generate_text(d, "--engine", "tiny-0", "hello")


# --- model errors: exit 78, FAILED at once ------------------------------------------------------


def _corrupt_checkpoint(checkpoint: Path, where: Path) -> Path:
    broken = where / "corrupt-model"
    shutil.copytree(checkpoint, broken)
    (broken / "config.json").write_text("{not json")
    return broken


MODEL_ERRORS = [
    pytest.param("missing", "does not exist", id="missing-directory"),
    pytest.param("corrupt", "corrupt", id="corrupt-config-json"),
    # The spec checks only a dtype's shape; the child, which has torch, rejects unknown ones.
    pytest.param("dtype", "unknown dtype 'float13'", id="unknown-dtype"),
]


@pytest.mark.parametrize("case, message", MODEL_ERRORS)
def test_model_error_fails_at_once_with_exit_78(engined, tiny_cache: Path, tiny_checkpoint: Path,
                                               short_tmp: Path, case: str, message: str):
    model = {"missing": {"path": str(short_tmp / "no-such-model")},
             "corrupt": {"path": str(_corrupt_checkpoint(tiny_checkpoint, short_tmp))},
             "dtype": {"path": str(tiny_checkpoint), "dtype": "float13"}}[case]
    bad = {"name": "bad", "replicas": 1, "model": model,
           "env": {"ENGINED_CACHE_DIR": str(tiny_cache)}}
    d = engined([bad], supervisor=SUPERVISOR, defaults=DEFAULTS, ready=False)
    d.wait_state("bad-0", "FAILED", FAILED_TIMEOUT_S)
    d.holds(lambda: d.engine("bad-0")["incarnation"] == 1, 0.5, "a single spawn")
    failed = d.engine("bad-0")
    assert failed["pid"] is None and failed["restarts"] == 0, failed
    last = failed["last_exit"]
    assert last["code"] == 78 and last["signal"] is None, last
    assert any(message in line for line in last["log_tail"]), last["log_tail"]
    assert d.log_text("bad-0").count("spawned pid") == 1
    status = d.ctl("status", "bad-0")
    assert status.returncode == 3, status
    assert "FAILED" in status.stdout and message in status.stdout, status.stdout
