"""What the vLLM benchmark's serving section (section 2: vLLM's own serving benchmark through the
gateway and against `vllm serve`) must hold in its quick mode, checked on the report of its
quick run (tests/bench/test_bench_vllm_quick.py): a row for every target at every
concurrency, every request completed and none failed, every figure a number, and a verdict for
each engined path. Nothing here asserts speed (benchmarks report, tests don't time), nor whether
the target was met."""

from __future__ import annotations

import re

from testkit.benchreport import section, sections, tables

TARGETS = ("`vllm serve` alone", "engined gateway → `backend: vllm`",
           "engined gateway → `vllm serve` (command engine)")
ENGINED = TARGETS[1:]
PROMPTS = {"8": 8, "32": 16}  # bench.vllm.serving.QUICK
LENGTH = "32"


def is_number(cell: str) -> bool:
    return re.fullmatch(r"\d+(\.\d+)?", cell) is not None


def check_serving(text: str) -> None:
    secs = sections(text)
    body = section(secs, "2. Serving")
    figures, runs = tables(body)
    assert len(figures) == len(TARGETS) * len(PROMPTS), figures
    for c, n in PROMPTS.items():
        for target in TARGETS:
            (row,) = [row for row in figures if row[:2] == [target, c]]
            assert row[2] == f"{n} / 0", row  # every request completed, none failed
            assert all(is_number(cell) for cell in row[3:9]), row
            assert row[9] == LENGTH, row  # --ignore-eos: exactly that many tokens each
    # every run once, in a rotating order, each with its numbers
    assert len(runs) == len(figures), runs
    assert sorted((row[2], row[3]) for row in runs) == sorted((c, t) for c in PROMPTS
                                                              for t in TARGETS), runs
    assert all(all(is_number(cell) for cell in row[4:]) for row in runs), runs
    assert [row[3] for row in runs if row[2] == "8"][0] == TARGETS[0], runs  # round 0, k 0
    assert [row[3] for row in runs if row[2] == "32"][0] == TARGETS[1], runs  # round 0, k 1
    # one comparison line per concurrency and engined path, with both ratios and a verdict
    for c in PROMPTS:
        for target in ENGINED:
            line = next((x for x in body.splitlines()
                         if x.startswith(f"- at {c} concurrent, {target} against")), None)
            assert line is not None, (c, target, body)
            assert re.search(r"output throughput \d+\.\d+×, median TTFT \d+\.\d+×", line), line
            assert line.endswith(("PASS", ")")) and ("PASS" in line or "MISS (" in line), line
    # the texts compared with `vllm serve`'s, request by request (not asserted equal)
    for target in ENGINED:
        assert re.search(rf"- greedy outputs of {re.escape(target)} identical to `vllm serve`'s "
                         rf"\(same round, same prompt\): \d+ of {sum(PROMPTS.values())} "
                         rf"requests", body), (target, body)
    # (engined's canary may have restarted the command engine before: the report says why)
    assert "restarts under engined during them: none" in body, body[-1500:]

    (summary,) = tables(section(secs, "Summary"))
    rows = [row for row in summary if row[0].startswith("serving (vLLM's benchmark)")]
    assert len(rows) == len(PROMPTS) * len(ENGINED), summary
    assert all(row[-1] == "PASS" or row[-1].startswith("MISS (") for row in rows), rows
