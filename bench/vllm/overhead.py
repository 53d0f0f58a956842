"""Sections 1-1d, measured: what engined costs over the same `LLMEngine` driven directly, in
bursts (1 or 8 requests sent at once, the round timed to the last answer) and under sustained load
(1 or 8 requests always in flight), on five paths: direct (bench/vllm_direct.py: the engine
child's own `build_vllm_backend`, then `add_request` + `step()`), the floor (that engine behind
the least HTTP server one could write, in the same process), engined's control socket and
gateway, and the peer, `vllm serve`; then the same on a heavier model (1c, 1d). Reported by
bench/vllm/overhead_report.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    BenchError,
    Cleanup,
    LeanHTTP,
    Tracker,
    child_environment,
    terminate,
    without_engined_vars,
)
from bench.models import build_checkpoint
from bench.vllm.engine import (
    ENGINE,
    GROUP,
    MAX_TOKENS,
    PROMPTS,
    START_TIMEOUT_S,
    BackendDaemon,
    engine_spec,
)
from bench.vllm.server import VllmServe
from testkit.driver import read_until, stream_lines

CONCURRENCY = (1, 8)
OVERHEAD_TARGET_PCT = 5.0  # the target at 8 concurrent requests
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
SUSTAINED_REQUESTS_QUICK = {1: 6, 8: 24}
# Sections 1c and 1d: a heavier random model from tiny-llama's recipe (its tokenizer, head_dim
# 64), whose decode step at 8 concurrent (~12-15 ms here) is the order of a 7-13B model's on one
# GPU; tiny-llama's ~2.5 ms step is mostly vLLM's own per-step Python.
HEAVY_DIMS = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 4}
HEAVY_NAME = "heavy-llama-" + "-".join(str(v) for v in HEAVY_DIMS.values())
# its sustained load (section 1d), per trial: 12 cycles of 8 (a trial of 48 was a ±10 % noise)
HEAVY_SUSTAINED_REQUESTS = {1: 12, 8: 96}
HEAVY_SUSTAINED_REQUESTS_QUICK = {1: 2, 8: 8}


# --- the direct path ------------------------------------------------------------------------------
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


# --- engined's paths, the floor, the peer ---------------------------------------------------------
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


# --- bursts and sustained load, the paths in turn -------------------------------------------------
Results = dict[tuple[str, int, int], list[Round]]  # (path, concurrency, max_tokens) -> rounds


async def overhead(daemon: BackendDaemon, worker: DirectWorker, serve: VllmServe, rounds: int,
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


# --- 1c, 1d: the same at a heavier step -----------------------------------------------------------
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
    daemon = cleanup.start(BackendDaemon(spec, tracker))
    dtypes = {"direct": worker.wait_ready()["dtype"], "engined": daemon.engine()["dtype"]}
    peer.wait_health()
    bursts, sustained = asyncio.run(overhead(daemon, worker, peer, rounds, trials, sizes))
    for started in (worker, peer, daemon):
        cleanup.stop(started)
    daemon.remove_dir()
    return Heavy(bursts, sustained, dtypes, model.name)
