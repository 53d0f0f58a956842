"""Sections 5-6, engines on demand (docs/on-demand.md), through the gateway: a request's arrival →
its first token when its model sleeps (the request wakes it) against the same request awake, by
kind of engine (one daemon, every engine on demand, `enginectl sleep NAME` before each wake); and
a swap under load: 4 tiny-llama models within a memory budget that fits 2, a fixed client mix
over the four, against the same mix on the same models always resident, rounds alternating.
"""

from __future__ import annotations

import http.client
import random
import time
from pathlib import Path
from typing import Any

from bench.common import BenchError, Cleanup
from bench.recovery.daemon import GatewayDaemon, tiny_backend
from bench.recovery.load import Load, Req, request
from bench.report import DASH, Report, med, ms, quantile, table
from bench.vllm.engine import engine_spec as vllm_engine_spec
from bench.vllm.engine import served_spec

PROMPT = "on-demand benchmark: the quick brown fox"
WAKE_TOKENS, SWAP_TOKENS = 8, 16
SETTLE_S = 0.5  # after a sleep, before the request that wakes it
ON_DEMAND = {"idle_timeout": "1h", "wake_timeout": "10m"}  # asleep when told, or for the budget
MODELS, MEMORY_LIMIT, BUDGET = 4, "1GiB", "2GiB"  # the swap: the budget fits 2 of the 4
MIX = (4, 3, 2, 1)  # the swap's requests to m0..m3, in these proportions
FLEETS = {"resident": "always resident", "ondemand": f"on demand, budget fits 2 of {MODELS}"}
WAKE_COLUMNS = (("asleep: arrival → first token, median", True), ("awake: the same", True),
                ("the wake's extra wait (median of pairs)", False),
                ("arrival → READY (`since`)", False), ("spawn → READY (`startup_s`)", False),
                ("the sleep before: POST → ASLEEP", False))  # (label, min–max shown)


def kinds(cache: Path, checkpoint: Path, vllm_python: str | None) -> dict[str, dict[str, Any]]:
    """What wakes, by label: one replica, its name the model's (vLLM's with its interpreter)."""
    out = {"builtin:echo (fork server)": {"name": "echo", "model": "builtin:echo"},
           "builtin:tiny-llama (fork server)": {**tiny_backend(cache).spec, "replicas": 1}}
    if vllm_python is not None:
        served = served_spec(vllm_python, checkpoint, cache)
        served["command"] = [*served["command"], "--dtype", "float32"]  # as tests/vllm's
        out["`backend: vllm` (its fork server)"] = {**vllm_engine_spec(vllm_python, cache),
                                                    "launcher": "forkserver"}
        out["`vllm serve` command engine (cold)"] = served
    # adapter replay (issue 45): a `backend: vllm` engine whose wake replays its LoRA adapters
    # comes here, its row in section 5 beside the others
    return out


def first_token(d: GatewayDaemon, model: str, tokens: int,
                conn: http.client.HTTPConnection | None = None) -> Req:
    """One streamed request (on `conn`, else on a connection of its own); BenchError unless ok."""
    own = conn or http.client.HTTPConnection("127.0.0.1", d.gateway_port, timeout=120)
    try:
        q = request(own, model, PROMPT, tokens, True)
    finally:
        if conn is None:
            own.close()
    if not q.ok or q.ttft is None:
        raise BenchError(f"{model}: {q.kind} {q.detail}\n{d.log_tail()}")
    return q


def wake_runs(d: GatewayDaemon, model: str, n: int) -> list[tuple[float, ...]]:
    """An untimed first wake, then n times: the request on the awake engine, a sleep, SETTLE_S,
    the same request (it wakes the model): each run's WAKE_COLUMNS. Then the model sleeps."""
    conn = http.client.HTTPConnection("127.0.0.1", d.gateway_port, timeout=600)
    try:
        first_token(d, model, WAKE_TOKENS, conn)  # untimed: caches, the first fork
        runs: list[tuple[float, ...]] = []
        for _ in range(n):
            awake = first_token(d, model, WAKE_TOKENS, conn).ttft or 0.0
            slept = time.time()
            d.sleep(f"{model}-0")
            slept = time.time() - slept
            time.sleep(SETTLE_S)
            q = first_token(d, model, WAKE_TOKENS, conn)
            e = d.engine(f"{model}-0")
            d.tracker.add(e["pid"])
            runs.append((q.ttft or 0.0, awake, (q.ttft or 0.0) - awake, e["since"] - q.start,
                         e["startup_s"] or 0.0, slept))
        d.sleep(f"{model}-0")  # its memory back before the next kind wakes
        return runs
    finally:
        conn.close()


def wake_section(cleanup: Cleanup, kinds_: dict[str, dict[str, Any]], n: int
                 ) -> dict[str, list[tuple[float, ...]]]:
    d = cleanup.start(GatewayDaemon("eo", cleanup.tracker,
                                    [{**spec, **ON_DEMAND} for spec in kinds_.values()]))
    out = {label: wake_runs(d, spec["name"], n) for label, spec in kinds_.items()}
    cleanup.stop(d)
    return out


def swap_section(cleanup: Cleanup, cache: Path, rounds: int, clients: int, per_client: int
                 ) -> dict[str, dict[str, Any]]:
    """Both fleets warmed by one untimed request per model, then `rounds` of the mix on each,
    alternating which goes first: per fleet its requests, wall times and wakes. The mix: each
    client's models in order, seeded (the same for both fleets)."""
    engines = [{**tiny_backend(cache).spec, "name": f"m{i}", "replicas": 1,
                "memory_limit": MEMORY_LIMIT} for i in range(MODELS)]
    fleets = {"resident": cleanup.start(GatewayDaemon("eo", cleanup.tracker, engines)),
              "ondemand": cleanup.start(GatewayDaemon(
                  "eo", cleanup.tracker, [{**e, **ON_DEMAND} for e in engines],
                  memory_budget={"host": BUDGET}))}
    out: dict[str, dict[str, Any]] = {k: {"reqs": [], "wall_s": [], "wakes": 0} for k in fleets}
    rng = random.Random(45)
    plan = [rng.choices([f"m{i}" for i in range(MODELS)], MIX, k=per_client)
            for _ in range(clients)]
    for d in fleets.values():
        for i in range(MODELS):
            first_token(d, f"m{i}", SWAP_TOKENS)
    for i in range(rounds):
        for key in (list(fleets) if i % 2 == 0 else list(fleets)[::-1]):
            d, got = fleets[key], out[key]
            wakes, start = d.wakes(), time.time()
            load = Load(d.gateway_port, clients, lambda c, k: (plan[c][k], True)
                        if k < per_client else None, PROMPT, SWAP_TOKENS).start()
            got["reqs"] += load.stop(now=False, timeout_s=900)
            got["wall_s"].append(time.time() - start)
            got["wakes"] += d.wakes() - wakes
    for d in fleets.values():
        cleanup.stop(d)
    return out


# --- the report -----------------------------------------------------------------------------------
def dur(seconds: float | None) -> str:
    return DASH if seconds is None else (
        f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms")


def report_wake(r: Report, wakes: dict[str, list[tuple[float, ...]]], skipped: str | None) -> None:
    r("## 5. On demand: a wake → first token, by kind (against the same request awake)", "",
      *table("kind", *(h for label, ranged in WAKE_COLUMNS
                       for h in ((label, "min–max") if ranged else (label,))), "n"))
    for kind, runs in wakes.items():
        cells = [dur(med(v)) + (f" | {dur(min(v))}–{dur(max(v))}" if ranged else "")
                 for j, (_, ranged) in enumerate(WAKE_COLUMNS) if (v := [x[j] for x in runs])]
        r(f"| {kind} | {' | '.join(cells)} | {len(runs)} |")
    if skipped:
        r(f"| vLLM kinds | skipped: {skipped} | {' | '.join([DASH] * 7)} | 0 |")
    r("", "Every engine on demand (`idle_timeout: 1h`: asleep until asked). Per kind an untimed "
      f"first wake, then per run: a streamed `/v1/completions` (max_tokens {WAKE_TOKENS}, "
      "greedy) through the gateway on the awake engine, `POST /v1/engines/NAME/sleep` (what "
      f"`enginectl sleep` sends: it answers once the engine is ASLEEP), {SETTLE_S:g} s, the "
      "same request, which wakes the model and waits in the gateway. Arrival → first token: the "
      "client's (sent → first SSE chunk); READY and `startup_s`: the daemon's. Each kind sleeps "
      "before the next wakes. `vllm serve` is READY once its /health probe (every 1 s) answers.",
      "")


def report_swap(r: Report, swap: dict[str, dict[str, Any]], clients: int) -> None:
    r(f"## 6. On demand: a swap under load ({MODELS} tiny-llama models, {clients} clients)", "",
      *table("measure", *FLEETS.values(), "on demand − resident"))
    for what, of in (("first", lambda x: x.ttft), ("last", lambda x: x.end - x.start)):
        for q, at in ((0.5, "p50"), (0.95, "p95"), (1.0, "max")):
            a, b = (quantile([of(x) for x in swap[k]["reqs"] if x.ok], q) for k in FLEETS)
            r(f"| arrival → {what} token, {at} | {ms(a, 1)} | {ms(b, 1)} | "
              f"{DASH if a is None or b is None else ms(b - a, 1)} |")
    for label, f in (("requests answered ok", lambda s: sum(x.ok for x in s["reqs"])),
                     ("requests failed", lambda s: sum(not x.ok for x in s["reqs"])),
                     ("wakes during the mix (a swap once 2 are awake)", lambda s: s["wakes"]),
                     ("wall time of the mix per round (median)",
                      lambda s: f"{med(s['wall_s']):.2f} s")):
        r(f"| {label} | {' | '.join(str(f(swap[k])) for k in FLEETS)} | {DASH} |")
    failed = [x for s in swap.values() for x in s["reqs"] if not x.ok]
    r("", f"The same {MODELS} groups of 1 tiny-llama replica (1 thread, max_batch_size 8, "
      f"memory_limit {MEMORY_LIMIT}); on demand: `idle_timeout: 1h`, `supervisor.memory_budget: "
      f"{{host: {BUDGET}}}` (2 awake at most; a wake puts the least recently used idle one to "
      "sleep). Each client sends its own fixed sequence of streamed `/v1/completions` "
      f"(max_tokens {SWAP_TOKENS}), models m0-m3 in proportions {':'.join(map(str, MIX))}, the "
      "same for both fleets; a round is every client's sequence. Wakes: the daemon's count "
      f"(status `on_demand.wakes`). First failure: {failed[0].detail if failed else 'none'}.", "")
