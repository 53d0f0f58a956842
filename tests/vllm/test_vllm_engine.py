"""End to end: real vLLM (its CPU build) inside engine children of a real daemon.

The daemon runs in the dev venv; its engines run under the vLLM venv's interpreter (`python:`,
see conftest.py) with `backend: vllm`: vLLM's LLMEngine in-process, continuous batching. Each
vLLM start costs seconds (import, config, weights), so the read-only checks and the crash checks
share one module-scoped fleet of two replicas built from etc/examples/vllm-cpu.yaml's engine
(each crash test waits for its own replica to come back); the fleet's last test stops the daemon
itself and checks every child's cleanup. Bad engine_args get a daemon of their own. Every wait
is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
import yaml

from testkit.driver import (
    ORPHAN_GRACE_S,
    REPO_ROOT,
    Daemon,
    free_port,
    process_gone,
    running_daemon,
    wait_engines_gone,
)
from testkit.logprob_cases import check_logprobs, check_tokenize
from testkit.sampling_cases import check_sampling_fields

pytestmark = pytest.mark.vllm

READY_TIMEOUT_S = 180.0  # two vLLM imports + builds sharing a small CPU box
FAILED_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 120.0
STALL_TIMEOUT_S = 3.0
HEARTBEAT_TIMEOUT_S = 5.0
CPU_EXAMPLE = REPO_ROOT / "etc" / "examples" / "vllm-cpu.yaml"
TINY_CHAT_PROMPT = "<|user|>\nhi\n<|assistant|>\n"  # checkpoint.py's template, byte ids

SUPERVISOR = {"heartbeat_interval": "0.2s", "heartbeat_timeout": f"{HEARTBEAT_TIMEOUT_S:g}s"}
# Every restart immediate (a restart loop would show at once, and the tier stays short).
DEFAULTS = {"backoff": {"initial": "0s", "max": "0s", "jitter": 0, "reset_after": "0s"},
            "start_limit": {"burst": 20, "interval": "300s"}}
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB per engine (vLLM's CPU default is far more)


def vllm_engine(name: str, python: str, cache: Path, **extra: Any) -> dict[str, Any]:
    """The example's engine (backend, engine_args, env), made small for a 2-core box."""
    (example,) = yaml.safe_load(CPU_EXAMPLE.read_text())["engines"]
    env = {**example.get("env", {}), **VLLM_ENV, "ENGINED_CACHE_DIR": str(cache),
           **extra.pop("env", {})}
    return {**example, "name": name, "python": python, "threads": 1, "max_batch_size": 8,
            "env": env, **extra}


@pytest.fixture(scope="module")
def fleet(vllm_python: str, tiny_cache: Path) -> Iterator[Daemon]:
    """vllm-0 and vllm-1: builtin:tiny-llama on vLLM, fault injection on (`!stall`), a short
    stall_timeout."""
    engine = vllm_engine("vllm", vllm_python, tiny_cache, replicas=2,
                         stall_timeout=f"{STALL_TIMEOUT_S:g}s",
                         env={"ENGINED_FAULT_INJECTION": "1"},
                         frontend_args={"enable_auto_tool_choice": True,
                                        "tool_call_parser": "hermes"})
    gateway = free_port()
    with running_daemon([engine], {**SUPERVISOR, "gateway": f"127.0.0.1:{gateway}"}, DEFAULTS,
                        prefix="egv") as daemon:
        daemon.gateway_port = gateway  # type: ignore[attr-defined]
        daemon.wait_all_ready(READY_TIMEOUT_S)
        yield daemon


@pytest.fixture
def ready_fleet(fleet: Daemon) -> Daemon:
    assert fleet.alive(), "the shared fleet's daemon is gone (an earlier test stopped it)"
    fleet.wait_all_ready(READY_TIMEOUT_S)
    return fleet


# --- helpers ------------------------------------------------------------------------------------


def _post(d: Daemon, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    code, _, raw = d.http("POST", "/v1/generate", json.dumps(body).encode(),
                          {"Content-Type": "application/json"})
    return code, json.loads(raw)


async def _stream_many(sock: str, prompts: list[str], max_tokens: int,
                       engine: str) -> list[list[tuple[float, dict[str, Any]]]]:
    """Streamed POST /v1/generate for every prompt at once; each line with its arrival time."""
    connector = aiohttp.UnixConnector(path=sock)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def one(prompt: str) -> list[tuple[float, dict[str, Any]]]:
            body = {"prompt": prompt, "max_tokens": max_tokens, "engine": engine,
                    "stream": True}
            lines = []
            async with session.post("http://engined/v1/generate", json=body) as resp:
                assert resp.status == 200, (resp.status, await resp.text())
                async for raw in resp.content:
                    if raw.strip():
                        lines.append((time.monotonic(), json.loads(raw)))
            return lines
        return list(await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)),
                                           REQUEST_TIMEOUT_S))


def _cleanup_line(log: str, name: str, incarnation: int) -> str:
    match = re.search(rf"^\[cleanup\] {name} incarnation {incarnation} reason=.*$", log, re.M)
    assert match, log[-4000:]
    return match.group(0)


def _scratch(d: Daemon) -> Path:
    """The daemon's root of its engines' TMPDIRs (engined.supervisor.host.scratch)."""
    return Path(tempfile.gettempdir()) / f"engined-scratch-{d.pid}"


def _descendants(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


# --- the shared fleet: READY, serving, batching -------------------------------------------------


def test_ready_with_device_model_and_load_time(ready_fleet: Daemon, vllm_python: str):
    d = ready_fleet
    for name in ("vllm-0", "vllm-1"):
        e = d.engine(name)
        assert e["state"] == "READY" and e["pid"], e
        assert e["device"] == "cpu", e  # from the engine's READY
        assert e["model"] == "builtin:tiny-llama", e
        assert e["dtype"], e  # vLLM's resolved dtype ("auto" on a CPU: bfloat16 or float32)
        assert e["startup_s"] > 0, e
        assert e["last_exit"] is None and e["incarnation"] == 1, e
        proc = psutil.Process(e["pid"])
        # under the vLLM venv's interpreter: forked from its fork server (or exec'd with it)
        pythons = {s["python"] for s in d.status()["supervisor"]["fork_servers"]}
        assert (e["launcher"] == "forkserver" and pythons == {vllm_python}) or \
            proc.cmdline()[:3] == [vllm_python, "-m", "engined.engine"], (e, pythons)
        assert " ".join(proc.cmdline()).startswith(f"engined: {name} (incarnation 1)")
        assert proc.children() == [], proc.children()  # vLLM in-process: no EngineCore/workers
        log = d.log_text(name)
        for phase in ("import", "weights", "warmup"):
            assert f"[load] {name} {phase}" in log, log[-3000:]
        assert re.search(rf"^\[ready\] {name} incarnation 1 loaded in [\d.]+s on cpu$", log,
                         re.M), log[-3000:]
        # vLLM's INFO logging and tqdm bars stay out of the engine's log
        assert not re.search(r"^\(\w+ pid=\d+\) INFO ", log, re.M), log[-3000:]
        assert "it/s]" not in log, log[-3000:]



# vLLM's own serving benchmark, driven from Python (the CPU wheel's `vllm` command cannot read
# its own version): random prompts through the gateway while a replica is SIGKILLed
BENCH_SERVE = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(sys.argv[1:]))
print("RESULT " + json.dumps({k: result[k] for k in ("completed", "failed")}))
"""


def test_vllms_serving_benchmark_loses_nothing_while_a_replica_is_killed(
        ready_fleet: Daemon, vllm_python: str, tiny_checkpoint: Path):
    d = ready_fleet
    victim = d.engine("vllm-1")["pid"]
    argv = [vllm_python, "-c", BENCH_SERVE, "--backend", "openai", "--endpoint",
            "/v1/completions", "--base-url", f"http://127.0.0.1:{d.gateway_port}",  # type: ignore
            "--model", "vllm", "--tokenizer", str(tiny_checkpoint), "--dataset-name", "random",
            "--random-input-len", "32", "--random-output-len", "24", "--num-prompts", "40",
            "--max-concurrency", "8", "--seed", "1", "--disable-tqdm",
            "--ready-check-timeout-sec", "60"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINED_")}
    bench = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**env, "HF_HUB_OFFLINE": "1"})
    try:
        d.wait_for(lambda: (d.engine("vllm-1").get("queue") or {}).get("running"), 120,
                   "vllm-1 serving the benchmark")
        os.kill(victim, signal.SIGKILL)
        out, _ = bench.communicate(timeout=600)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 0, out[-4000:]
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert (result["completed"], result["failed"]) == (40, 0), (result, out[-3000:])
    assert d.wait_restarted("vllm-1", victim, READY_TIMEOUT_S)["last_exit"]["signal"] == \
        "SIGKILL"

def test_the_model_server_protocol_from_vllms_scheduler(ready_fleet: Daemon):
    """The gateway port's /metrics (serverstats) for a backend: vllm engine: vLLM's own KV cache
    usage and running requests while a burst runs, and its KV cache's blocks in
    vllm:cache_config_info, parsed by Prometheus' own text parser."""
    import threading
    import urllib.request

    import openai
    from prometheus_client.parser import text_string_to_metric_families

    d = ready_fleet
    port = d.gateway_port  # type: ignore[attr-defined]

    def scrape() -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            families = text_string_to_metric_families(r.read().decode())
        return {s.name: s for f in families for s in f.samples
                if s.labels.get("model_name") == "vllm"}

    info = scrape()["vllm:cache_config_info"]
    assert int(info.labels["block_size"]) > 0 and int(info.labels["num_gpu_blocks"]) > 0, info
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0, timeout=REQUEST_TIMEOUT_S)
    burst = [threading.Thread(target=client.completions.create, kwargs={
        "model": "vllm", "prompt": f"request {i}: the quick brown fox", "max_tokens": 48})
        for i in range(12)]
    for t in burst:
        t.start()
    busy = d.wait_for(lambda: (m := scrape())["vllm:num_requests_running"].value > 0
                      and m["vllm:kv_cache_usage_perc"].value > 0 and m, 120,
                      "vLLM's running requests and KV cache usage on the gateway's /metrics",
                      interval_s=0.05)
    for t in burst:
        t.join(REQUEST_TIMEOUT_S)
    assert 0 < busy["vllm:kv_cache_usage_perc"].value <= 1
    assert busy["vllm:num_requests_running"].value <= 16  # two replicas, max_batch_size 8
    d.wait_for(lambda: scrape()["vllm:num_requests_running"].value == 0, 30, "idle again")


def test_vllms_sampling_fields_on_the_vllm_backend(ready_fleet: Daemon, tiny_checkpoint: Path):
    check_sampling_fields(lambda body: _post(ready_fleet, body), "vllm-0", tiny_checkpoint)

def test_logprobs_on_the_vllm_backend(ready_fleet: Daemon, tiny_checkpoint: Path):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ready_fleet.gateway_port}/v1",
                           api_key="none", max_retries=0, timeout=120)  # type: ignore[attr-defined]
    check_logprobs(client, "vllm", tiny_checkpoint)
    check_tokenize(ready_fleet.gateway_port, "vllm", tiny_checkpoint)  # type: ignore[attr-defined]


def test_structured_outputs_through_vllms_own_backend(ready_fleet: Daemon):
    """response_format (json_schema, json_object) and vLLM's structured_outputs (choice,
    regex), read by vLLM's own request code and enforced by its grammar backend: a random model
    can only say what the grammar allows; a schema vLLM cannot read is a 400 in its words."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ready_fleet.gateway_port}/v1",
                           api_key="none", max_retries=0, timeout=120)  # type: ignore[attr-defined]
    chat = [{"role": "user", "content": "pick a colour"}]
    for _ in range(3):
        choice = client.completions.create(model="vllm", prompt="yes or no?", max_tokens=5,
                                           extra_body={"structured_outputs": {
                                               "choice": ["yes", "no"]}})
        assert choice.choices[0].text in ("yes", "no"), choice
        digits = client.completions.create(model="vllm", prompt="a number:", max_tokens=5,
                                           temperature=1.0, extra_body={
                                               "structured_outputs": {"regex": "[0-9]{3}"}})
        assert re.fullmatch("[0-9]{3}", digits.choices[0].text), digits
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}},
              "required": ["colour"], "additionalProperties": False}
    strict = client.chat.completions.create(
        model="vllm", messages=chat, max_tokens=200, temperature=0,
        extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    assert strict.choices[0].finish_reason == "stop", strict
    assert json.loads(strict.choices[0].message.content)["colour"] in ("red", "green")
    answer = client.chat.completions.create(
        model="vllm", messages=chat, max_tokens=200, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "colour", "schema": schema}})
    content = answer.choices[0].message.content
    assert content.lstrip().startswith("{"), answer  # whitespace may fill max_tokens
    if answer.choices[0].finish_reason == "stop":
        assert json.loads(content)["colour"] in ("red", "green")
    anything = client.chat.completions.create(model="vllm", messages=chat, max_tokens=8,
                                              response_format={"type": "json_object"})
    assert anything.choices[0].message.content.lstrip().startswith("{"), anything
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="vllm", prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "[0-9", }})
    assert err.value.status_code == 400


def test_the_responses_api_on_the_vllm_backend(ready_fleet: Daemon):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ready_fleet.gateway_port}/v1",
                           api_key="none", max_retries=0, timeout=120)  # type: ignore[attr-defined]
    done = client.responses.create(model="vllm", input="hello", max_output_tokens=4,
                                   temperature=0)
    chat = client.chat.completions.create(model="vllm", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "hello"}])
    assert done.output_text == chat.choices[0].message.content  # the same chat underneath
    assert done.usage.output_tokens == chat.usage.completion_tokens


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
# what a Hermes-style model says to call it (forced here: the model's weights are random)
CALL_REGEX = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n'
              r"</tool_call>")


def test_tool_calls_read_by_vllms_own_parser(ready_fleet: Daemon, tiny_checkpoint: Path):
    """frontend_args {enable_auto_tool_choice, tool_call_parser: hermes}, as `vllm serve`'s
    flags: with tool_choice auto, vLLM's Hermes parser turns the model's tool-call text into
    tool_calls (whole and streamed, finish_reason tool_calls, the markup never shown as
    content); a named tool choice is held to a call of that function by vLLM's grammar; a
    conversation with the call and its result goes on."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ready_fleet.gateway_port}/v1",
                           api_key="none", max_retries=0, timeout=120)  # type: ignore[attr-defined]
    chat = [{"role": "user", "content": "weather in Paris?"}]
    forced = {"structured_outputs": {"regex": CALL_REGEX}}
    whole = client.chat.completions.create(model="vllm", messages=chat, tools=[WEATHER],
                                           max_tokens=128, temperature=0, extra_body=forced)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", whole
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name) == ("function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert "<tool_call>" not in (choice.message.content or "")

    names, arguments, content, finishes = [], "", "", []
    for chunk in client.chat.completions.create(model="vllm", messages=chat, tools=[WEATHER],
                                                max_tokens=128, temperature=0, stream=True,
                                                extra_body=forced):
        for c in chunk.choices:
            content += c.delta.content or ""
            for delta in c.delta.tool_calls or []:
                if delta.function and delta.function.name:
                    names.append(delta.function.name)
                arguments += (delta.function.arguments or "") if delta.function else ""
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert names == ["get_weather"] and json.loads(arguments) == {"city": "Paris"}
    assert finishes == ["tool_calls"] and "<tool_call>" not in content

    # JSON allows any whitespace, which a random model may pick forever: biased away
    vocab = json.loads((tiny_checkpoint / "tokenizer.json").read_text())["model"]["vocab"]
    no_space = {str(vocab[c]): -100 for c in ("\u0120", "\u010a", "\u0109", "\u010d")}
    named = client.chat.completions.create(
        model="vllm", messages=chat, tools=[WEATHER], max_tokens=128, temperature=0,
        logit_bias=no_space,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert len(named.choices[0].message.tool_calls) == 1, named.choices[0].message.model_dump()
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather", named
    json.loads(call.function.arguments)  # what the grammar let a random model say

    follow_up = [*chat, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    answer = client.chat.completions.create(model="vllm", messages=follow_up, tools=[WEATHER],
                                            max_tokens=4, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length"), answer


def test_generates_completions_chats_stops_and_rejects(ready_fleet: Daemon):
    d = ready_fleet
    code, first = _post(d, {"prompt": "hello world", "max_tokens": 24, "engine": "vllm-0"})
    assert code == 200, first
    assert first["engine"] == "vllm-0" and first["prompt_tokens"] == len("hello world"), first
    assert first["finish_reason"] in ("stop", "length"), first
    text = first["text"]
    assert len(text) >= 8 and first["completion_tokens"] <= 24, first
    # greedy: the same again, on the other replica (same weights, same vLLM)
    code, again = _post(d, {"prompt": "hello world", "max_tokens": 24, "engine": "vllm-1"})
    assert code == 200 and again["text"] == text, (first, again)

    # a stop string: the core ends the request (and aborts it in vLLM) before the stop text
    stop = text[6:8]
    code, stopped = _post(d, {"prompt": "hello world", "max_tokens": 24, "engine": "vllm-0",
                              "stop": stop})
    assert code == 200, stopped
    assert stopped["text"] == text[:text.index(stop)], (stop, text, stopped)
    assert stopped["finish_reason"] == "stop", stopped

    # a chat through the tokenizer's chat template
    code, chat = _post(d, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                           "engine": "vllm-1"})
    assert code == 200, chat
    assert chat["prompt_tokens"] == len(TINY_CHAT_PROMPT.encode()), chat
    assert 0 < chat["completion_tokens"] <= 4, chat

    # vLLM's own validation: a prompt longer than max_model_len (1024) is the client's error
    code, rejected = _post(d, {"prompt": "a" * 1500, "max_tokens": 4, "engine": "vllm-0"})
    assert code == 400, rejected
    assert "vllm-0" in rejected["error"] and "maximum context length is 1024" in \
        rejected["error"], rejected
    assert d.engine("vllm-0")["incarnation"] == 1  # a rejection is no crash


def test_concurrent_streams_batch_continuously(ready_fleet: Daemon):
    d = ready_fleet
    max_tokens = 200
    prompts = [f"prompt number {i}" for i in range(8)]
    results = asyncio.run(_stream_many(d.socket, prompts, max_tokens, "vllm-0"))
    first_token_at, done_at, spans = [], [], []
    for lines in results:
        *chunks, (end_at, done) = lines
        assert done.get("done") is True, lines[-3:]
        assert done["engine"] == "vllm-0", done
        assert done["finish_reason"] in ("stop", "length"), done
        streamed = [i for _, c in chunks for i in c["token_ids"]] + done["token_ids"]
        assert len(streamed) == done["completion_tokens"] > 0, done
        assert "".join(c["text"] for _, c in chunks) + done["text"]
        # streaming: tokens arrive as they come, many lines before the request ends
        assert len(chunks) >= min(10, done["completion_tokens"] // 2), (len(chunks), done)
        assert chunks[0][0] < end_at, "the first token came with the end"
        first_token_at.append(chunks[0][0])
        done_at.append(end_at)
        spans.append((chunks[0][0], chunks[-1][0]))
    # continuous batching: every request was generating before any of them had finished
    assert max(first_token_at) < min(done_at), (first_token_at, done_at)
    overlap = min(end for _, end in spans) - max(start for start, _ in spans)
    assert overlap > 0, spans  # all eight token-arrival spans overlap in time
    assert max(r[-1][1]["batch_size"] for r in results) > 1, [r[-1][1] for r in results]


def test_enginectl_stream_prints_what_generate_returns(ready_fleet: Daemon):
    d = ready_fleet
    args = ("--engine", "vllm-1", "--max-tokens", "32", "tell me something")
    whole = d.ctl("generate", *args)
    streamed = d.ctl("generate", "--stream", *args)
    assert whole.returncode == 0 and streamed.returncode == 0, (whole, streamed)
    assert streamed.stdout == whole.stdout and whole.stdout.strip(), (whole, streamed)


# --- the shared fleet: one replica at a time fails and comes back -------------------------------


def test_sigkill_restarts_with_a_new_pid(ready_fleet: Daemon):
    d = ready_fleet
    old = d.engine("vllm-1")
    # vLLM's FileStore rendezvous file, in the incarnation's own TMPDIR; a kill leaves it
    old_tmp = _scratch(d) / f"vllm-1.{old['incarnation']}"
    assert list(old_tmp.glob("vllm_dist_*")), sorted(_scratch(d).rglob("*"))
    os.kill(old["pid"], signal.SIGKILL)
    new = d.wait_restarted("vllm-1", old["pid"], READY_TIMEOUT_S)
    assert process_gone(old["pid"])
    assert not old_tmp.exists(), sorted(_scratch(d).rglob("*"))  # removed by engined
    assert new["incarnation"] == old["incarnation"] + 1, new
    assert new["last_exit"]["signal"] == "SIGKILL", new["last_exit"]
    assert new["device"] == "cpu" and new["startup_s"] > 0, new
    code, body = _post(d, {"prompt": "hello again", "max_tokens": 8, "engine": "vllm-1"})
    assert code == 200 and body["text"], body


def test_sigstop_is_a_hang_and_restarts(ready_fleet: Daemon):
    d = ready_fleet
    d.wait_state("vllm-0", "READY", where=lambda e: e["heartbeat_age_s"] is not None)
    old = d.engine("vllm-0")
    stopped_at = time.time()
    os.kill(old["pid"], signal.SIGSTOP)
    try:
        new = d.wait_restarted("vllm-0", old["pid"], READY_TIMEOUT_S)
    finally:
        if not process_gone(old["pid"]):
            os.kill(old["pid"], signal.SIGKILL)
    last = new["last_exit"]
    assert last["reason"] == "hang" and last["signal"] == "SIGKILL", last
    # not before its heartbeats could have run out (the exact deadline is pinned in the
    # lifecycle tier: test_hang_is_declared_exactly_heartbeat_timeout_after_the_last_heartbeat)
    assert last["at"] - stopped_at > 0, (last, stopped_at)
    assert process_gone(old["pid"])
    assert new["incarnation"] == old["incarnation"] + 1, new
    code, body = _post(d, {"prompt": "awake", "max_tokens": 8, "engine": "vllm-0"})
    assert code == 200 and body["text"], body


def test_frozen_busy_loop_is_a_stall_and_restarts(ready_fleet: Daemon):
    d = ready_fleet
    old = d.engine("vllm-1")
    sent_at = time.time()
    # `!stall` (ENGINED_FAULT_INJECTION=1) wedges the core's loop with the request queued in
    # vLLM; the heartbeat thread goes on, so this is a stall, not a hang.
    gen = d.ctl_popen("generate", "--engine", "vllm-1", "--max-tokens", "8", "!stall now",
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        def wedged() -> dict[str, Any] | None:
            e = d.engine("vllm-1")
            queued = e["queue"] and e["queue"]["running"] + e["queue"]["waiting"]
            return e if queued and e["pid"] == old["pid"] else None

        busy = d.wait_for(wedged, STALL_TIMEOUT_S + 2, "vllm-1 busy with the wedged request")
        assert busy["state"] == "READY", busy  # wedged, and its heartbeats go on: the verdict
        # below is a stall (a hang would mean they stopped)
        new = d.wait_restarted("vllm-1", old["pid"], READY_TIMEOUT_S)
        out, err = gen.communicate(timeout=60)
    finally:
        if gen.poll() is None:
            gen.kill()
            gen.wait()
    assert gen.returncode == 1 and "vllm-1" in err, (out, err)
    last = new["last_exit"]
    assert last["reason"] == "stall" and last["signal"] == "SIGKILL", last
    assert last["at"] - sent_at >= STALL_TIMEOUT_S - 0.5, (last, sent_at)
    assert new["incarnation"] == old["incarnation"] + 1, new
    code, body = _post(d, {"prompt": "unstuck", "max_tokens": 8, "engine": "vllm-1"})
    assert code == 200 and body["text"], body


# --- bad engine_args: exit 78 with vLLM's words, FAILED at once ---------------------------------


def test_bad_engine_args_fail_at_once_with_exit_78(engined, vllm_python: str, tiny_cache: Path):
    cases = {
        "badlen": ({"max_model_len": 0}, "max_model_len must be a positive integer"),
        "badarg": ({"no_such_arg": 1}, "unexpected keyword argument 'no_such_arg'"),
    }
    engines = [vllm_engine(name, vllm_python, tiny_cache, engine_args=args)
               for name, (args, _) in cases.items()]
    d = engined(engines, supervisor=SUPERVISOR, defaults=DEFAULTS, ready=False)
    for name in cases:
        d.wait_state(f"{name}-0", "FAILED", FAILED_TIMEOUT_S)
    d.holds(lambda: all(d.engine(f"{n}-0")["incarnation"] == 1 for n in cases), 1.0,
            "a single spawn each")
    for name, (_, message) in cases.items():
        failed = d.engine(f"{name}-0")
        assert failed["pid"] is None and failed["restarts"] == 0, failed
        last = failed["last_exit"]
        assert last["code"] == 78 and last["signal"] is None, last
        assert failed["fail_reason"].startswith("exit 78: "), failed
        assert "vLLM rejected" in failed["fail_reason"], failed
        assert message in failed["fail_reason"], failed
        assert d.log_text(f"{name}-0").count("spawned pid") == 1


# --- the shared fleet's end: the daemon's SIGTERM cleans every vLLM child up --------------------


def test_an_upgrade_in_place_keeps_both_vllm_engines(ready_fleet: Daemon):
    """The vLLM engine children are adopted as they run (same pids, same incarnations, the
    same restart counts) and serve at once through the gateway."""
    d = ready_fleet
    before = {n: (e["pid"], e["incarnation"], e["restarts"]) for n, e in d.engines().items()}
    done = d.ctl("upgrade")
    assert done.returncode == 0, done.stderr
    after = {n: (e["pid"], e["incarnation"], e["restarts"]) for n, e in d.engines().items()}
    assert after == before
    assert all(e["adopted_at"] and e["state"] == "READY" for e in d.engines().values())
    code, body = _post(d, {"prompt": "hello after", "max_tokens": 8})
    assert code == 200 and body["text"], body


def test_a_sigkilled_daemons_vllm_engines_are_adopted_by_the_next(ready_fleet: Daemon):
    """engined SIGKILLed: its vLLM engine children run on (supervisor.orphan_timeout) and the
    next engined adopts them as they are (same pids, incarnations and restart counts) and
    serves at once through the gateway."""
    d = ready_fleet
    before = {n: (e["pid"], e["incarnation"], e["restarts"]) for n, e in d.engines().items()}
    d.expect_unclean_exit = True
    d.signal(signal.SIGKILL)
    d.wait_exit()
    d.expect_unclean_exit = False
    d.start()
    d.wait_for(lambda: all(e["state"] == "READY" for e in d.engines().values()), 60,
               "every vLLM engine READY under the new engined")
    after = {n: (e["pid"], e["incarnation"], e["restarts"]) for n, e in d.engines().items()}
    assert after == before
    assert all(e["adopted_at"] for e in d.engines().values())
    assert d.status()["supervisor"]["handovers"] >= 1
    code, body = _post(d, {"prompt": "hello after a crash", "max_tokens": 8})
    assert code == 200 and body["text"], body


def test_daemon_sigterm_runs_every_vllm_cleanup_and_leaves_nothing(ready_fleet: Daemon):
    """Last in the module: it stops the shared fleet's daemon."""
    d = ready_fleet
    engines = d.engines()
    daemon = psutil.Process(d.pid)
    guard = [p.pid for p in daemon.children()
             if "engined.supervisor.host.guard" in " ".join(p.cmdline())]
    assert len(guard) == 1, daemon.children()
    processes = {pid for e in engines.values() for pid in (e["pid"], *_descendants(e["pid"]))}
    processes |= {*guard, *_descendants(guard[0])}
    d.spawned_pids()
    d.signal(signal.SIGTERM)
    assert d.wait_exit(60) == 0, d.stderr_text()[-3000:]
    deadline = time.monotonic() + ORPHAN_GRACE_S  # d.wait_for refuses an exited daemon
    while (left := sorted(p for p in processes if not process_gone(p))) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"still running after the daemon's exit: {left}"
    assert wait_engines_gone(d.spawned_pids(), d.pid, ORPHAN_GRACE_S) == []
    assert not _scratch(d).exists(), sorted(_scratch(d).rglob("*"))
    for name, e in engines.items():
        line = _cleanup_line(d.log_text(name), name, e["incarnation"])
        assert "reason=signal SIGTERM" in line, line
        assert "model_freed=1" in line and "vllm_shutdown_s=" in line, line
        assert "vllm_shutdown_failed" not in line, line
