"""What the gateway costs against talking to the engine directly, at 1 and 8 concurrent
requests, for tiny-llama and echo, on the four paths of bench/gateway/paths.py in a seeded random
order each round: requests/s, latency, overhead vs direct, on-CPU time per request.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import Cleanup, Tracker, terminate
from bench.gateway.paths import (
    CONCURRENCY,
    MAX_TOKENS,
    MODELS,
    PATHS,
    PROMPTS,
    Clients,
    Direct,
    GatewayDaemon,
    Round,
    on_cpu_s,
)
from bench.report import Report, ms, quantile, signed_pct, table

OVERHEAD_TARGET_PCT = 5.0  # the target: gateway vs direct at 8, tiny-llama
WARMUP_ROUNDS = 2


# --- the rounds -----------------------------------------------------------------------------------
async def one_round(clients: Clients, path: str, group: str, concurrency: int,
                    pids: tuple[int, int, int] | None = None) -> Round:
    """`concurrency` requests sent at once on one path; wall time from the first send to the
    last answer; with `pids` (engine, daemon, this process), what each spent on a CPU (read
    outside the timed span)."""
    cpu0 = [on_cpu_s(pid) for pid in pids] if pids else []
    started = time.perf_counter()
    samples = await asyncio.wait_for(asyncio.gather(
        *(clients.one(path, group, PROMPTS[i]) for i in range(concurrency))), 300)
    elapsed = time.perf_counter() - started
    done = Round(elapsed, list(samples))
    if pids:
        a, b, c = (on_cpu_s(pid) - t for pid, t in zip(pids, cpu0))
        done.cpu_s = (a, b, c)
    return done


async def overhead_rounds(clients: Clients, group: str, rounds: int, rng: random.Random,
                          pids: dict[str, tuple[int, int, int]]
                          ) -> dict[tuple[int, str], list[Round]]:
    """Rounds of every (concurrency, path), the paths in a fresh random order each time: a load
    change on the machine, or what the path before left behind (the other engine process's
    caches: the direct paths run on the bench's engine, the others on the daemon's), hit all of
    them alike."""
    out: dict[tuple[int, str], list[Round]] = {(c, p.key): [] for c in CONCURRENCY for p in PATHS}
    keys = [p.key for p in PATHS]
    for i in range(WARMUP_ROUNDS + rounds):
        for concurrency in CONCURRENCY:
            rng.shuffle(keys)
            for path in list(keys):
                result = await one_round(clients, path, group, concurrency,
                                         pids["direct" if path.startswith("direct") else "daemon"])
                if i >= WARMUP_ROUNDS:
                    out[(concurrency, path)].append(result)
    return out


async def overhead_scenario(cleanup: Cleanup, tracker: Tracker, cache: Path,
                            rounds: dict[str, int], seed: int) -> dict[str, Any]:
    daemon = GatewayDaemon("eg", tracker, [
        {"name": group, "replicas": 1, "model": model, "max_batch_size": 8, "threads": 1,
         "env": {"ENGINED_CACHE_DIR": str(cache)}} for group, (model, _) in MODELS.items()])
    direct = Direct(cleanup, tracker, cache)
    cleanup.closers.append(lambda: [terminate(p, 5) for p in direct.procs.values()])
    try:
        await asyncio.gather(asyncio.to_thread(cleanup.start, daemon, 300),
                             direct.start({g: m for g, (m, _) in MODELS.items()}))
        clients = Clients(direct, daemon.gateway_port)
        try:
            rng = random.Random(seed)
            engines = {e["name"]: e["pid"] for e in daemon.status()["engines"]}
            results = {}
            for group in MODELS:
                pids = {"direct": (direct.procs[group].pid, daemon.pid, os.getpid()),
                        "daemon": (engines[f"{group}-0"], daemon.pid, os.getpid())}
                results[group] = await overhead_rounds(clients, group, rounds[group], rng, pids)
        finally:
            await clients.close()
        engines = {e["name"]: e for e in daemon.status()["engines"]}
        restarts = sum(e["restarts"] for e in engines.values())
    finally:
        await direct.stop()
    await asyncio.to_thread(cleanup.stop, daemon, 60)
    return {"results": results, "restarts": restarts, "stop_note": daemon.stop_note}


# --- report ---------------------------------------------------------------------------------------
def summarize(rounds: list[Round]) -> dict[str, Any]:
    latencies = [s.latency_s for r in rounds for s in r.samples]
    elapsed = statistics.median(r.elapsed_s for r in rounds)
    fastest = sorted(r.elapsed_s for r in rounds)[:max(1, len(rounds) // 4)]
    return {"elapsed": elapsed, "fastest": statistics.fmean(fastest),
            "rps": len(rounds[0].samples) / elapsed,
            "p50": quantile(latencies, 0.5), "p95": quantile(latencies, 0.95),
            "n": len(latencies),
            "cpu": [statistics.median(r.cpu_s[k] for r in rounds) / len(rounds[0].samples)
                    for k in range(3)],
            "tokens": statistics.median(s.tokens for r in rounds for s in r.samples)}


def report_overhead(r: Report, group: str, res: dict[tuple[int, str], list[Round]],
                    rounds: int) -> dict[tuple[int, str], dict[str, Any]]:
    stats = {key: summarize(v) for key, v in res.items()}
    r(f"### {MODELS[group][1]}: max_tokens {MAX_TOKENS}, greedy, {rounds} rounds", "",
      *table("concurrency", "path", "requests/s", "latency p50", "latency p95",
             "overhead vs direct (round time)", "same, fastest quarter of rounds",
             "on-CPU per request: engine / daemon / bench",
             "tokens/request", "requests"))
    for c in CONCURRENCY:
        for p in PATHS:
            s, base = stats[(c, p.key)], stats[(c, p.baseline)]
            is_base = p.key == p.baseline
            over = None if is_base else 100 * (s["elapsed"] / base["elapsed"] - 1)
            best = None if is_base else 100 * (s["fastest"] / base["fastest"] - 1)
            r(f"| {c} | {p.label}{' (baseline)' if is_base else ''} | {s['rps']:.1f} | "
              f"{ms(s['p50'])} | {ms(s['p95'])} | {signed_pct(over)} | {signed_pct(best)} | "
              + " / ".join(f"{x * 1e3:.1f}" for x in s["cpu"])
              + f" ms | {s['tokens']:.0f} | {s['n']} |")
    r("")
    return stats
