"""Sections 1-1d, reported: the serving table of each (concurrency, max_tokens, path), the
overhead against direct and engined's own cost against the floor (paired round by round, with the
medians taken apart and the fastest rounds beside them), the fixed cost per request and per token
fitted from the two max_tokens values, and the sustained-load table; the verdicts go to the
summary (bench/vllm/__main__.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from bench.report import Report, ms, quantile, signed_pct, table
from bench.vllm.engine import MAX_TOKENS
from bench.vllm.overhead import (
    CONCURRENCY,
    ENGINED_PATHS,
    HEAVY_DIMS,
    OVERHEAD_TARGET_PCT,
    PATH_LABELS,
    PATHS,
    PRIMING,
    WARMUP_ROUNDS,
    Heavy,
    Results,
    Round,
)


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


def direct_step_ms(res: Results, c: int) -> float:
    """The direct path's time per token position at `c` concurrent, longest max_tokens."""
    m = MAX_TOKENS[-1]
    return 1000 * round_med(res[("direct", c, m)]) / m


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
                  f"{ms(rm, 1)} | {ms(quantile(lats, 0.5), 1)} | {ms(quantile(lats, 0.95), 1)} | "
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
            direct_p50 = quantile([x for s in res[("direct", c, m)] for x in s.latencies_s], 0.5)
            for path in PATHS[1:]:
                rs = res[(path, c, m)]
                over = paired_pct(res, path, c, m)
                p50 = quantile([x for s in rs for x in s.latencies_s], 0.5)
                outside = (ms(statistics.median(s.elapsed_s - s.engine_s for s in rs), 1)
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
                return quantile([x for t in res[(path, c, m)] for x in t.latencies_s], 0.5)

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
                  f"{'–' if path == 'direct' else signed_pct(apart)} | "
                  f"{ms(quantile(lats, 0.5), 1)} | {'–' if path == 'direct' else vs_p50} | "
                  f"{ms(quantile(lats, 0.95), 1)} | "
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
