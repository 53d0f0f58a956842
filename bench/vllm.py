"""vLLM benchmark: vLLM under engined against vLLM on its own, in one run.

    python -m bench.vllm [--quick] [--out FILE]   # default bench/results/vllm.md,
                                                   # --quick: bench/results/vllm-quick.md

1. Serving overhead: one `backend: vllm` replica (vLLM's LLMEngine in-process in the engine
   child, builtin:tiny-llama, 1 thread) at 1 and 8 concurrent requests, max_tokens 16 and 64,
   greedy, through the control socket's `POST /v1/generate` and through the OpenAI gateway's
   `/v1/completions` (plain HTTP), against the same LLMEngine driven directly in one process
   (bench/vllm_direct.py: built by the engine child's own `build_vllm_backend`, then
   `add_request` + `step()`), against the floor (that same LLMEngine, in that process, behind
   the smallest HTTP server one could write for it: what any server costs, so that engined
   against it is what engined itself adds), and against the peer: `vllm serve` (its OpenAI
   server over the same model and engine arguments). Bursts (1 or 8 requests sent at once, the
   round timed to the last answer; paths alternate round by round): requests/s, tokens/s,
   latency p50/p95, overhead, and the fixed cost per request and per token fitted from the two
   max_tokens values. Sustained load (1b: 1 or 8 requests always in flight, each client
   sending its next request when its last one is answered; the direct worker replaces a
   finished request before its next step): throughput and latency per path.
2. Crash → READY: SIGKILL of the engine child, started by exec (`launcher: exec`, pinned: a cold
   interpreter per restart; engined's default, the fork server, is measured against exec by
   bench/recovery.py) → READY again (the daemon's own `since`) against a cold start of `vllm
   serve` (`python -m vllm.entrypoints.openai.api_server`, same model and engine arguments) from
   process start to `/health` 200, as an outer supervisor would restart it; also how long that
   server takes to exit after its EngineCore is SIGKILLed (what an outer supervisor waits for
   before it can restart anything).
3. A frozen engine core: SIGSTOP of the engine child with a streamed request in flight → the
   daemon declares it hung (`last_exit`), kills and restarts it, and the request (through the
   gateway) finishes on the replacement; against `vllm serve` with its EngineCore SIGSTOPped
   mid-request: `/health` polled for a bounded window.

The vLLM interpreter: --vllm-python, else $ENGINED_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python
(as the vLLM test tier finds it). Prints markdown tables and writes them to --out. Every
process is tracked and stopped by pid (SIGTERM, wait, SIGKILL); nothing is killed by name.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml
from driver import free_port, process_gone, read_until, stream_lines

from bench.common import (
    HEARTBEATS,
    ROOT,
    BenchDaemon,
    BenchError,
    Cleanup,
    LeanHTTP,
    Tracker,
    terminate,
    wait_until,
    without_engined_vars,
)
from bench.models import build_checkpoint
from bench.report import (
    Report,
    default_out,
    engined_revision,
    machine_lines,
    med,
    table,
)

MAX_TOKENS = (16, 64)  # the headline first; two values to fit cost per request and per token
CONCURRENCY = (1, 8)
PROMPTS = [f"vllm benchmark prompt {i}: the quick brown fox" for i in range(8)]  # equal lengths
OVERHEAD_TARGET_PCT = 5.0  # the issue's target at 8 concurrent requests
WARMUP_ROUNDS = 2
# Untimed bursts right before each timed one, on the same path. In a rotating order a path's
# round otherwise starts just after other processes ran (and its own sat idle): measured here,
# a burst after 150 ms idle took 4-5 ms longer than the next one, direct LLMEngine and engined
# alike (tiny-llama, 16 tokens, at 1 and at 8), and the cyclic rotation put each path after the
# same neighbour every time (the floor after direct in its own process: warm; engined's control
# path after the floor: cold; the gateway after it: warm), a bias of about 10 % of a round.
PRIMING = 1
PATHS = ("direct", "floor", "control", "gateway", "serve")
ENGINED_PATHS = ("control", "gateway")  # the target is theirs; `serve` is the peer
PATH_LABELS = {
    "direct": "direct `LLMEngine` (add_request + step, one process)",
    "floor": "floor: the same `LLMEngine` behind a minimal HTTP server in its process",
    "control": "engined: control socket `POST /v1/generate`",
    "gateway": "engined: gateway `POST /v1/completions`",
    "serve": "peer: `vllm serve` `POST /v1/completions`",
}
# Sustained load: this many requests per trial at each concurrency (a finished request is
# replaced at once), trials of the five paths in a rotating order.
SUSTAINED_REQUESTS = {1: 48, 8: 192}
SUSTAINED_REQUESTS_QUICK = {1: 12, 8: 48}
# Sections 1c and 1d: a heavier random model from tiny-llama's recipe (its tokenizer, head_dim
# 64), whose decode step at 8 concurrent (~12-15 ms here) is the order of a 7-13B model's on one
# GPU; tiny-llama's ~2.5 ms step is mostly vLLM's own per-step Python.
HEAVY_DIMS = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 4}
HEAVY_NAME = "heavy-llama-" + "-".join(str(v) for v in HEAVY_DIMS.values())
# its sustained load (section 1d), per trial: 12 cycles of 8 (a trial of 48 was a ±10 % noise)
HEAVY_SUSTAINED_REQUESTS = {1: 12, 8: 96}
HEAVY_SUSTAINED_REQUESTS_QUICK = {1: 4, 8: 16}
EXAMPLE = ROOT / "etc" / "examples" / "vllm-cpu.yaml"
VLLM_PYTHON_ENV = "ENGINED_VLLM_PYTHON"
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache per engine (as the vLLM tier)
ENGINE = "vllm-0"
GROUP = "vllm"  # also the gateway's model name (served_model_name defaults to it)
FREEZE_MAX_TOKENS = 900  # the in-flight request of scenario 3 (prompt + 900 < max_model_len)
FREEZE_AFTER_CHUNKS = 5  # SIGSTOP once this many streamed tokens have arrived
START_TIMEOUT_S = 300.0  # a vLLM start on a loaded 2-core box: import, config, weights, warm-up
HEALTH_POLL_S = 0.05
# `vllm serve` (its console script fails in the vllm-cpu build: the module it runs), with the
# engine arguments engined's engine gets (etc/examples/vllm-cpu.yaml; engined sets
# max_num_seqs from max_batch_size and disable_log_stats by default)
SERVE_MODULE = "vllm.entrypoints.openai.api_server"
SERVE_ARGS = ["--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "8",
              "--disable-log-stats"]

_READY_LOG_RE = re.compile(rf"^\[ready\] {ENGINE} incarnation (\d+) loaded in ([0-9.]+)s", re.M)


# --- environment ----------------------------------------------------------------------------------
def default_vllm_python() -> str:
    """Not resolved: a venv's python is a symlink, and the venv is only a venv through it."""
    return os.path.abspath(os.environ.get(VLLM_PYTHON_ENV)
                           or ROOT / ".venv-vllm" / "bin" / "python")


def vllm_versions(python: str) -> str:
    probe = ("from importlib.metadata import version as v, PackageNotFoundError as E\n"
             "def get(*names):\n"
             "    for n in names:\n"
             "        try:\n"
             "            return f'{n} {v(n)}'\n"
             "        except E:\n"
             "            pass\n"
             "    return '?'\n"
             "print(get('vllm-cpu', 'vllm') + ', ' + get('torch'))")
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60,
                          cwd="/tmp", env=without_engined_vars(None, "PYTHONPATH"))
    if done.returncode != 0:
        raise BenchError(f"{python} does not run: {done.stderr[-500:]}")
    return done.stdout.strip()


def engine_spec(python: str, cache: Path) -> dict[str, Any]:
    """etc/examples/vllm-cpu.yaml's engine (backend, engine_args, env), one replica, 1 thread,
    max_batch_size 8 (vLLM's max_num_seqs), as the vLLM test tier runs it; started by exec
    (`launcher: exec`): each restart is a cold interpreter, which scenario 2 compares with a cold
    `vllm serve` (bench/recovery.py sets its own launcher)."""
    (example,) = yaml.safe_load(EXAMPLE.read_text())["engines"]
    env = {**example.get("env", {}), **VLLM_ENV, "ENGINED_CACHE_DIR": str(cache)}
    return {**example, "name": GROUP, "replicas": 1, "python": python, "threads": 1,
            "max_batch_size": 8, "launcher": "exec", "env": env}


def direct_config(spec: dict[str, Any]) -> dict[str, Any]:
    """The EngineConfig the daemon would give replica 0 of `spec` (endpoints unused)."""
    model = spec["model"]  # builtin:NAME, or {path: DIR}
    return {"name": "direct", "group": "direct", "rank": 0, "replicas": 1, "incarnation": 1,
            "model": model["path"] if isinstance(model, dict) else model, "dtype": None,
            "gpus": [], "data_parallel": False,
            "max_batch_size": spec["max_batch_size"], "threads": spec["threads"],
            "control_endpoint": "", "request_endpoint": "", "heartbeat_interval_s": 1.0,
            "python": spec["python"], "backend": spec["backend"],
            "engine_args": dict(spec.get("engine_args") or {})}


def direct_env(spec: dict[str, Any], pythonpath: str, tmpdir: Path) -> dict[str, str]:
    """An engine child's environment as engined's exec launcher builds it
    (`launcher.child_environment`: thread bounds, offline, no GPU, the spec's env, the engine
    package on PYTHONPATH), minus the marks that make a process one of a daemon's engines, with
    `tmpdir` (the bench's scratch dir) for the TMPDIR of its own a daemon would make."""
    from engined.engine.protocol import EngineConfig
    from engined.supervisor.launcher import child_environment

    base = without_engined_vars(None, "WATCHDOG_USEC", "WATCHDOG_PID", "PYTHONPATH")
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(base)
        env = child_environment(EngineConfig(**direct_config(spec)),
                                {**spec["env"], "TMPDIR": str(tmpdir)}, pythonpath)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {k: v for k, v in env.items()
            if not k.startswith("ENGINED_") or k in spec["env"] or k == "ENGINED_NUM_THREADS"}


def serve_env() -> dict[str, str]:
    """`vllm serve`'s environment: ours without ENGINED_* and PYTHONPATH, the same thread bound,
    KV cache size and offline switches as the engine child, usage stats off (engined's default
    for its vLLM engines too)."""
    env = without_engined_vars(None, "WATCHDOG_USEC", "WATCHDOG_PID", "PYTHONPATH")
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
                "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1", **VLLM_ENV})
    return env


# --- the daemon -----------------------------------------------------------------------------------
class Daemon(BenchDaemon):
    """engined with one vLLM replica (`vllm-0`) in /tmp/evXXXXXXXX, the gateway and the HTTP
    endpoint on free loopback ports (tests/driver.py's Daemon through bench.common.BenchDaemon:
    immediate restarts, 1 s heartbeats, 10 s heartbeat timeout)."""

    log_lines = 30
    log_engines = (ENGINE,)

    def __init__(self, spec: dict[str, Any], tracker: Tracker) -> None:
        self.gateway_port, self.http_port = free_port(), free_port()
        super().__init__("ev", tracker, [spec], http=f"127.0.0.1:{self.http_port}",
                         status_timeout_s=10.0,
                         supervisor={"gateway": f"127.0.0.1:{self.gateway_port}"})
        self.engine_log = self.log_path(ENGINE)

    def start(self, timeout_s: float = START_TIMEOUT_S, interval_s: float = 0.05) -> None:
        super().start(timeout_s, interval_s)

    def wait_ready(self, min_incarnation: int, timeout_s: float = START_TIMEOUT_S,
                   interval_s: float = 0.02, name: str | None = None) -> dict[str, Any]:
        return super().wait_ready(min_incarnation, timeout_s, interval_s, name)

    def child_load_s(self, incarnation: int) -> float | None:
        """The child's own import → warm-up time, from its `[ready]` log line."""
        for inc, load_s in _READY_LOG_RE.findall(self.engine_log.read_text(errors="replace")):
            if int(inc) == incarnation:
                return float(load_s)
        return None


def http_status(port: int, path: str = "/health", timeout_s: float = 1.0) -> int | None:
    """One GET on its own connection: the status, or None (refused, reset, timed out)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def post_json(port: int, path: str, body: dict[str, Any], timeout_s: float = 120.0
              ) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


class SSEStream(threading.Thread):
    """A streamed `/v1/completions` on its own thread: the arrival time of every token event, how
    it ended (finish reason and usage, or the error)."""

    def __init__(self, port: int, body: dict[str, Any], timeout_s: float = 300.0) -> None:
        super().__init__(daemon=True)
        self.port, self.timeout_s = port, timeout_s
        self.body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        self.token_times: list[float] = []
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.ended_at: float | None = None
        self.conn: http.client.HTTPConnection | None = None

    def run(self) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout_s)
        try:
            self.conn.request("POST", "/v1/completions", json.dumps(self.body),
                              {"Content-Type": "application/json"})
            response = self.conn.getresponse()
            if response.status != 200:
                self.error = f"HTTP {response.status}: {response.read()[:300]!r}"
                return
            while True:
                line = response.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    self.error = str(event["error"])[:300]
                    continue
                if event.get("usage"):
                    self.usage = event["usage"]
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        self.token_times.append(time.time())
                    if choice.get("finish_reason"):
                        self.finish = choice["finish_reason"]
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.error = self.error or f"{type(exc).__name__}: {exc}"
        finally:
            self.ended_at = time.time()
            self.conn.close()

    def tokens_after(self, t: float) -> int:
        return sum(1 for x in self.token_times if x > t)


FREEZE_ATTEMPTS = 5  # a stream that ended before the freeze is sent again, at most this often


def stream_in_flight(port: int, body: dict[str, Any], what: str) -> SSEStream:
    """A streamed completion that has delivered FREEZE_AFTER_CHUNKS token events and is still
    running: the precondition of every freeze. A server that falls behind its engine merges the
    tokens it has not sent yet into one event (vLLM's RequestOutputCollector does), so on a loaded
    box a request can finish in fewer events than that; it is sent again then. An error ends it."""
    attempts = []
    for _ in range(FREEZE_ATTEMPTS):
        stream = SSEStream(port, body)
        stream.start()
        wait_until(lambda s=stream: len(s.token_times) >= FREEZE_AFTER_CHUNKS or s.ended_at,
                   60, f"the first tokens of {what}", 0.01)
        if not stream.ended_at:
            return stream
        if stream.error:
            raise BenchError(f"{what} failed: {stream.error}")
        span = stream.token_times[-1] - stream.token_times[0] if stream.token_times else 0.0
        attempts.append(f"{len(stream.token_times)} events over {span:.2f} s, usage "
                        f"{stream.usage}")
    raise BenchError(f"{what} ended ({stream.finish}) before {FREEZE_AFTER_CHUNKS} token events "
                     f"arrived, {FREEZE_ATTEMPTS} times: {'; '.join(attempts)}")


# --- 1. overhead ----------------------------------------------------------------------------------
@dataclass
class Round:
    elapsed_s: float
    latencies_s: list[float]
    tokens: list[int]
    finish: list[str]
    engine_s: float | None = None  # control: the slowest request's arrival → finish in the child


class DirectWorker:
    """`VLLM_PYTHON -m bench.vllm_direct CONFIG`: LLMEngine in one process, over stdin/stdout."""

    def __init__(self, python: str, spec: dict[str, Any], pythonpath: str, log: Path,
                 tracker: Tracker) -> None:
        self.log = open(log, "wb")
        self.log_path = log
        self.proc = subprocess.Popen(
            [python, "-m", "bench.vllm_direct", json.dumps(direct_config(spec))], cwd=ROOT,
            env=direct_env(spec, pythonpath, log.parent), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log, text=True)
        tracker.add(self.proc.pid)
        assert self.proc.stdout is not None
        self.lines = stream_lines(self.proc.stdout)
        self.info: dict[str, Any] = {}

    def _line(self, timeout_s: float) -> dict[str, Any]:
        try:
            (line,) = read_until(self.lines, "{", timeout_s)[-1:]
        except AssertionError as exc:
            tail = self.log_path.read_text(errors="replace").splitlines()[-20:]
            raise BenchError(f"direct worker: {exc}; exit {self.proc.poll()}\n"
                             + "\n".join(tail)) from None
        return json.loads(line)

    def wait_ready(self) -> dict[str, Any]:
        self.info = self._line(START_TIMEOUT_S)
        if not self.info.get("ready"):
            raise BenchError(f"direct worker did not start: {self.info}")
        return self.info

    def run(self, prompts: list[str], max_tokens: int, concurrency: int | None = None,
            requests: int | None = None) -> Round:
        """All `prompts` at once (a burst); with `concurrency` and `requests`, sustained load."""
        assert self.proc.stdin is not None
        job: dict[str, Any] = {"prompts": prompts, "max_tokens": max_tokens}
        if concurrency is not None:
            job.update(concurrency=concurrency, requests=requests)
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        out = self._line(120)
        return Round(out["elapsed_s"], out["latencies_s"], out["tokens"], out["finish"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # its stop signal: EOF on stdin
            terminate(self.proc, 30, sig=None)
        self.log.close()


Answer = tuple[float, int, str, float]  # latency, tokens, finish reason, life in the engine child
OneRequest = Callable[[str, int], Awaitable[Answer]]  # (prompt, max_tokens) -> its answer


def answers_round(elapsed_s: float, answers: list[Answer]) -> Round:
    """A round (or trial) of answers; the engine child's time when every answer has one."""
    lives = [a[3] for a in answers]
    return Round(elapsed_s, [a[0] for a in answers], [a[1] for a in answers],
                 [a[2] for a in answers],
                 engine_s=max(lives) if all(x == x for x in lives) else None)


async def burst(one: OneRequest, prompts: list[str], max_tokens: int) -> Round:
    """Every prompt sent at once, timed from the first send to the last answer."""
    started = time.perf_counter()
    answers = await asyncio.gather(*(one(p, max_tokens) for p in prompts))
    return answers_round(time.perf_counter() - started, list(answers))


async def control_one(client: LeanHTTP, prompt: str, max_tokens: int) -> Answer:
    """One `POST /v1/generate` (engined's control socket, or the floor's port): (latency, tokens,
    finish reason, its life in the engine child: NaN from the floor, which has no child)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "engine": ENGINE}
    started = time.perf_counter()
    status, data = await client.post("/v1/generate", body)
    if status != 200:
        raise BenchError(f"POST /v1/generate: HTTP {status}: {data}")
    return (time.perf_counter() - started, data["completion_tokens"], data["finish_reason"],
            data.get("queue_s", float("nan")) + data.get("compute_s", float("nan")))


async def completion_one(client: LeanHTTP, model: str, prompt: str, max_tokens: int) -> Answer:
    """One OpenAI `POST /v1/completions` (engined's gateway, or `vllm serve`): no child time."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    started = time.perf_counter()
    status, data = await client.post("/v1/completions", body)
    if status != 200:
        raise BenchError(f"POST /v1/completions: HTTP {status}: {data}")
    return (time.perf_counter() - started, data["usage"]["completion_tokens"],
            data["choices"][0]["finish_reason"], float("nan"))


async def sustained_trial(one: OneRequest, concurrency: int, total: int, max_tokens: int) -> Round:
    """`concurrency` clients, each sending its next request as soon as its last one answered,
    until `total` requests are done: the trial's time, every request's latency."""
    left = iter(range(total))
    answers: list[Answer] = []

    async def client() -> None:
        for k in left:
            answers.append(await one(PROMPTS[k % len(PROMPTS)], max_tokens))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return answers_round(time.perf_counter() - started, answers)


Results = dict[tuple[str, int, int], list[Round]]  # (path, concurrency, max_tokens) -> rounds


async def overhead(daemon: Daemon, worker: DirectWorker, serve: VllmServe, rounds: int,
                   trials: int, sizes: dict[int, int]) -> tuple[Results, Results]:
    """Bursts, then sustained load: every (max_tokens, concurrency) in turn, its five paths in a
    rotating order (engined's two, the same LLMEngine direct and behind the floor's minimal
    server, `vllm serve` as the peer)."""
    bursts: Results = {(p, c, m): [] for p in PATHS for c in CONCURRENCY for m in MAX_TOKENS}
    sustained: Results = {key: [] for key in bursts}
    # one keep-alive connection per client (bench/common.py's LeanHTTP: the load generator's
    # own CPU kept small, since it shares the 2 cores with what it measures)
    control, floor = LeanHTTP(unix=daemon.socket), LeanHTTP(port=worker.info["floor_port"])
    gateway, peer = LeanHTTP(port=daemon.gateway_port), LeanHTTP(port=serve.port)
    try:
        ones: dict[str, OneRequest] = {
            "floor": lambda prompt, m: control_one(floor, prompt, m),
            "control": lambda prompt, m: control_one(control, prompt, m),
            "gateway": lambda prompt, m: completion_one(gateway, GROUP, prompt, m),
            "serve": lambda prompt, m: completion_one(peer, str(serve.model), prompt, m),
        }
        for i in range(WARMUP_ROUNDS + rounds):
            for m in MAX_TOKENS:
                for c in CONCURRENCY:
                    prompts = PROMPTS[:c]
                    k = i % len(PATHS)
                    for path in PATHS[k:] + PATHS[:k]:
                        # an untimed burst first (PRIMING): the timed one is the path's second
                        # in a row, never the first after another path's processes ran
                        for _ in range(PRIMING + 1):
                            if path == "direct":
                                sample = await asyncio.to_thread(worker.run, prompts, m)
                            else:
                                sample = await burst(ones[path], prompts, m)
                        if i >= WARMUP_ROUNDS:
                            bursts[(path, c, m)].append(sample)
        for i in range(trials):
            for m in MAX_TOKENS:
                for c in CONCURRENCY:
                    n = sizes[c]
                    k = i % len(PATHS)
                    for path in PATHS[k:] + PATHS[:k]:
                        if path == "direct":
                            sample = await asyncio.to_thread(worker.run, PROMPTS, m, c, n)
                        else:
                            sample = await sustained_trial(ones[path], c, n, m)
                        sustained[(path, c, m)].append(sample)
    finally:
        for client in (control, floor, gateway, peer):
            client.close()
    return bursts, sustained


# --- 2. crash → READY, and `vllm serve` -----------------------------------------------------------
def crash_to_ready(daemon: Daemon) -> dict[str, float]:
    """SIGKILL the replica; poll status until READY with a new incarnation."""
    e = daemon.wait_ready(1)
    time.sleep(0.2)  # settle (its first heartbeats) before the kill
    t_kill = time.time()
    os.kill(e["pid"], signal.SIGKILL)
    new = daemon.wait_ready(e["incarnation"] + 1)
    seen = time.time()
    load_s = daemon.child_load_s(new["incarnation"])
    return {"ready_s": new["since"] - t_kill, "seen_s": seen - t_kill,
            "detect_s": new["last_exit"]["at"] - t_kill, "startup_s": new["startup_s"],
            "load_s": load_s if load_s is not None else float("nan")}


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def engine_core_of(pid: int) -> psutil.Process | None:
    for proc in descendants(pid):
        try:
            if "EngineCore" in proc.name() or "EngineCore" in " ".join(proc.cmdline()):
                return proc
        except psutil.Error:
            pass
    return None


class VllmServe:
    """`python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs; the console script
    fails in the vllm-cpu build) on a free loopback port, in its own session, output to a log."""

    def __init__(self, python: str, model: Path, scratch: Path, tracker: Tracker, k: int | str,
                 args: list[str] = SERVE_ARGS) -> None:
        self.python, self.model, self.tracker = python, model, tracker
        self.port = free_port()
        self.scratch, self.k = scratch, k
        self.log_path = scratch / f"serve-{k}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.seen: dict[int, psutil.Process] = {}
        self.argv = [python, "-m", SERVE_MODULE, "--model", str(model), "--host", "127.0.0.1",
                     "--port", str(self.port), *args]

    def start(self) -> float:
        """Returns the time.time() right before the spawn."""
        # its own TMPDIR in the bench's scratch dir: the ipc:// sockets and FileStore a killed
        # server leaves go with the scratch dir (engined does the same for its engines)
        tmpdir = self.scratch / f"tmp-{self.k}"
        tmpdir.mkdir(exist_ok=True)
        with open(self.log_path, "wb") as log:
            t0 = time.time()
            self.proc = subprocess.Popen(self.argv, cwd=self.scratch,
                                         env={**serve_env(), "TMPDIR": str(tmpdir)},
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.tracker.add(self.proc.pid)
        return t0

    def track(self) -> None:
        """Every descendant seen goes to the tracker (and to our own list, for stop())."""
        assert self.proc is not None
        for p in descendants(self.proc.pid):
            self.seen.setdefault(p.pid, p)
            self.tracker.add(p.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def wait_health(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Poll /health every 50 ms (each on a new connection) until 200; its time.time()."""
        def healthy() -> float | None:
            if not self.alive():
                raise BenchError(f"vllm serve exited with {self.proc.returncode}:\n"
                                 f"{self.log_tail()}")
            self.track()
            return time.time() if http_status(self.port) == 200 else None
        try:
            return wait_until(healthy, timeout_s, "vllm serve /health 200", HEALTH_POLL_S)
        except BenchError as exc:
            raise BenchError(f"{exc}\n{self.log_tail()}") from None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.alive():
            self.track()
        for p in self.seen.values():  # a stopped EngineCore could not shut down
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)  # nor a stopped API server
        terminate(self.proc, 30)
        gone, alive = psutil.wait_procs(list(self.seen.values()), timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass


def serve_freeze(serve: VllmServe, core: psutil.Process, window_s: float) -> dict[str, Any]:
    """SIGSTOP the EngineCore while a streamed completion runs; poll /health for the window."""
    stream = stream_in_flight(serve.port, {"model": str(serve.model), "prompt": PROMPTS[0],
                                           "max_tokens": FREEZE_MAX_TOKENS, "temperature": 0,
                                           "ignore_eos": True}, "vllm serve's completion")
    t_stop = time.time()
    core.send_signal(signal.SIGSTOP)
    polls: list[tuple[float, int | None]] = []
    try:
        while (now := time.time()) - t_stop < window_s:
            polls.append((now - t_stop, http_status(serve.port, timeout_s=2.0)))
            time.sleep(max(0.0, 0.25 - (time.time() - now)))
        in_window = stream.tokens_after(t_stop + 0.2)  # 0.2 s: what was already on the wire
        ended_in_window = stream.ended_at is not None
    finally:
        core.send_signal(signal.SIGCONT)
    t_cont = time.time()
    stream.join(60)
    first_bad = next((t for t, status in polls if status != 200), None)
    return {"window_s": window_s, "polls": len(polls),
            "ok_polls": sum(1 for _, s in polls if s == 200), "first_bad_s": first_bad,
            "tokens_in_window": in_window, "ended_in_window": ended_in_window,
            "after_cont": (f"finished {stream.finish!r} {time.time() - t_cont:.1f} s after "
                           f"SIGCONT, {len(stream.token_times)} tokens"
                           if stream.ended_at and not stream.error
                           else f"error: {stream.error}" if stream.ended_at
                           else "still open 60 s after SIGCONT")}


def serve_run(python: str, model: Path, scratch: Path, tracker: Tracker, k: int,
              freeze_window_s: float | None) -> dict[str, Any]:
    """One cold start (spawn → /health 200 → first completion), maybe the freeze test, then
    SIGKILL of its EngineCore → the API server's exit (vLLM is fail-stop)."""
    serve = VllmServe(python, model, scratch, tracker, k)
    out: dict[str, Any] = {}
    try:
        t0 = serve.start()
        out["health_s"] = serve.wait_health() - t0
        code, body = post_json(serve.port, "/v1/completions",
                               {"model": str(model), "prompt": PROMPTS[0],
                                "max_tokens": MAX_TOKENS[0], "temperature": 0})
        if code != 200:
            raise BenchError(f"vllm serve completion: HTTP {code}: {body}")
        out["first_completion_s"] = time.time() - t0
        serve.track()
        core = engine_core_of(serve.proc.pid)  # type: ignore[union-attr]
        if core is None:
            raise BenchError(f"no EngineCore under vllm serve: {descendants(serve.proc.pid)}")
        out["tree"] = sorted({p.name() for p in descendants(serve.proc.pid)})
        if freeze_window_s is not None:
            out["freeze"] = serve_freeze(serve, core, freeze_window_s)
            time.sleep(0.5)
        t_kill = time.time()
        core.kill()
        health_down = None
        while serve.alive() and time.time() - t_kill < 60:
            status = http_status(serve.port, timeout_s=1.0)
            if health_down is None and status != 200:
                health_down = time.time() - t_kill
            time.sleep(0.05)
        out["exit_s"] = time.time() - t_kill if not serve.alive() else None
        out["exit_code"] = serve.proc.poll()  # type: ignore[union-attr]
        out["health_down_s"] = health_down
    finally:
        serve.stop()
    return out


# --- 3. a frozen engine core under engined --------------------------------------------------------
def engined_freeze(daemon: Daemon) -> dict[str, Any]:
    """SIGSTOP the engine child while a streamed gateway completion runs on it; poll the daemon's
    /health and status until the replacement is READY; wait for the request to finish."""
    e = daemon.wait_ready(1)
    wait_until(lambda: daemon.engine()["heartbeat_age_s"] is not None, 30, "a first heartbeat",
               0.05)
    old_pid, old_inc = e["pid"], e["incarnation"]
    stream = stream_in_flight(daemon.gateway_port, {"model": GROUP, "prompt": PROMPTS[0],
                                                    "max_tokens": FREEZE_MAX_TOKENS,
                                                    "temperature": 0}, "the gateway's completion")
    t_stop = time.time()
    os.kill(old_pid, signal.SIGSTOP)
    health_bad = None
    try:
        def replaced() -> dict[str, Any] | None:
            nonlocal health_bad
            if health_bad is None and http_status(daemon.http_port) != 200:
                health_bad = time.time() - t_stop
            daemon.check_alive()
            now = daemon.engine()
            return now if now["state"] == "READY" and now["incarnation"] > old_inc else None
        new = wait_until(replaced, START_TIMEOUT_S, f"{ENGINE} READY after SIGSTOP", 0.05)
    finally:
        if not process_gone(old_pid):  # the daemon kills it; never leave a stopped process
            os.kill(old_pid, signal.SIGKILL)
    daemon.tracker.add(new["pid"])
    stream.join(120)
    last = new["last_exit"] or {}
    usage = stream.usage or {}
    return {"detect_s": last.get("at", float("nan")) - t_stop, "reason": last.get("reason"),
            "signal": last.get("signal"), "health_bad_s": health_bad,
            "ready_s": new["since"] - t_stop,
            "request": ("finished" if stream.ended_at and not stream.error else
                        f"error: {stream.error}" if stream.ended_at else "still open"),
            "request_finish": stream.finish, "request_tokens": usage.get("completion_tokens"),
            "request_done_s": (stream.ended_at - t_stop) if stream.ended_at else None,
            "tokens_before_stop": sum(1 for t in stream.token_times if t <= t_stop)}


# --- 4. `vllm serve` under engined (a command engine) ---------------------------------------------
SERVED = "served"  # the command engine's name, and its model name at the gateway
SERVED_ENGINE = f"{SERVED}-0"
# SERVE_ARGS without --disable-log-stats: `progress: vllm` reads vLLM's Prometheus counters,
# which vLLM does not keep when stats are disabled (see the README's method notes)
SERVED_ARGS = [a for a in SERVE_ARGS if a != "--disable-log-stats"]
SERVED_PROBE = {"path": "/health", "interval": "1s", "timeout": "2s", "failures": 3}
SERVED_STALL_TIMEOUT = "5s"
# serve_env()'s additions; CUDA_VISIBLE_DEVICES is engined's to set (empty: no GPUs)
SERVED_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
              "PYTHONUNBUFFERED": "1", **VLLM_ENV}
# a Kubernetes-style liveness probe on /health (httpGet): periodSeconds, timeoutSeconds,
# failureThreshold; success is 200-399
K8S_PERIOD_S, K8S_TIMEOUT_S, K8S_FAILURES = 10.0, 1.0, 3
K8S_FIRES_WITHIN = (K8S_PERIOD_S * (K8S_FAILURES - 1) + K8S_TIMEOUT_S,
                    K8S_PERIOD_S * K8S_FAILURES + K8S_TIMEOUT_S)  # after a stop: 21-31 s
HEALTH_WATCH_S = 0.25  # the /health poll of the freeze windows (each with a 2 s timeout)
FREEZES = (("core", True), ("api", True), ("api", False))  # (what is stopped, request in flight)
FREEZE_LABELS = {("core", True): "EngineCore SIGSTOP, request in flight",
                 ("api", True): "API server SIGSTOP, request in flight",
                 ("api", False): "API server SIGSTOP, idle"}


def served_spec(python: str, model: Path, cwd: Path) -> dict[str, Any]:
    """tests/vllm/test_vllm_serve.py's `serve_engine` with the bare server's arguments and
    environment; restarts, backoff and stop_timeout are the benchmarks' defaults (immediate)."""
    return {"name": SERVED, "replicas": 1,
            "command": [python, "-m", SERVE_MODULE, "--model", str(model), "--host", "127.0.0.1",
                        "--port", "{port}", *SERVED_ARGS],
            "cwd": str(cwd), "port": "auto", "progress": "vllm", "probe": dict(SERVED_PROBE),
            "env": dict(SERVED_ENV), "startup_timeout": "5m",
            "stall_timeout": SERVED_STALL_TIMEOUT}


class ServeDaemon(BenchDaemon):
    """engined with one command engine (`served-0`: `vllm serve`) and the gateway on a free
    loopback port, in /tmp/esXXXXXXXX."""

    log_lines = 30
    log_engines = (SERVED_ENGINE,)

    def __init__(self, spec: dict[str, Any], tracker: Tracker) -> None:
        self.gateway_port = free_port()
        super().__init__("es", tracker, [spec], status_timeout_s=10.0,
                         supervisor={"gateway": f"127.0.0.1:{self.gateway_port}"})

    def start(self, timeout_s: float = START_TIMEOUT_S, interval_s: float = 0.05) -> None:
        super().start(timeout_s, interval_s)

    def wait_ready(self, min_incarnation: int, timeout_s: float = START_TIMEOUT_S,
                   interval_s: float = 0.02, name: str | None = None) -> dict[str, Any]:
        return super().wait_ready(min_incarnation, timeout_s, interval_s, name)

    def tree(self, pid: int) -> list[psutil.Process]:
        """The server and its descendants, each added to the tracker (killed by pid at the end
        if anything outlived the daemon)."""
        procs = [psutil.Process(pid), *descendants(pid)]
        for p in procs:
            self.tracker.add(p.pid)
        return procs


def core_in(tree: list[psutil.Process]) -> psutil.Process:
    for proc in tree[1:]:
        try:
            if "EngineCore" in proc.name():
                return proc
        except psutil.Error:
            pass
    raise BenchError(f"no VLLM::EngineCore among the server's descendants: {tree}")


def gone(proc: psutil.Process) -> bool:
    """Exited (or a zombie); psutil's handle guards against a reused pid."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def exit_text(last: dict[str, Any]) -> str:
    how = f"signal {last['signal']}" if last.get("signal") else f"code {last.get('code')}"
    return f"{last.get('reason')} ({how})"


def spawn_to_exit(new: dict[str, Any]) -> float:
    """exit recorded → respawn: the new incarnation's spawn is READY's `since` − `startup_s`."""
    return new["since"] - new["startup_s"] - new["last_exit"]["at"]


def served_kill(daemon: ServeDaemon, target: str) -> dict[str, Any]:
    """SIGKILL of the idle server's EngineCore (`core`) or of the API server itself (`api`) →
    READY again with a new incarnation (the daemon's `since`)."""
    e = daemon.wait_ready(1)
    time.sleep(0.5)  # settle (a few probes) before the kill
    tree = daemon.tree(e["pid"])
    victim = core_in(tree) if target == "core" else tree[0]
    t_kill = time.time()
    victim.kill()
    new = daemon.wait_ready(e["incarnation"] + 1)
    seen = time.time()
    left = [p.pid for p in tree if not gone(p)]
    daemon.tree(new["pid"])
    last = new["last_exit"]
    return {"target": target, "ready_s": new["since"] - t_kill, "seen_s": seen - t_kill,
            "detect_s": last["at"] - t_kill, "respawn_s": spawn_to_exit(new),
            "startup_s": new["startup_s"], "exit": exit_text(last), "left": left}


class HealthWatch(threading.Thread):
    """GET /health every 0.25 s (each on its own connection, 2 s timeout) until stopped:
    (start, end, status or None) per poll."""

    def __init__(self, port: int, interval_s: float = HEALTH_WATCH_S, timeout_s: float = 2.0
                 ) -> None:
        super().__init__(daemon=True)
        self.port, self.interval_s, self.timeout_s = port, interval_s, timeout_s
        self.polls: list[tuple[float, float, int | None]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            began = time.time()
            status = http_status(self.port, timeout_s=self.timeout_s)
            self.polls.append((began, time.time(), status))
            self.halt.wait(max(0.0, self.interval_s - (time.time() - began)))

    def stop(self) -> None:
        self.halt.set()
        self.join(self.timeout_s + 2)

    def summary(self, t0: float, until: float) -> dict[str, Any]:
        """The polls that ended by `until` (before the server was killed): how many, how many
        200, and when (after t0) the first one that was not began."""
        polls = [(b, s) for b, e, s in self.polls if e <= until]
        first_bad = next((b - t0 for b, s in polls if s != 200), None)
        return {"polls": len(polls), "ok": sum(1 for _, s in polls if s == 200),
                "first_bad_s": first_bad, "span_s": until - t0}


class KubeletProbe(threading.Thread):
    """A liveness probe as a kubelet runs an httpGet one: GET /health every period (a ticker: the
    next probe is due a period after the previous one was due), `timeout` per probe, success on
    200-399, `failureThreshold` failures in a row → the container would be restarted (recorded
    here; the count starts again, as it does after a restart)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.probes: list[tuple[float, float, int | None]] = []
        self.fired: list[float] = []  # end of the failure that reached the threshold
        self.halt = threading.Event()

    def run(self) -> None:
        due, failures = time.time(), 0
        while not self.halt.is_set():
            began = time.time()
            status = http_status(self.port, timeout_s=K8S_TIMEOUT_S)
            ended = time.time()
            self.probes.append((began, ended, status))
            failures = 0 if status is not None and 200 <= status < 400 else failures + 1
            if failures >= K8S_FAILURES:
                self.fired.append(ended)
                failures = 0
            due += K8S_PERIOD_S
            self.halt.wait(max(0.0, due - time.time()))

    def stop(self) -> None:
        self.halt.set()
        self.join(K8S_TIMEOUT_S + 2)

    def fired_after(self, t0: float) -> float | None:
        return next((t - t0 for t in self.fired if t >= t0), None)

    def between(self, t0: float, t1: float) -> tuple[int, int]:
        """(probes that began in [t0, t1], of which answered 2xx/3xx)."""
        inside = [s for b, _, s in self.probes if t0 <= b <= t1]
        return len(inside), sum(1 for s in inside if s is not None and 200 <= s < 400)


class BareFreezes(threading.Thread):
    """A bare `vllm serve` (no supervisor) under a k8s-style liveness probe, frozen twice: its
    EngineCore SIGSTOPped with a streamed completion in flight, for `window_s`; then its API
    server SIGSTOPped too (the whole server frozen) until the probe fires, at most
    `api_bound_s`. Left frozen: the caller stops it (SIGCONT, SIGTERM) once the daemon's runs
    are done, so nothing of it runs beside them."""

    def __init__(self, serve: VllmServe, core: psutil.Process, window_s: float,
                 api_bound_s: float) -> None:
        super().__init__(daemon=True)
        self.serve, self.core, self.window_s, self.api_bound_s = serve, core, window_s, api_bound_s
        self.result: dict[str, Any] | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            self.result = self._run()
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            self.error = f"{type(exc).__name__}: {exc}"

    def _run(self) -> dict[str, Any]:
        serve, prober = self.serve, KubeletProbe(self.serve.port)
        prober.start()  # a kubelet has probed since the container started
        try:
            wait_until(lambda: prober.probes, 5, "the k8s-style probe's first probe", 0.05)
            body = {"model": str(serve.model), "prompt": PROMPTS[0],
                    "max_tokens": FREEZE_MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            stream = stream_in_flight(serve.port, body, "the bare server's completion")
            health = HealthWatch(serve.port)
            t_core = time.time()
            self.core.send_signal(signal.SIGSTOP)
            health.start()
            time.sleep(self.window_s)
            t_end = time.time()
            health.stop()
            core = {"health": health.summary(t_core, t_end),
                    "probes": prober.between(t_core, t_end),
                    "fired_s": prober.fired_after(t_core), "window_s": t_end - t_core,
                    "tokens": stream.tokens_after(t_core + 0.2)}
            # the whole-server stop at a random point of the probe's period, as it would fall
            time.sleep(random.uniform(0.0, K8S_PERIOD_S))
            health = HealthWatch(serve.port)
            t_api = time.time()
            os.kill(serve.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
            health.start()
            deadline = t_api + self.api_bound_s
            while prober.fired_after(t_api) is None and time.time() < deadline:
                time.sleep(0.05)
            t_end = time.time()
            health.stop()
            api = {"health": health.summary(t_api, t_end),
                   "phase_s": t_api - max(b for b, _, _ in prober.probes if b <= t_api),
                   "probes": prober.between(t_api, t_end), "fired_s": prober.fired_after(t_api),
                   "window_s": t_end - t_api}
        finally:
            prober.stop()
        return {"core": core, "api": api}


def served_freeze(daemon: ServeDaemon, target: str, in_flight: bool) -> dict[str, Any]:
    """SIGSTOP of the server's EngineCore (`core`) or of the API server (`api`), with a streamed
    gateway completion in flight or idle; the server's own /health polled until engined kills
    it; then READY again, and the request's end."""
    e = daemon.wait_ready(1)
    wait_until(lambda: daemon.engine()["heartbeat_age_s"] is not None, 30, "a first probe", 0.05)
    time.sleep(0.5)
    old_inc = e["incarnation"]
    tree = daemon.tree(e["pid"])
    victim = core_in(tree) if target == "core" else tree[0]
    stream = None
    if in_flight:
        stream = stream_in_flight(daemon.gateway_port, {"model": SERVED, "prompt": PROMPTS[0],
                                                        "max_tokens": FREEZE_MAX_TOKENS,
                                                        "temperature": 0},
                                  "the gateway's completion")
    health = HealthWatch(e["port"])
    t_stop = time.time()
    victim.send_signal(signal.SIGSTOP)
    health.start()
    try:
        def replaced() -> dict[str, Any] | None:
            daemon.check_alive()
            if not health.halt.is_set() and gone(tree[0]):
                health.halt.set()  # the old server is gone: its port is no longer its
            now = daemon.engine()
            return now if now["state"] == "READY" and now["incarnation"] > old_inc else None
        new = wait_until(replaced, START_TIMEOUT_S, f"{SERVED_ENGINE} READY after SIGSTOP", 0.05)
    finally:
        health.stop()
        left = [p.pid for p in tree if not gone(p)]
        for p in tree:  # the daemon kills them; never leave a stopped process
            if not gone(p):
                try:
                    p.kill()
                except psutil.Error:
                    pass
    assert new is not None
    daemon.tree(new["pid"])
    last = new["last_exit"]
    out: dict[str, Any] = {
        "target": target, "in_flight": in_flight, "detect_s": last["at"] - t_stop,
        "reason": last["reason"], "exit": exit_text(last), "ready_s": new["since"] - t_stop,
        "restart_s": new["since"] - last["at"], "health": health.summary(t_stop, last["at"]),
        "left": left}
    if stream is not None:
        stream.join(START_TIMEOUT_S)
        usage = stream.usage or {}
        out.update({
            "request": ("finished" if stream.ended_at and not stream.error else
                        f"error: {stream.error}" if stream.ended_at else "still open"),
            "request_finish": stream.finish, "request_tokens": usage.get("completion_tokens"),
            "request_done_s": (stream.ended_at - t_stop) if stream.ended_at else None,
            "tokens_before_stop": sum(1 for t in stream.token_times if t <= t_stop),
            "tokens_streamed": len(stream.token_times)})
    return out


def serve_section(python: str, model: Path, scratch: Path, cleanup: Cleanup, kills: int,
                  freezes: int, window_s: float) -> dict[str, Any]:
    """Section 4: a bare `vllm serve` cold start (timed alone), its freezes under a k8s-style
    probe (on a thread, frozen: it uses no CPU beside the daemon's runs), then engined with
    `vllm serve` as a command engine: kills, then freezes, each kind in turn."""
    tracker = cleanup.tracker
    bare = VllmServe(python, model, scratch, tracker, 99, SERVED_ARGS)
    cleanup.started.append(bare)  # stopped (SIGCONT first) by close() if anything fails
    t0 = bare.start()
    out: dict[str, Any] = {"bare_health_s": bare.wait_health() - t0}
    code, body = post_json(bare.port, "/v1/completions",
                           {"model": str(model), "prompt": PROMPTS[0],
                            "max_tokens": MAX_TOKENS[0], "temperature": 0})
    if code != 200:
        raise BenchError(f"bare vllm serve completion: HTTP {code}: {body}")
    out["bare_completion_s"] = time.time() - t0
    bare.track()
    core = engine_core_of(bare.proc.pid)  # type: ignore[union-attr]
    if core is None:
        raise BenchError(f"no EngineCore under the bare vllm serve: {bare.log_tail()}")
    api_bound = max(window_s, K8S_FIRES_WITHIN[1] + 5)
    frozen = BareFreezes(bare, core, window_s, api_bound)
    frozen.start()

    daemon = ServeDaemon(served_spec(python, model, scratch), tracker)
    cleanup.start(daemon)
    first = daemon.wait_ready(1)
    out["first_startup_s"] = first["startup_s"]
    daemon.tree(first["pid"])
    out["kills"] = [served_kill(daemon, target)
                    for _ in range(kills) for target in ("core", "api")]
    out["freezes"] = [served_freeze(daemon, target, in_flight)
                      for _ in range(freezes) for target, in_flight in FREEZES]
    daemon.tree(daemon.wait_ready(1)["pid"])
    cleanup.stop(daemon)
    daemon.remove_dir()
    frozen.join(api_bound + window_s + 30)
    if frozen.error or frozen.result is None:
        raise BenchError(f"the bare server's freezes: {frozen.error or 'did not end'}")
    out["bare"] = frozen.result
    out["tree"] = sorted({p.name() for p in descendants(bare.proc.pid)})  # type: ignore[union-attr]
    cleanup.stop(bare)
    out["window_s"], out["api_bound_s"] = window_s, api_bound
    return out


# --- report helpers -------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    """The q-quantile, linearly interpolated between order statistics."""
    vals = sorted(values)
    pos = (len(vals) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def ms(seconds: float | None, digits: int = 1) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.{digits}f} ms"


def sec(seconds: float | None, digits: int = 2) -> str:
    return "–" if seconds is None else f"{seconds:.{digits}f} s"


def signed_pct(value: float) -> str:
    return f"{value:+.1f} %"


def round_med(rounds: list[Round]) -> float:
    return statistics.median(r.elapsed_s for r in rounds)


def round_min(rounds: list[Round]) -> float:
    return min(r.elapsed_s for r in rounds)


def paired_pct(res: Results, path: str, c: int, m: int,
               value: Callable[[Round], float] = lambda x: x.elapsed_s,
               base: str = "direct") -> float:
    """The median over rounds (or trials) of `path`'s value over `base`'s in the same round,
    in %: the paths of a round run back to back, so a slower box for a minute (this VM's speed
    drifts by tens of percent) cancels out, which medians taken apart do not."""
    pairs = zip(res[(path, c, m)], res[(base, c, m)], strict=True)
    return 100 * (statistics.median(value(mine) / value(other) for mine, other in pairs) - 1)


def tokens_per_s(x: Round) -> float:
    return sum(x.tokens) / x.elapsed_s


def overhead_pct(res: Results, path: str, c: int, m: int, fastest: bool = False) -> float:
    pick = min if fastest else statistics.median
    mine = pick(r.elapsed_s for r in res[(path, c, m)])
    direct = pick(r.elapsed_s for r in res[("direct", c, m)])
    return 100 * (mine / direct - 1)


def fit(res: Results, path: str, c: int, fastest: bool = False
        ) -> tuple[float, float, float, float]:
    """Δ(m) = engined − direct round time (medians, or the fastest rounds) at the two
    max_tokens; a line through them: (Δ(m1), Δ(m2), intercept per round, slope per token
    position)."""
    (m1, m2) = MAX_TOKENS
    pick = round_min if fastest else round_med
    d1 = pick(res[(path, c, m1)]) - pick(res[("direct", c, m1)])
    d2 = pick(res[(path, c, m2)]) - pick(res[("direct", c, m2)])
    slope = (d2 - d1) / (m2 - m1)
    return d1, d2, d1 - slope * m1, slope


# --- 1c. the same at a heavier step -------------------------------------------------------------
@dataclass
class Heavy:
    bursts: Results
    sustained: Results
    dtypes: dict[str, str]
    name: str


def heavy_overhead(python: str, cache: Path, scratch: Path, pythonpath: str, cleanup: Cleanup,
                   rounds: int, trials: int, sizes: dict[int, int]) -> Heavy:
    """Sections 1 and 1b again with HEAVY_DIMS: a direct worker, `vllm serve` and a daemon of
    their own, started once nothing else runs and stopped after."""
    tracker = cleanup.tracker
    model = build_checkpoint(cache, HEAVY_NAME, HEAVY_DIMS)  # untimed; once per cache
    spec = {**engine_spec(python, cache), "model": {"path": str(model)}}
    worker = DirectWorker(python, spec, pythonpath, scratch / "direct-heavy.log", tracker)
    cleanup.started.append(worker)
    peer = VllmServe(python, model, scratch, tracker, "peer-heavy")
    peer.start()
    cleanup.started.append(peer)
    daemon = cleanup.start(Daemon(spec, tracker))
    dtypes = {"direct": worker.wait_ready()["dtype"], "engined": daemon.engine()["dtype"]}
    peer.wait_health()
    bursts, sustained = asyncio.run(overhead(daemon, worker, peer, rounds, trials, sizes))
    for started in (worker, peer, daemon):
        cleanup.stop(started)
    daemon.remove_dir()
    return Heavy(bursts, sustained, dtypes, model.name)


def direct_step_ms(res: Results, c: int) -> float:
    """The direct path's time per token position at `c` concurrent, longest max_tokens."""
    m = MAX_TOKENS[-1]
    return 1000 * round_med(res[("direct", c, m)]) / m


def report_heavy(r: Report, heavy: Heavy, rounds: int, trials: int, sizes: dict[int, int],
                 tiny_step_ms: float) -> dict:
    res = heavy.bursts
    dims = ", ".join(f"{k.removeprefix('num_').replace('_', ' ')} {v}"
                     for k, v in HEAVY_DIMS.items())
    out = report_overhead(
        r, res, rounds, heavy.dtypes,
        heading="## 1c. The same bursts at a realistic step time (a heavier random model)",
        preface=(f"tiny-llama's recipe (its tokenizer, random weights) at {dims} ({heavy.name}), "
                 f"everything else as in sections 1 and 1b. The direct step is "
                 f"{direct_step_ms(res, 1):.1f} ms at 1 concurrent and "
                 f"{direct_step_ms(res, 8):.1f} ms at 8 (tiny-llama: {tiny_step_ms:.1f} ms), "
                 f"the order of a 7-13B model's decode step on one data-center GPU (memory-bound: "
                 f"its weights' bytes over the memory bandwidth): engined's cost per request is "
                 f"what it was in section 1, the step it is compared with is four times "
                 f"longer.", ""))
    out["step_ms"] = direct_step_ms(res, 8)
    out["sustained"] = report_sustained(
        r, heavy.sustained, trials, sizes,
        heading="## 1d. Sustained load on the heavier model (as section 1b)")
    return out


# --- report ---------------------------------------------------------------------------------------
def report_overhead(r: Report, res: Results, rounds: int, dtypes: dict[str, str],
                    heading: str = "## 1. Serving overhead: engined vs the same `LLMEngine` "
                                   "driven directly (one replica, CPU, 1 thread, greedy)",
                    preface: tuple[str, ...] = ()) -> dict:
    r(heading, "", *preface,
      *table("concurrency", "max_tokens", "path", "requests/s", "tokens/s", "round time median",
             "latency p50", "latency p95", "tokens/request", "n rounds"))
    counts_exact = True
    for c in CONCURRENCY:
        for m in MAX_TOKENS:
            for path in PATHS:
                rs = res[(path, c, m)]
                lats = [x for s in rs for x in s.latencies_s]
                toks = [t for s in rs for t in s.tokens]
                counts_exact &= all(t == m for t in toks)
                rm = round_med(rs)
                r(f"| {c} | {m} | {PATH_LABELS[path]} | {c / rm:.1f} | "
                  f"{statistics.median(tokens_per_s(s) for s in rs):.0f} | "
                  f"{ms(rm)} | {ms(pct(lats, 0.5))} | {ms(pct(lats, 0.95))} | "
                  f"{statistics.mean(toks):.1f} | {len(rs)} |")
    finishes = sorted({f for rs in res.values() for s in rs for f in s.finish})
    r("", f"Every request generated exactly max_tokens: {'yes' if counts_exact else 'NO'} "
      f"(finish reasons seen: {', '.join(finishes)}). Our protocol has no `ignore_eos`; "
      f"tiny-llama's recipe gives the eos token a zero output row, so greedy decoding never "
      f"picks it. dtype: engined's engine {dtypes.get('engined')}, direct "
      f"{dtypes.get('direct')}.", "")

    r(*table("concurrency", "max_tokens", "path",
             "overhead: round time vs direct's in the same round (median of the rounds)",
             "same, medians taken apart", "same, fastest rounds (min vs min)",
             "latency p50 vs direct",
             "outside the engine child (round − slowest request's life in the child)",
             "engined's own cost: round time vs the floor's in the same round",
             f"target at 8 (< {OVERHEAD_TARGET_PCT:g} %, paired)"))
    verdicts, over_floor = {}, {}
    for c in CONCURRENCY:
        for m in MAX_TOKENS:
            direct_p50 = pct([x for s in res[("direct", c, m)] for x in s.latencies_s], 0.5)
            for path in PATHS[1:]:
                rs = res[(path, c, m)]
                over = paired_pct(res, path, c, m)
                p50 = pct([x for s in rs for x in s.latencies_s], 0.5)
                outside = (ms(statistics.median(s.elapsed_s - s.engine_s for s in rs))
                           if path == "control" else "–")
                target = vs_floor = "–"
                if path in ENGINED_PATHS:
                    own = paired_pct(res, path, c, m, base="floor")
                    vs_floor = signed_pct(own)
                    if c == 8:
                        verdicts[(path, m)], over_floor[(path, m)] = over, own
                        target = "PASS" if over < OVERHEAD_TARGET_PCT else "MISS"
                r(f"| {c} | {m} | {PATH_LABELS[path].removeprefix('engined: ')} | "
                  f"{signed_pct(over)} | {signed_pct(overhead_pct(res, path, c, m))} | "
                  f"{signed_pct(overhead_pct(res, path, c, m, True))} | "
                  f"{signed_pct(100 * (p50 / direct_p50 - 1))} | {outside} | {vs_floor} | "
                  f"{target} |")

    r("", *table("path", "concurrency", f"Δ round time at {MAX_TOKENS[0]} tokens (medians)",
                 f"Δ at {MAX_TOKENS[1]} tokens", "fixed cost per request", "cost per token",
                 "same from the fastest rounds: per request", "per token"))
    fits = {}
    for path in PATHS[1:]:
        for c in CONCURRENCY:
            d1, d2, intercept, slope = fit(res, path, c)
            _, _, fast_intercept, fast_slope = fit(res, path, c, fastest=True)
            fits[(path, c)] = (intercept / c, slope / c)
            r(f"| {PATH_LABELS[path].removeprefix('engined: ')} | {c} | {ms(d1, 2)} | "
              f"{ms(d2, 2)} | {ms(intercept / c, 2)} | {ms(slope / c, 3)} | "
              f"{ms(fast_intercept / c, 2)} | {ms(fast_slope / c, 3)} |")
    if preface:  # section 1c: section 1's method
        r("", f"Rounds as in section 1: {WARMUP_ROUNDS} warm-up rounds dropped, {rounds} "
          f"measured.", "")
        return {"verdicts": verdicts, "fits": fits, "floor": over_floor}
    r("", f"Rounds: every (max_tokens, concurrency) in turn, its five paths in a rotating order; "
      f"{WARMUP_ROUNDS} warm-up rounds dropped, {rounds} measured; each timed burst of a path "
      f"right after {PRIMING} untimed one(s) of its own, so no path is timed on the first "
      f"burst after other processes ran (that one took 4-5 ms longer, direct and engined alike, "
      f"and the rotation gave each path the same neighbour every round). A round is `concurrency` "
      f"requests sent at once (bench/common.py's LeanHTTP, a lean HTTP/1.1 client: one "
      f"keep-alive connection per request in flight, on the control socket, the gateway's TCP "
      f"port, the floor's, `vllm serve`'s; it shares the 2 cores with what it measures, and "
      f"aiohttp's client cost twice its CPU), timed from the "
      f"first send to the last answer; latency is each "
      f"request's send → answer. The direct round is the same prompts tokenized and added to "
      f"the worker's LLMEngine at once, then `step()` until none is unfinished (latency: until "
      f"the step that finished it). The floor is the same LLMEngine, in the same worker process, "
      f"behind the least an HTTP server can be (bench/vllm_direct.py: aiohttp, the engine "
      f"stepped by a task of the same event loop, a future per request; no supervisor, no "
      f"second process, no ZeroMQ, no streaming or bookkeeping): floor vs direct is what HTTP "
      f"and the client cost any server, engined vs floor is what engined adds to that. The "
      f"overhead (and the verdict) is the median over rounds of "
      f"a path's round time over direct's in the same round: the five paths of a round run "
      f"back to back, so a drift of the box's speed (tens of percent over minutes on this VM) "
      f"cancels out; the medians taken apart are shown beside it. Δ is engined's median round "
      f"time minus direct's; the line "
      f"through Δ at the two max_tokens gives the fixed cost (intercept) and the cost per "
      f"token position (slope); at 8 concurrent both are divided by 8 (per request, per "
      f"generated token), so they are amortised over a batch. On a shared box load from other "
      f"processes only adds time, so the fastest rounds (min vs min) are the less noisy "
      f"comparison; a slope this small is within the noise of the medians, and may come out "
      f"negative.", "")
    return {"verdicts": verdicts, "fits": fits, "floor": over_floor}


def report_sustained(r: Report, res: Results, trials: int, sizes: dict[int, int],
                     heading: str = "") -> dict[str, dict[tuple[str, int], float]]:
    """Sustained load: throughput (tokens/s, median of the trials) and latency per path; the
    paired throughput at 8 concurrent against direct ("verdicts") and the floor ("floor")."""
    r(heading or f"## 1b. Sustained load: {' and '.join(map(str, CONCURRENCY))} requests always "
      f"in flight (engined vs the same `LLMEngine` driven directly, `vllm serve` as the peer)", "",
      *table("concurrency", "max_tokens", "path", "tokens/s (median of trials)",
             "throughput vs direct's in the same trial (median of the trials)",
             "same, medians taken apart", "latency p50", "latency p50 vs direct", "latency p95",
             "requests", "engined's own cost: throughput vs the floor's in the same trial",
             f"target at 8 (throughput within {OVERHEAD_TARGET_PCT:g} %, paired)"))
    verdicts: dict[tuple[str, int], float] = {}
    over_floor: dict[tuple[str, int], float] = {}
    exact = True
    for c in CONCURRENCY:
        for m in MAX_TOKENS:
            def rate(path: str, c: int = c, m: int = m) -> float:
                return statistics.median(tokens_per_s(t) for t in res[(path, c, m)])

            def p50(path: str, c: int = c, m: int = m) -> float:
                return pct([x for t in res[(path, c, m)] for x in t.latencies_s], 0.5)

            for path in PATHS:
                ts = res[(path, c, m)]
                lats = [x for t in ts for x in t.latencies_s]
                exact &= all(n == m for t in ts for n in t.tokens)
                loss = paired_pct(res, path, c, m, tokens_per_s)
                apart = 100 * (rate(path) / rate("direct") - 1)
                target = vs_floor = "–"
                if path in ENGINED_PATHS:
                    own = paired_pct(res, path, c, m, tokens_per_s, "floor")
                    vs_floor = signed_pct(own)
                    if c == 8:
                        verdicts[(path, m)], over_floor[(path, m)] = loss, own
                        target = "PASS" if loss > -OVERHEAD_TARGET_PCT else "MISS"
                vs_p50 = signed_pct(100 * (p50(path) / p50("direct") - 1))
                r(f"| {c} | {m} | {PATH_LABELS[path]} | {rate(path):.0f} | "
                  f"{'–' if path == 'direct' else signed_pct(loss)} | "
                  f"{'–' if path == 'direct' else signed_pct(apart)} | {ms(pct(lats, 0.5))} | "
                  f"{'–' if path == 'direct' else vs_p50} | {ms(pct(lats, 0.95))} | "
                  f"{sum(len(t.tokens) for t in ts)} | {vs_floor} | {target} |")
    trial = ', '.join(f'{n} requests at {c} in flight' for c, n in sizes.items())
    if heading:  # section 1d: section 1b's method
        r("", f"Every request generated exactly max_tokens: {'yes' if exact else 'NO'}. As in "
          f"section 1b; a trial is {trial}, {trials} trial(s) per path.", "")
        return {"verdicts": verdicts, "floor": over_floor}
    r("", f"Every request generated exactly max_tokens: {'yes' if exact else 'NO'}. A trial is "
      f"{trial}: "
      f"as many clients, each sending its next request the moment its last one is answered "
      f"(LeanHTTP, one connection per client), the way a serving benchmark at a fixed "
      f"concurrency drives a server; tokens/s is the trial's generated tokens over its time, "
      f"the median of {trials} trials per path, the paths of each trial in a rotating order; "
      f"against direct, the median over trials of a path's tokens/s over direct's in the same "
      f"trial (the verdict), and the medians taken apart. "
      f"The direct path keeps the same number in flight inside the worker: a finished request is "
      f"replaced before the next `step()`, which no server can match (a replacement through "
      f"HTTP arrives while the next step runs, and joins the one after it: the floor's too). "
      f"Latency is each request's send → answer.", "")
    return {"verdicts": verdicts, "floor": over_floor}


def dist_row(label: str, values: list[float]) -> str:
    vals = [v for v in values if v is not None and v == v]
    if not vals:
        return f"| {label} | – | – | 0 |"
    return (f"| {label} | {statistics.median(vals):.2f} s | {min(vals):.2f}–{max(vals):.2f} s | "
            f"{len(vals)} |")


def report_crash(r: Report, crashes: list[dict], serves: list[dict]) -> dict[str, float]:
    tree = ", ".join(serves[0]["tree"]) if serves else "?"
    r("## 2. Crash → READY: engined's restart vs a cold start of `vllm serve`", "",
      *table("measure", "median", "min–max", "n"),
      dist_row("engined: SIGKILL → READY (daemon's `since`)", [c["ready_s"] for c in crashes]),
      dist_row("engined: SIGKILL → READY seen by a 20 ms status poll",
               [c["seen_s"] for c in crashes]),
      dist_row("… of which SIGKILL → exit recorded (`last_exit.at`)",
               [c["detect_s"] for c in crashes]),
      dist_row("… of which spawn → READY (`startup_s`)", [c["startup_s"] for c in crashes]),
      dist_row("… of which the child's import → warm-up (its `[ready]` line)",
               [c["load_s"] for c in crashes]),
      dist_row("`vllm serve` cold start: spawn → `/health` 200",
               [s["health_s"] for s in serves]),
      dist_row(f"`vllm serve` cold start: spawn → first completion ({MAX_TOKENS[0]} tokens) "
               f"answered", [s["first_completion_s"] for s in serves]),
      dist_row("`vllm serve`: SIGKILL of its EngineCore → `/health` stops answering 200",
               [s["health_down_s"] for s in serves]),
      dist_row("`vllm serve`: SIGKILL of its EngineCore → the API server has exited",
               [s["exit_s"] for s in serves]), "")
    crash = statistics.median(c["ready_s"] for c in crashes)
    cold = statistics.median(s["health_s"] for s in serves)
    exits = [s["exit_s"] for s in serves if s["exit_s"] is not None]
    outer = cold + statistics.median(exits) if exits else None
    r(f"Crash → READY under engined: median {crash:.2f} s; a cold `vllm serve` to `/health` 200: "
      f"{cold:.2f} s, {cold / crash:.2f}× engined's restart. vLLM is fail-stop: after its "
      f"EngineCore is SIGKILLed the API server exits (codes: "
      f"{', '.join(str(s['exit_code']) for s in serves)}), and only then can an outer "
      f"supervisor start a new one: "
      + (f"exit + cold start = {outer:.2f} s, {outer / crash:.2f}× engined's SIGKILL → READY."
         if outer is not None else "it did not exit within 60 s.")
      + f" `vllm serve` is an API server process plus its children ({tree}), and the API "
      f"server, the EngineCore and the worker each import vLLM in turn; engined's restart is "
      f"one fresh interpreter (`launcher: exec`, pinned in this benchmark) that imports vLLM "
      f"and builds LLMEngine in-process. engined's default launcher, the fork server, skips "
      f"those imports (`python -m bench.recovery` measures it against exec). Scenario 2 kills "
      f"the engine idle; the cold starts and the kills alternate.",
      "")
    return {"crash": crash, "cold": cold, "outer": outer if outer is not None else float("nan")}


def report_freeze(r: Report, freezes: list[dict], serve_freeze_: dict | None,
                  heartbeat_timeout: str) -> None:
    r("## 3. A frozen engine core (SIGSTOP, a streamed request in flight)", "",
      *table("measure", "median", "min–max", "n"),
      dist_row("engined: SIGSTOP → its `/health` stops answering 200 (hang declared)",
               [f["health_bad_s"] for f in freezes]),
      dist_row("engined: SIGSTOP → killed as hung, exit recorded (`last_exit.at`)",
               [f["detect_s"] for f in freezes]),
      dist_row("engined: SIGSTOP → READY again (`since`)", [f["ready_s"] for f in freezes]),
      dist_row("engined: SIGSTOP → the in-flight gateway request finished",
               [f["request_done_s"] for f in freezes]), "")
    reasons = ", ".join(sorted({f"{f['reason']}/{f['signal']}" for f in freezes}))
    outcomes = "; ".join(f"{f['request']} ({f['request_finish']}, {f['request_tokens']} of "
                         f"{FREEZE_MAX_TOKENS} tokens, {f['tokens_before_stop']} before the "
                         f"stop)" for f in freezes)
    r(f"engined: `last_exit` reason/signal: {reasons}; the in-flight request (streamed "
      f"`/v1/completions` through the gateway, max_tokens {FREEZE_MAX_TOKENS}): {outcomes}.", "")
    r(*table("`vllm serve`, EngineCore SIGSTOPped", "result"))
    if serve_freeze_ is None:
        r("| (not run) | – |", "")
        return
    f = serve_freeze_
    window = f"{f['window_s']:g} s"
    r("| `/health` stops answering 200 | "
      + (f"after {f['first_bad_s']:.2f} s" if f["first_bad_s"] is not None
         else f"never within {window}") + " |",
      f"| `/health` polls answered 200 (every 0.25 s) | {f['ok_polls']} of {f['polls']} |",
      f"| tokens of the in-flight completion received in the window (after the first 0.2 s) | "
      f"{f['tokens_in_window']} of {FREEZE_MAX_TOKENS}"
      + (" (the request ended)" if f["ended_in_window"] else ", the request hangs") + " |",
      f"| after SIGCONT | {f['after_cont']} |", "")
    r(f"engined detects the frozen core by its missing heartbeats (heartbeat_timeout "
      f"{heartbeat_timeout}, counted from the last heartbeat, which came up to one 1 s interval "
      f"before the stop: detection lands between the timeout minus one interval and the "
      f"timeout), kills its process group and restarts it (a full vLLM start, as in "
      f"scenario 2); the gateway moves the request to "
      f"the replacement, which resumes after the tokens already delivered. `vllm serve`'s "
      f"`/health` fails only once its EngineCore process has died (vLLM 0.32: a thread "
      f"watches the process's liveness and `check_health` reads the flag it sets): a stopped "
      f"core keeps `/health` at 200 while the request makes no progress, so an outer "
      f"supervisor's `/health` probe never restarts it.", "")


def span(values: list[float | None]) -> str:
    """median (min–max), or – when there is none."""
    vals = [v for v in values if v is not None and v == v]
    if not vals:
        return "–"
    if len(vals) == 1:
        return f"{vals[0]:.2f} s"
    return f"{statistics.median(vals):.2f} s ({min(vals):.2f}–{max(vals):.2f})"


def health_text(h: dict[str, Any]) -> str:
    if h["polls"] == 0:
        return f"no poll ended within {h['span_s']:.1f} s"
    if h["first_bad_s"] is None:
        return f"200 throughout ({h['ok']} of {h['polls']} polls, {h['span_s']:.1f} s)"
    return (f"not 200 from {h['first_bad_s']:.2f} s ({h['ok']} of {h['polls']} polls 200 in "
            f"{h['span_s']:.1f} s)")


def healths_text(hs: list[dict[str, Any]]) -> str:
    if all(h["polls"] and h["first_bad_s"] is None for h in hs):
        return (f"200 throughout ({sum(h['ok'] for h in hs)} of {sum(h['polls'] for h in hs)} "
                f"polls, {sum(h['span_s'] for h in hs):.1f} s in all, {len(hs)} runs)")
    return "; ".join(health_text(h) for h in hs)


def request_text(fs: list[dict[str, Any]]) -> str:
    if not fs or "request" not in fs[0]:
        return "– (none in flight)"
    return "; ".join(f"{f['request']} ({f['request_finish']}, {f['request_tokens']} of "
                     f"{FREEZE_MAX_TOKENS} tokens, {f['tokens_before_stop']} before the stop, "
                     f"{f['tokens_streamed']} streamed)" for f in fs)


def k8s_text(w: dict[str, Any]) -> str:
    n, ok = w["probes"]
    if w["fired_s"] is None:
        return f"never within {w['window_s']:.0f} s ({ok} of {n} probes passed)"
    phase = (f", the stop {w['phase_s']:.1f} s after a probe began" if "phase_s" in w else "")
    return (f"fired after {w['fired_s']:.2f} s ({ok} of {n} probes passed{phase}; expected "
            f"{K8S_FIRES_WITHIN[0]:g}–{K8S_FIRES_WITHIN[1]:g} s)")


def report_serve(r: Report, s: dict[str, Any], section2: list[dict] | None) -> dict[str, Any]:
    kills = {t: [k for k in s["kills"] if k["target"] == t] for t in ("core", "api")}
    freezes = {key: [f for f in s["freezes"] if (f["target"], f["in_flight"]) == key]
               for key in FREEZES}
    cold = s["bare_health_s"]
    r("## 4. `vllm serve` under engined: a command engine (crash → READY, hang detection)", "",
      f"One replica: `command: [VLLM_PYTHON, -m, {SERVE_MODULE}, --model, DIR, --host, "
      f"127.0.0.1, --port, \"{{port}}\", {', '.join(SERVED_ARGS)}]`, `port: auto`, "
      f"`progress: vllm`, `probe: {{path: /health, interval: 1s, timeout: 2s, failures: 3}}`, "
      f"`stall_timeout: {SERVED_STALL_TIMEOUT}`, restarts immediate (backoff 0), the gateway on "
      f"a loopback port; the bare `vllm serve` baseline runs the same argv with a fixed port. "
      f"The server's tree: {', '.join(s['tree'])}.", "",
      *table("measure", "median", "min–max", "n"))
    for target, label in (("core", "EngineCore (`VLLM::EngineCore`, a grandchild) SIGKILL"),
                          ("api", "API server SIGKILL")):
        ks = kills[target]
        r(dist_row(f"engined: {label} → READY again (daemon's `since`)",
                   [k["ready_s"] for k in ks]),
          dist_row("… of which SIGKILL → exit recorded (`last_exit.at`)",
                   [k["detect_s"] for k in ks]),
          dist_row("… of which exit recorded → respawn", [k["respawn_s"] for k in ks]),
          dist_row("… of which respawn → READY (`startup_s`: to the first passing probe)",
                   [k["startup_s"] for k in ks]))
    r(dist_row("engined: first start, spawn → READY (`startup_s`, incarnation 1)",
               [s["first_startup_s"]]),
      dist_row("bare `vllm serve` cold start (same argv): spawn → `/health` 200 (50 ms poll)",
               [cold]),
      dist_row("bare `vllm serve` cold start: spawn → first completion answered",
               [s["bare_completion_s"]]))
    if section2:
        r(dist_row("section 2's bare `vllm serve` cold starts (`--disable-log-stats`): spawn → "
                   "`/health` 200", [x["health_s"] for x in section2]))
    core_ready = statistics.median(k["ready_s"] for k in kills["core"])
    api_ready = statistics.median(k["ready_s"] for k in kills["api"])
    exits = {t: ", ".join(k["exit"] for k in kills[t]) for t in kills}
    left = [p for k in s["kills"] for p in k["left"]]
    r("", f"engined's restart of `vllm serve` is a cold start of `vllm serve`: EngineCore "
      f"SIGKILL → READY {core_ready:.2f} s = {core_ready / cold:.2f}× the bare cold start "
      f"({cold:.2f} s); API server SIGKILL → READY {api_ready:.2f} s = {api_ready / cold:.2f}×. "
      f"What engined adds is detection (an API server SIGKILL: at once, it is engined's child; "
      f"an EngineCore SIGKILL: vLLM's API server exits on its own a few seconds later, unless "
      f"three failed probes come first: vLLM's `/health` answers 500 once the core is dead) "
      f"and READY at the first passing probe (1 s apart, so up to 1 s after `/health` would "
      f"first have answered). Exits recorded: EngineCore kills {exits['core']}; API server "
      f"kills {exits['api']}. The old server's tree (API server, EngineCore, worker) was gone "
      f"by the next READY: {'yes, every time' if not left else f'NO, left: {left}'}. Killed "
      f"idle; kills alternate EngineCore / API server.", "")

    r(*table("measure", *(FREEZE_LABELS[key] for key in FREEZES)))

    def row(label: str, cell) -> None:
        r(f"| {label} | " + " | ".join(cell(freezes[key]) for key in FREEZES) + " |")
    row("engined: SIGSTOP → killed (`last_exit.at`)", lambda fs: span([f["detect_s"] for f in fs]))
    row("engined: verdict (`last_exit.reason`)",
        lambda fs: ", ".join(sorted({f["exit"] for f in fs})) or "–")
    row("engined: killed → READY again (`since` − `last_exit.at`)",
        lambda fs: span([f["restart_s"] for f in fs]))
    row("engined: SIGSTOP → READY again (`since`)", lambda fs: span([f["ready_s"] for f in fs]))
    row("vLLM's own `/health` until engined killed it (0.25 s polls, 2 s timeout)",
        lambda fs: healths_text([f["health"] for f in fs]))
    row("the in-flight gateway request", request_text)
    row("SIGSTOP → the in-flight request finished",
        lambda fs: span([f.get("request_done_s") for f in fs]) if fs and fs[0]["in_flight"]
        else "–")
    row("n", lambda fs: str(len(fs)))
    left = [p for f in s["freezes"] for p in f["left"]]
    r("", f"engined's verdicts: a frozen EngineCore with a request in flight is a **stall** "
      f"(the gateway counts the request; vLLM's `vllm:generation_tokens_total` stops moving "
      f"for stall_timeout {SERVED_STALL_TIMEOUT}: 4-6 s after the stop, by where the last "
      f"progress read fell); a frozen API server fails its probes (3 × 2 s timeouts: a **hang** "
      f"6-7 s after the stop), unless a request in flight makes it a stall first (no progress "
      f"can be read either). A frozen core with nothing in flight is not detected by design "
      f"(nothing is waiting on it; the next request makes it a stall). The gateway moves a "
      f"request whose replica died to the replacement once it is READY, continuing after the "
      f"tokens already delivered. Stopped processes left after the verdict (SIGKILLed by pid "
      f"here): {left or 'none'}.", "")

    bare = s["bare"]
    r(*table("bare `vllm serve`, no supervisor",
             "EngineCore SIGSTOPped, request in flight",
             "then its API server SIGSTOPped too (whole server frozen)"),
      f"| vLLM's own `/health` (0.25 s polls, 2 s timeout) | {health_text(bare['core']['health'])} "
      f"| {health_text(bare['api']['health'])} |",
      f"| k8s-style liveness probe on `/health` (period {K8S_PERIOD_S:g} s, timeout "
      f"{K8S_TIMEOUT_S:g} s, failureThreshold {K8S_FAILURES}) | {k8s_text(bare['core'])} | "
      f"{k8s_text(bare['api'])} |",
      f"| tokens of the in-flight completion received in the window (after the first 0.2 s) | "
      f"{bare['core']['tokens']} of {FREEZE_MAX_TOKENS} | – |", "")

    def engined_cell(key: tuple[str, bool]) -> str:
        fs = freezes[key]
        return (f"{span([f['detect_s'] for f in fs])} "
                f"({', '.join(sorted({f['reason'] for f in fs}))})") if fs else "–"
    core_bare, api_bare = bare["core"], bare["api"]
    r(*table("a hung `vllm serve`: SIGSTOP → detected", "engined (probes + progress)",
             "vLLM's own `/health`", "k8s-style liveness probe (10 s / 1 s / 3)"),
      f"| EngineCore frozen, request in flight | {engined_cell(('core', True))} | "
      f"{'200 throughout' if core_bare['health']['first_bad_s'] is None else 'fails'} | "
      f"{k8s_text(core_bare)} |",
      f"| API server frozen, request in flight | {engined_cell(('api', True))} | "
      f"{health_text(api_bare['health']).split(' (')[0]} | {k8s_text(api_bare)} |",
      f"| API server frozen, idle | {engined_cell(('api', False))} | "
      f"{health_text(api_bare['health']).split(' (')[0]} | same as above (the probe does "
      f"not see requests) |", "")
    r(f"The k8s-style probe runs against a second, bare `vllm serve` (no supervisor) frozen the "
      f"same way, for {s['window_s']:g} s with its EngineCore stopped, then with its API server "
      f"stopped too until the probe fires (at most {s['api_bound_s']:g} s): under engined the "
      f"server is killed within seconds, so the frozen state would not last a probe period. "
      f"The probe has run since the server was healthy, on its own 10 s ticker, so where the "
      f"stop falls in its period is arbitrary: it fires {K8S_FIRES_WITHIN[0]:g}–"
      f"{K8S_FIRES_WITHIN[1]:g} s after a stop that fails every probe (the first failing probe "
      f"within a period, two more periods, the last one's timeout). The bare server is frozen "
      f"(no CPU) while engined's runs go on beside it, and stopped after them.", "")
    return {"core_ready": core_ready, "api_ready": api_ready, "cold": cold,
            "freezes": freezes, "bare": bare}


def report_serve_summary(r: Report, sv: dict[str, Any]) -> None:
    cold = sv["cold"]
    for name, label in (("core_ready", "EngineCore"), ("api_ready", "API server")):
        r(f"| `vllm serve` under engined: {label} SIGKILL → READY vs a bare cold start to "
          f"`/health` 200 | {sv[name]:.2f} s | {cold:.2f} s | report only: {sv[name] / cold:.2f}× "
          f"(the restart is a cold start) |")
    freezes, bare = sv["freezes"], sv["bare"]
    for key in FREEZES:
        fs = freezes[key]
        base = k8s_text(bare["core" if key[0] == "core" else "api"]).split(" (")[0]
        r(f"| `vllm serve` under engined: {FREEZE_LABELS[key]} → detected | "
          f"{span([f['detect_s'] for f in fs])} ({', '.join(sorted({f['reason'] for f in fs}))}) "
          f"| k8s-style liveness probe: {base} | report only |")


def report_summary(r: Report, over: dict | None, crash: dict[str, float] | None,
                   freezes: list[dict], serve_freeze_: dict | None,
                   served: dict[str, Any] | None = None) -> None:
    r("## Summary", "", *table("target / measure", "engined", "baseline", "result"))
    if over is not None and crash is not None:
        report_backend_summary(r, over, crash, freezes, serve_freeze_)
    if served is not None:
        report_serve_summary(r, served)
    r("")


def report_backend_summary(r: Report, over: dict, crash: dict[str, float], freezes: list[dict],
                           serve_freeze_: dict | None) -> None:
    models = [(over, "tiny-llama")]
    if (heavy := over.get("heavy")) is not None:
        models.append((heavy, f"heavier model ({heavy['step_ms']:.1f} ms steps)"))
    def by_tokens(d: dict[tuple[str, int], float]) -> list[tuple[tuple[str, int], float]]:
        return sorted(d.items(), key=lambda kv: (kv[0][1], kv[0][0]))

    for section, model in models:
        sustained = section["sustained"]
        for (path, m), loss in by_tokens(sustained["verdicts"]):
            verdict = ("PASS" if loss > -OVERHEAD_TARGET_PCT
                       else f"MISS by {-loss - OVERHEAD_TARGET_PCT:.1f} points")
            r(f"| throughput at 8 concurrent (sustained) within {OVERHEAD_TARGET_PCT:g} % of "
              f"direct, {model}, max_tokens {m}, {PATH_LABELS[path].removeprefix('engined: ')} "
              f"| {signed_pct(loss)} | direct LLMEngine | {verdict} |")
        for (path, m), own in by_tokens(sustained["floor"]):
            r(f"| engined's own cost: throughput at 8 concurrent (sustained) vs the floor's, "
              f"{model}, max_tokens {m}, {PATH_LABELS[path].removeprefix('engined: ')} "
              f"| {signed_pct(own)} | the floor (minimal HTTP server, same process as the "
              f"engine) | report only |")
    for section, model in models:
        for (path, m), value in by_tokens(section["verdicts"]):
            verdict = ("PASS" if value < OVERHEAD_TARGET_PCT
                       else f"MISS by {value - OVERHEAD_TARGET_PCT:.1f} points")
            r(f"| overhead at 8 concurrent < {OVERHEAD_TARGET_PCT:g} % (bursts: round time), "
              f"{model}, max_tokens {m}, {PATH_LABELS[path].removeprefix('engined: ')} | "
              f"{signed_pct(value)} | direct LLMEngine | {verdict} |")
        for (path, m), own in by_tokens(section["floor"]):
            r(f"| engined's own cost: bursts at 8 concurrent, round time vs the floor's, "
              f"{model}, max_tokens {m}, {PATH_LABELS[path].removeprefix('engined: ')} | "
              f"{signed_pct(own)} | the floor (minimal HTTP server, same process as the "
              f"engine) | report only |")
    r(f"| crash → READY vs `vllm serve` cold start to `/health` 200 | {crash['crash']:.2f} s | "
      f"{crash['cold']:.2f} s | report only: {crash['cold'] / crash['crash']:.2f}× |")
    if crash["outer"] == crash["outer"]:
        r(f"| … with `vllm serve`'s own exit after an EngineCore SIGKILL | {crash['crash']:.2f} s "
          f"| {crash['outer']:.2f} s | report only: {crash['outer'] / crash['crash']:.2f}× |")
    detect = med(f["detect_s"] for f in freezes)
    base = ("–" if serve_freeze_ is None else
            f"{serve_freeze_['first_bad_s']:.2f} s" if serve_freeze_["first_bad_s"] is not None
            else f"never within {serve_freeze_['window_s']:g} s")
    r(f"| frozen core (SIGSTOP) detected | {sec(detect)} | `/health`: {base} | report only |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="6 rounds, 2 kills, 1 cold start, 1 freeze, a 10 s window; "
                             "section 4: 1 kill and 1 freeze of each kind, a 30 s window")
    parser.add_argument("--only", choices=("all", "backend", "serve"), default="all",
                        help="all sections (default), sections 1-3 (`backend: vllm`), or "
                             "section 4 (`vllm serve` as a command engine)")
    parser.add_argument("--out", default=None, help="default bench/results/vllm.md "
                        "(--quick: bench/results/vllm-quick.md)")
    parser.add_argument("--rounds", type=int, default=None, help="overhead rounds (default 40)")
    parser.add_argument("--heavy-rounds", type=int, default=None,
                        help="section 1c rounds on the heavier model (default 12, --quick 2; "
                             "0 skips it)")
    parser.add_argument("--trials", type=int, default=None,
                        help="sustained-load trials per path (default 5, --quick 2)")
    parser.add_argument("-n", "--kills", type=int, default=None,
                        help="SIGKILLs of the engine (default 5)")
    parser.add_argument("--serves", type=int, default=None,
                        help="cold starts of vllm serve (default 3)")
    parser.add_argument("--freezes", type=int, default=None,
                        help="SIGSTOPs of the engine under engined (default 3)")
    parser.add_argument("--window", type=float, default=None,
                        help="seconds vllm serve's /health is polled with its EngineCore "
                             "stopped (default 30)")
    parser.add_argument("--serve-kills", type=int, default=None,
                        help="section 4: SIGKILLs of each kind, EngineCore and API server "
                             "(default 3, --quick 1)")
    parser.add_argument("--serve-freezes", type=int, default=None,
                        help="section 4: SIGSTOPs of each kind (default 3, --quick 1)")
    parser.add_argument("--k8s-window", type=float, default=None,
                        help="section 4: seconds the bare server's EngineCore stays stopped "
                             "under the k8s-style probe (default 60, --quick 30)")
    parser.add_argument("--vllm-python", default=None,
                        help=f"the vLLM venv's interpreter (default ${VLLM_PYTHON_ENV}, else "
                             f"<repo>/.venv-vllm/bin/python)")
    parser.add_argument("--cache-dir", default=None,
                        help="ENGINED_CACHE_DIR for the model (default: a fresh temporary one)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (6 if args.quick else 40)
    trials = args.trials or (2 if args.quick else 5)
    heavy_rounds = (args.heavy_rounds if args.heavy_rounds is not None
                    else 2 if args.quick else 12)
    heavy_trials = 1 if args.quick else 5
    heavy_sizes = HEAVY_SUSTAINED_REQUESTS_QUICK if args.quick else HEAVY_SUSTAINED_REQUESTS
    sizes = SUSTAINED_REQUESTS_QUICK if args.quick else SUSTAINED_REQUESTS
    kills = args.kills or (2 if args.quick else 5)
    n_serves = args.serves or (1 if args.quick else 3)
    n_freezes = args.freezes or (1 if args.quick else 3)
    window = args.window or (10.0 if args.quick else 30.0)
    serve_kills = args.serve_kills or (1 if args.quick else 3)
    serve_freezes = args.serve_freezes or (1 if args.quick else 3)
    k8s_window = args.k8s_window or (30.0 if args.quick else 60.0)
    backend, served = args.only in ("all", "backend"), args.only in ("all", "serve")
    python = args.vllm_python or default_vllm_python()
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise SystemExit(f"no vLLM interpreter at {python} (--vllm-python, or set "
                         f"{VLLM_PYTHON_ENV}; see the README, \"Run vLLM under engined\")")
    out = Path(args.out) if args.out else default_out("vllm", args.quick)

    r, tracker = Report(), Tracker()
    cleanup = Cleanup(tracker)
    scratch = cleanup.scratch("evb")
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="engined-bench-cache-"))
    if args.cache_dir is None:
        cleanup.dirs.append(cache)
    crashes: list[dict] = []
    serves: list[dict] = []
    freezes: list[dict] = []
    serve_out: dict[str, Any] | None = None
    heavy: Heavy | None = None
    try:
        load_before = os.getloadavg()
        r(f"# engined vLLM benchmark{' (--quick)' if args.quick else ''}"
          f"{'' if args.only == 'all' else f' (--only {args.only})'}", "",
          *machine_lines(), engined_revision(),
          f"- vLLM interpreter: {python} ({vllm_versions(python)})",
          f"- load average at start: {load_before[0]:.2f} (1 min)")
        if backend:
            r(f"- overhead rounds: {rounds} (on the heavier model: {heavy_rounds}, and "
              f"{heavy_trials} sustained trial(s)); "
              f"sustained-load trials: {trials} "
              f"({', '.join(f'{n} requests at {c}' for c, n in sizes.items())}); "
              f"engine kills: {kills}; `vllm serve` cold starts: "
              f"{n_serves}; freezes: {n_freezes}, `vllm serve` window {window:g} s")
        if served:
            r(f"- `vllm serve` as a command engine (section 4): {serve_kills} SIGKILL(s) and "
              f"{serve_freezes} SIGSTOP(s) of each kind; the bare server's EngineCore stopped "
              f"for {k8s_window:g} s under the k8s-style probe")
        r("")
        checkpoint = build_checkpoint(cache)  # untimed, exactly as an engine would on first use
        spec = engine_spec(python, cache)
        args_text = ", ".join(f"{k}: {v}" for k, v in spec["engine_args"].items())
        r(f"- model: builtin:tiny-llama ({checkpoint.name}, random weights), `backend: vllm`, "
          f"`launcher: exec`, engine_args {{{args_text}}}, threads 1, max_batch_size 8 "
          f"(max_num_seqs), "
          f"VLLM_CPU_KVCACHE_SPACE={VLLM_ENV['VLLM_CPU_KVCACHE_SPACE']}; daemon heartbeats "
          f"every {HEARTBEATS['heartbeat_interval']}, heartbeat_timeout "
          f"{HEARTBEATS['heartbeat_timeout']}, restarts immediate (backoff 0)", "")

        if backend:
            # Scenario 1: the direct worker builds while the daemon starts (both untimed).
            from engined.supervisor.launcher import expose_engine_package

            pythonpath = expose_engine_package(scratch / "python")
            worker = DirectWorker(python, spec, pythonpath, scratch / "direct.log", tracker)
            cleanup.started.append(worker)  # started by its constructor
            peer = VllmServe(python, checkpoint, scratch, tracker, "peer")
            peer.start()
            cleanup.started.append(peer)
            daemon = cleanup.start(Daemon(spec, tracker))
            dtypes = {"direct": worker.wait_ready()["dtype"],
                      "engined": daemon.engine()["dtype"]}
            peer.wait_health()
            bursts, sustained = asyncio.run(overhead(daemon, worker, peer, rounds, trials,
                                                     sizes))
            cleanup.stop(worker)  # its memory back before the next vLLM processes start
            cleanup.stop(peer)

            # Scenario 2 (and `vllm serve`'s half of 3): engine kills and cold starts
            # interleaved.
            for i in range(max(kills, n_serves)):
                if i < kills:
                    crashes.append(crash_to_ready(daemon))
                if i < n_serves:
                    serves.append(serve_run(python, checkpoint, scratch, tracker, i,
                                            window if i == 0 else None))
            # Scenario 3: engined's half.
            freezes = [engined_freeze(daemon) for _ in range(n_freezes)]
            cleanup.stop(daemon)  # its vLLM engine's memory back before section 4
            daemon.remove_dir()
            if heavy_rounds:  # section 1c, on its own processes
                heavy = heavy_overhead(python, cache, scratch, pythonpath, cleanup, heavy_rounds,
                                       heavy_trials, heavy_sizes)
        if served:
            # Section 4: `vllm serve` under engined as a command engine.
            serve_out = serve_section(python, checkpoint, scratch, cleanup, serve_kills,
                                      serve_freezes, k8s_window)
    finally:
        leftovers = cleanup.close()

    over = crash = serve_freeze_ = served_summary = None
    if backend:
        over = report_overhead(r, bursts, rounds, dtypes)
        over["sustained"] = report_sustained(r, sustained, trials, sizes)
        if heavy is not None:
            over["heavy"] = report_heavy(r, heavy, heavy_rounds, heavy_trials, heavy_sizes,
                                         direct_step_ms(bursts, 8))
        crash = report_crash(r, crashes, serves)
        serve_freeze_ = serves[0].get("freeze") if serves else None
        report_freeze(r, freezes, serve_freeze_, HEARTBEATS["heartbeat_timeout"])
    if serve_out is not None:
        served_summary = report_serve(r, serve_out, serves or None)
    report_summary(r, over, crash, freezes, serve_freeze_, served_summary)
    r(f"- `vllm serve` ran as `VLLM_PYTHON -m {SERVE_MODULE} --model DIR --host 127.0.0.1 "
      f"--port PORT {' '.join(SERVE_ARGS)}` (OMP_NUM_THREADS=1, VLLM_CPU_KVCACHE_SPACE="
      f"{VLLM_ENV['VLLM_CPU_KVCACHE_SPACE']}, offline, its own session, cwd a scratch dir)"
      + ("; in section 4 without `--disable-log-stats`, under engined as the command engine "
         "above and bare with the same argv" if served else ""),
      f"- load average at end: {os.getloadavg()[0]:.2f} (1 min); processes left over and killed "
      f"by pid: {leftovers or 'none'}")
    r.write(out)
    return 0  # a report, not a gate: the verdict is in the table


if __name__ == "__main__":
    sys.exit(main())
