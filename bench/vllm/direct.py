"""Section 1: engined's `backend: vllm` engine through its gateway against the same LLMEngine driven
directly (bench/vllm/worker.py: built by the engine child's own `build_vllm_backend`, then
`add_request` + `step()` in one process), under sustained load: 1 or 8 requests always in flight
(each client sends its next request when its last one is answered; the worker replaces a
finished request before its next step), trials of both paths in a rotating order.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    BenchError,
    Tracker,
    child_environment,
    terminate,
    without_engined_vars,
)
from bench.report import DASH, Report, ms, quantile, signed_pct, spread, table
from bench.vllm.engine import GROUP, START_TIMEOUT_S
from testkit.driver import read_until, stream_lines

CONCURRENCY = (1, 8)
MAX_TOKENS = 64
PROMPTS = [f"vllm benchmark prompt {i}: the quick brown fox" for i in range(8)]  # equal lengths
TARGET_PCT = 5.0  # the issue's: throughput at 8 concurrent within 5 % of direct
PATHS = {"direct": "direct `LLMEngine` (add_request + step, one process)",
         "gateway": "engined: gateway `POST /v1/completions`"}
Trial = dict[str, Any]  # elapsed_s, latencies_s, tokens


def direct_config(spec: dict[str, Any]) -> dict[str, Any]:
    """The EngineConfig the daemon gives replica 0 of `spec` (endpoints unused)."""
    return {"name": "direct", "group": "direct", "rank": 0, "replicas": 1, "incarnation": 1,
            "model": spec["model"], "dtype": None, "gpus": [], "data_parallel": False,
            "max_batch_size": spec["max_batch_size"], "threads": spec["threads"],
            "control_endpoint": "", "request_endpoint": "", "heartbeat_interval_s": 1.0,
            "python": spec["python"], "backend": spec["backend"],
            "engine_args": dict(spec.get("engine_args") or {})}


class DirectWorker:
    """`VLLM_PYTHON -m bench.vllm.worker CONFIG`, in an engine child's environment as engined's
    exec launcher builds it (`launcher.child_environment`: thread bounds, offline, no GPU, the
    spec's env, the engine package on PYTHONPATH) minus the marks of a daemon's engine."""

    def __init__(self, spec: dict[str, Any], pythonpath: str, scratch: Path,
                 tracker: Tracker) -> None:
        self.spec, self.pythonpath, self.scratch, self.tracker = spec, pythonpath, scratch, tracker
        self.log_path = scratch / "direct.log"
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        from engined.engine.protocol import EngineConfig

        saved = dict(os.environ)
        base = without_engined_vars(None, "WATCHDOG_USEC", "WATCHDOG_PID", "PYTHONPATH")
        try:  # child_environment reads os.environ: ours, without engined's own variables
            os.environ.clear()
            os.environ.update(base)
            env = child_environment(EngineConfig(**direct_config(self.spec)),
                                    {**self.spec["env"], "TMPDIR": str(self.scratch)},
                                    self.pythonpath)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        env = {k: v for k, v in env.items() if not k.startswith("ENGINED_")
               or k in self.spec["env"] or k == "ENGINED_NUM_THREADS"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [self.spec["python"], "-m", "bench.vllm.worker",
                 json.dumps(direct_config(self.spec))], cwd=ROOT, env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self.tracker.add(self.proc.pid)
        assert self.proc.stdout is not None
        self.lines = stream_lines(self.proc.stdout)

    def _line(self, timeout_s: float) -> dict[str, Any]:
        try:
            (line,) = read_until(self.lines, "{", timeout_s)[-1:]
        except AssertionError as exc:
            tail = self.log_path.read_text(errors="replace").splitlines()[-20:]
            raise BenchError(f"direct worker: {exc}\n" + "\n".join(tail)) from None
        return json.loads(line)

    def wait_ready(self) -> dict[str, Any]:
        return self._line(START_TIMEOUT_S)

    def run(self, concurrency: int, requests: int) -> Trial:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                                          "concurrency": concurrency,
                                          "requests": requests}) + "\n")
        self.proc.stdin.flush()
        return self._line(300)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # its stop signal: EOF on stdin
            terminate(self.proc, 30, sig=None)


async def gateway_trial(session: Any, port: int, concurrency: int, requests: int) -> Trial:
    """`concurrency` clients, each sending its next completion when its last one is answered."""
    left, latencies, tokens = iter(range(requests)), [], []

    async def client() -> None:
        for k in left:
            body = {"model": GROUP, "prompt": PROMPTS[k % len(PROMPTS)], "temperature": 0,
                    "max_tokens": MAX_TOKENS}
            started = time.perf_counter()
            async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                    json=body) as resp:
                data = await resp.json()
                if resp.status != 200:
                    raise BenchError(f"POST /v1/completions: HTTP {resp.status}: {data}")
            latencies.append(time.perf_counter() - started)
            tokens.append(data["usage"]["completion_tokens"])

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return {"elapsed_s": time.perf_counter() - started, "latencies_s": latencies,
            "tokens": tokens}


async def sustained(worker: DirectWorker, port: int, trials: int, sizes: dict[int, int]
                    ) -> dict[tuple[str, int], list[Trial]]:
    import aiohttp

    out: dict[tuple[str, int], list[Trial]] = {(p, c): [] for p in PATHS for c in CONCURRENCY}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        await gateway_trial(session, port, 8, 8)  # untimed: connections, the first steps
        for i in range(trials):
            for c in CONCURRENCY:
                for path in (list(PATHS) if i % 2 == 0 else list(PATHS)[::-1]):
                    out[(path, c)].append(
                        await asyncio.to_thread(worker.run, c, sizes[c]) if path == "direct"
                        else await gateway_trial(session, port, c, sizes[c]))
    return out


def report_direct(r: Report, res: dict[tuple[str, int], list[Trial]], trials: int,
                  sizes: dict[int, int]) -> list[tuple[float, str]]:
    """The table; returns the verdicts at 8 concurrent (throughput vs direct, %) for the
    summary."""
    def tps(t: Trial) -> float:
        return sum(t["tokens"]) / t["elapsed_s"]
    r("## 1. Sustained load: engined's gateway against the same LLMEngine driven directly", "",
      f"max_tokens {MAX_TOKENS}, greedy; {trials} trial(s) of each path and concurrency "
      f"({', '.join(f'{n} requests at {c}' for c, n in sizes.items())}), the paths' order "
      "alternating trial by trial. Throughput vs direct is paired: a trial's tokens/s over "
      "direct's in the same round, the median over rounds (min–max beside it).", "",
      *table("concurrency", "path", "output tokens/s", "throughput vs direct",
             "vs direct, min–max", "latency p50", "latency p95", "tokens/request", "requests",
             "target (8: within 5 %)"))
    verdicts = []
    for c in CONCURRENCY:
        for path, label in PATHS.items():
            ts = res[(path, c)]
            lat = [x for t in ts for x in t["latencies_s"] if x is not None]
            toks = {x for t in ts for x in t["tokens"]}
            pairs = [100 * (tps(a) / tps(b) - 1) for a, b in zip(ts, res[("direct", c)])]
            loss = statistics.median(pairs) if path != "direct" else None
            verdict = DASH
            if c == 8 and loss is not None:
                verdict = "PASS" if loss > -TARGET_PCT else \
                    f"MISS by {-loss - TARGET_PCT:.1f} points"
                verdicts.append((loss, verdict))
            r(f"| {c} | {label} | {statistics.median(tps(t) for t in ts):.0f} | "
              f"{signed_pct(loss)} | {spread(pairs, 1, '%') if loss is not None else DASH} | "
              f"{ms(quantile(lat, 0.5), 1)} | {ms(quantile(lat, 0.95), 1)} | "
              f"{'/'.join(map(str, sorted(toks)))} | {len(lat)} | {verdict} |")
    r("", "Direct is what vLLM's own API gives anyone who drives the engine in their process; "
      "engined adds the engine child's busy loop, a ZeroMQ hop, the daemon's gateway and HTTP "
      "(aiohttp clients in this process, on the same 2 CPUs). Our protocol has no `ignore_eos`: "
      "tiny-llama's random weights never pick eos, so every request makes max_tokens (the "
      "tokens/request column).", "")
    return verdicts
