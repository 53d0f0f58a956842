"""Section 2, reported: vLLM's serving benchmark against the three targets (a table of vLLM's own
figures, the median over rounds; every run in the order it ran), engined's two paths against
`vllm serve` per concurrency (paired within a round: throughput and median TTFT ratios), and the
issue's target: engined's throughput at least `vllm serve`'s, its median TTFT no worse.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.report import DASH, Report, table, times
from bench.vllm.engine import SEQS, SERVE_ARGS, SERVE_MODULE
from bench.vllm.serving import CLIENT_FLAGS, SETTLE_S, TARGETS, Workload

TARGET_LABELS = {"serve": "`vllm serve` alone",
                 "backend": "engined gateway → `backend: vllm`",
                 "command": "engined gateway → `vllm serve` (command engine)"}
ENGINED = ("backend", "command")
COLUMNS = ("target", "concurrency", "completed / failed", "requests/s", "output tok/s",
           "TTFT median ms", "TTFT p99 ms", "TPOT median ms", "ITL median ms",
           "output tokens per request")


def _med(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _num(value: float | None, digits: int) -> str:
    return DASH if value is None else f"{value:.{digits}f}"


def _lens(runs: list[dict[str, Any]]) -> str:
    lens = sorted({n for r in runs for n in r["output_lens"]})
    if not lens:
        return DASH
    return str(lens[0]) if len(lens) == 1 else f"{lens[0]}–{lens[-1]}"


def ratios(runs: list[dict[str, Any]], key: str, c: int, metric: str) -> list[float]:
    """The target's `metric` over `vllm serve`'s, in each round (both measured then)."""
    out = []
    by = {(r["round"], r["target"]): r for r in runs if r["concurrency"] == c}
    for (rnd, target), run in sorted(by.items()):
        base = by.get((rnd, "serve"))
        if target != key or base is None or not base.get(metric) or run.get(metric) is None:
            continue
        out.append(run[metric] / base[metric])
    return out


def identical(runs: list[dict[str, Any]], key: str) -> tuple[int, int]:
    """(requests whose text equals `vllm serve`'s for the same prompt, requests compared)."""
    by = {(r["round"], r["concurrency"], r["target"]): r for r in runs}
    same = total = 0
    for (rnd, c, target), run in by.items():
        base = by.get((rnd, c, "serve"))
        if target != key or base is None:
            continue
        for a, b in zip(run["texts"], base["texts"]):
            if a is not None and b is not None:
                total += 1
                same += a == b
    return same, total


def _ratio_text(values: list[float]) -> str:
    if not values:
        return DASH
    if len(values) == 1:
        return times(values[0])
    return f"{times(statistics.median(values))} ({times(min(values))}–{times(max(values))})"


def report_serving(r: Report, out: dict[str, Any]) -> list[dict[str, Any]]:
    """Section 5; returns the verdicts (one per concurrency and engined path) for the summary."""
    w: Workload = out["workload"]
    runs: list[dict[str, Any]] = out["runs"]
    r("## 2. Serving: vLLM's serving benchmark through engined's gateway against `vllm serve`",
      "",
      f"vLLM's own serving benchmark (`vllm.benchmarks.serve`, what `vllm bench serve` runs), "
      f"one client process under the vLLM interpreter, against three servers of the same "
      f"builtin:tiny-llama, all up at once and measured one at a time: {w.text()}. Each run "
      f"begins with vLLM's warm-up (`--num-warmups C`: one wave of C requests at the run's "
      f"concurrency, not measured). Figures are vLLM's, from its `--save-result` JSON; with "
      f"more than one round, each cell is the median over rounds.", "",
      *table(*COLUMNS))
    for c in w.prompts:
        for key in TARGETS:
            rs = [x for x in runs if x["concurrency"] == c and x["target"] == key]
            r(f"| {TARGET_LABELS[key]} | {c} | {sum(x['completed'] for x in rs)} / "
              f"{sum(x['failed'] for x in rs)} | {_num(_med(rs, 'request_throughput'), 2)} | "
              f"{_num(_med(rs, 'output_throughput'), 1)} | {_num(_med(rs, 'median_ttft_ms'), 1)} "
              f"| {_num(_med(rs, 'p99_ttft_ms'), 1)} | {_num(_med(rs, 'median_tpot_ms'), 2)} | "
              f"{_num(_med(rs, 'median_itl_ms'), 2)} | {_lens(rs)} |")
    r("")
    verdicts = []
    for c in w.prompts:
        for key in ENGINED:
            thr = ratios(runs, key, c, "output_throughput")
            ttft = ratios(runs, key, c, "median_ttft_ms")
            thr_m = statistics.median(thr) if thr else None
            ttft_m = statistics.median(ttft) if ttft else None
            met = thr_m is not None and ttft_m is not None and thr_m >= 1.0 and ttft_m <= 1.0
            missed = [what for what, bad in (("throughput", thr_m is None or thr_m < 1.0),
                                             ("median TTFT", ttft_m is None or ttft_m > 1.0))
                      if bad]
            verdict = "PASS" if met else "MISS (" + " and ".join(missed) + ")"
            verdicts.append({"concurrency": c, "target": key, "throughput": thr,
                             "ttft": ttft, "verdict": verdict})
            r(f"- at {c} concurrent, {TARGET_LABELS[key]} against `vllm serve`: output "
              f"throughput {_ratio_text(thr)}, median TTFT {_ratio_text(ttft)} (paired by "
              f"round; median (min–max) over rounds); target (throughput ≥ 1.00×, median TTFT "
              f"≤ 1.00×): {'met' if met else 'not met'}, {verdict}")
    r("")
    for key in ENGINED:
        same, total = identical(runs, key)
        r(f"- greedy outputs of {TARGET_LABELS[key]} identical to `vllm serve`'s (same round, "
          f"same prompt): {same} of {total} requests")
    failed = [x for x in runs if x["failed"] or x["errors"]]
    for x in failed:
        errors = "; ".join(f"{n} × {e}" for e, n in x["errors"].items()) or DASH
        r(f"- failed requests, {TARGET_LABELS[x['target']]} at {x['concurrency']} (round "
          f"{x['round']}): {x['failed']}: {errors}")
    if failed:
        r("")

    r("Every run, in the order it ran:", "",
      *table("#", "round", "concurrency", "target", "requests/s", "output tok/s",
             "TTFT median ms", "input tokens", "run s", "CPU busy %", "others' CPU %"))
    order = sorted(runs, key=lambda x: (x["round"], list(w.prompts).index(x["concurrency"]),
                                        x["position"]))
    for i, x in enumerate(order, 1):
        r(f"| {i} | {x['round']} | {x['concurrency']} | {TARGET_LABELS[x['target']]} | "
          f"{_num(x['request_throughput'], 2)} | {_num(x['output_throughput'], 1)} | "
          f"{_num(x['median_ttft_ms'], 1)} | {x['input_tokens']} | {x['wall_s']:.1f} | "
          f"{x['cpu_busy_pct']:.0f} | {x['others_pct']:.0f} |")
    r("")
    during = {k: n for k, (n, _, _) in out["restarts"].items() if n}
    ever = "; ".join(f"{k}: {', '.join(f'{why} ×{n}' for why, n in by.items())}, its last "
                     f"exit's last log line `{tail}`" for k, (_, by, tail) in
                     out["restarts"].items())
    r(f"- targets: `vllm serve` alone is `VLLM_PYTHON -m {SERVE_MODULE} --model DIR --host "
      f"127.0.0.1 --port PORT {' '.join(SERVE_ARGS)}`; engined's command engine runs that same "
      f"argv (`port: auto`, `progress: vllm`, probe on `/health`); engined's `backend: vllm` "
      f"engine has engine_args {{enforce_eager: true, max_model_len: 1024}}, max_batch_size "
      f"{SEQS} (max_num_seqs), threads 1, engined's default disable_log_stats (`vllm serve` "
      f"keeps its default, log stats on: `progress: vllm` reads them); all with "
      f"OMP_NUM_THREADS=1 and VLLM_CPU_KVCACHE_SPACE=1. Both engined groups are in one daemon, "
      f"behind one gateway",
      f"- what runs where (process name, CPUs it may run on): `vllm serve`: "
      f"{', '.join(out['layout']['serve'])}; engined: the daemon, gateway included, "
      f"{', '.join(out['layout']['daemon'])}, the `backend: vllm` engine "
      f"{', '.join(out['layout']['backend'])} (vLLM's engine in that process: engined runs it "
      f"with VLLM_ENABLE_V1_MULTIPROCESSING=0), the command engine "
      f"{', '.join(out['layout']['command'])}",
      f"- the client: `{' '.join(CLIENT_FLAGS)}` (C, N, L, the URL and the model per run; "
      f"SEED: 1 + round × {len(w.prompts)} + the concurrency's index, the same prompts for "
      f"every target in a round; "
      f"`--model` the name each server serves: the model directory for `vllm serve`, the group "
      f"for engined's gateway; `--tokenizer` the model directory for all)",
      f"- the order: round r at the k-th concurrency runs the targets in the (r + 3k) mod 6-th "
      f"of their six orders (every target in every position and after each other target "
      f"equally often over six rounds), each run {SETTLE_S:g} s after the previous one (vLLM's "
      f"Worker spins for about a second after its last request); every target stays up (idle) "
      f"through the others' runs; the runs table's last column is the CPU that other work on "
      f"this shared machine took during the run",
      f"- time: {out['client_s']:.0f} s for the client's {len(runs)} runs, "
      f"{out['section_s']:.0f} s for the section in all; restarts under engined "
      f"during them: {during or 'none'} (since the daemon started: {ever or 'none'}); "
      f"`vllm serve` alone still up at the end: "
      f"{'yes' if out['serve_alive'] else 'no'}", "")
    return verdicts


def report_serving_summary(r: Report, verdicts: list[dict[str, Any]]) -> None:
    """The summary's rows: one per concurrency and engined path."""
    for v in verdicts:
        r(f"| serving (vLLM's benchmark) at {v['concurrency']} concurrent: "
          f"{TARGET_LABELS[v['target']]}, output throughput ≥ `vllm serve`'s and median TTFT "
          f"≤ | throughput {_ratio_text(v['throughput'])}, TTFT {_ratio_text(v['ttft'])} | "
          f"`vllm serve` alone | {v['verdict']} |")
