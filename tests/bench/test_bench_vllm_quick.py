"""The vLLM benchmark runs once, in its quick mode, so that it cannot rot.

`python -m bench.vllm --quick --only backend,serving` in a subprocess (sections 1-3 and 5, the
heavier model left to the full run): it must exit 0 and write every table with every row.
Nothing here asserts wall-clock speed (benchmarks report, tests don't time), nor whether a target
passed: only that each verdict is PASS or MISS.

It needs the vLLM venv, found as the vLLM tier finds it (tests/vllm/conftest.py):
ENGINED_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python. Without it the test skips, except under
CI=true, where it fails.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import pytest

from testkit.benchreport import run_quick_vllm_bench, section, sections, tables
from testkit.driver import vllm_python_or_skip
from testkit.servingcheck import check_serving

pytestmark = [pytest.mark.bench, pytest.mark.vllm, pytest.mark.timeout(1600)]
TIMEOUT_S = 1500  # a bound, not a timing assertion: the quick run takes ~10 min idle, twice
# that on a slow day of a 2-core box (stop 40: 1100 s was not enough)

PATHS = ("direct `LLMEngine` (add_request + step, one process)",
         "floor: the same `LLMEngine` behind a minimal HTTP server in its process",
         "engined: control socket `POST /v1/generate`",
         "engined: gateway `POST /v1/completions`",
         "peer: `vllm serve` `POST /v1/completions`")
CRASH_ROWS = ("engined: SIGKILL → READY (daemon's `since`)",
              "engined: SIGKILL → READY seen by a 20 ms status poll",
              "… of which SIGKILL → exit recorded (`last_exit.at`)",
              "… of which spawn → READY (`startup_s`)",
              "… of which the child's import → warm-up (its `[ready]` line)",
              "`vllm serve` cold start: spawn → `/health` 200",
              "`vllm serve` cold start: spawn → first completion",
              "`vllm serve`: SIGKILL of its EngineCore → `/health` stops answering 200",
              "`vllm serve`: SIGKILL of its EngineCore → the API server has exited")
FREEZE_ROWS = ("engined: SIGSTOP → its `/health` stops answering 200",
               "engined: SIGSTOP → killed as hung, exit recorded (`last_exit.at`)",
               "engined: SIGSTOP → READY again (`since`)",
               "engined: SIGSTOP → the in-flight gateway request finished")
# the verdict table's paths (all but direct); engined's own begin with one of ENGINED
VERDICT_PATHS = ("floor:", "control socket", "gateway", "peer: `vllm serve`")
ENGINED = ("control socket", "gateway")
SERVE_FREEZE_ROWS = ("`/health` stops answering 200", "`/health` polls answered 200",
                     "tokens of the in-flight completion received in the window",
                     "after SIGCONT")


@pytest.fixture(scope="module")
def vllm_python() -> str:
    return vllm_python_or_skip("the vLLM benchmark")


def has_row(rows: list[list[str]], prefix: str) -> bool:
    return any(row[0].startswith(prefix) for row in rows)


def is_pct(cell: str) -> bool:
    return re.fullmatch(r"[+-]\d+\.\d %", cell) is not None


def check_floor_column(rows: list[list[str]], engined: Callable[[list[str]], bool]) -> None:
    """The column before the verdict: engined's paths against the floor, in %; else "–"."""
    for row in rows:
        assert is_pct(row[-2]) if engined(row) else row[-2] == "–", row


def test_vllm_quick_produces_every_table(tmp_path: Path, vllm_python: str) -> None:
    # sections 1-3 and 5; section 4 (`vllm serve` under engined, 7 cold starts) is the full
    # run's: its kills and freezes are the vLLM tier's tests (tests/vllm/test_vllm_serve.py)
    text = run_quick_vllm_bench(tmp_path / "vllm.md", vllm_python, TIMEOUT_S,
                                "--only", "backend,serving")
    check_report(text)
    check_serving(text)  # section 5, vLLM's serving benchmark (testkit/servingcheck.py)


def check_report(text: str) -> None:
    secs = sections(text)
    serving, verdicts, costs = tables(section(secs, "1. Serving overhead"))
    for c in ("1", "8"):
        for m in ("16", "64"):
            for path in PATHS:
                assert any(row[:3] == [c, m, path] for row in serving), (c, m, path, serving)
            for path in VERDICT_PATHS:
                assert any(row[:2] == [c, m] and row[2].startswith(path) for row in verdicts), \
                    (c, m, path, verdicts)
        for path in VERDICT_PATHS:
            assert any(row[0].startswith(path) and row[1] == c for row in costs), (c, path)
    engined = [row for row in verdicts if row[2].startswith(ENGINED)]
    assert {row[-1] for row in engined if row[0] == "8"} <= {"PASS", "MISS"}, verdicts
    assert all(row[-1] == "–" for row in verdicts
               if row[0] == "1" or not row[2].startswith(ENGINED)), verdicts
    check_floor_column(verdicts, lambda row: row[2].startswith(ENGINED))

    # the heavier model (sections 1c and 1d) is the full run's: a quick run skips it
    assert not any(name.startswith(("1c.", "1d.")) for name in secs), list(secs)
    for name in ("1b. Sustained load",):
        (sustained,) = tables(section(secs, name))
        for c in ("1", "8"):
            for m in ("16", "64"):
                for path in PATHS:
                    assert any(row[:3] == [c, m, path] for row in sustained), \
                        (name, c, m, path, sustained)
        assert {row[-1] for row in sustained if row[0] == "8" and row[2].startswith("engined")} \
            <= {"PASS", "MISS"}, sustained
        assert all(row[-1] == "–" for row in sustained
                   if row[0] == "1" or not row[2].startswith("engined")), sustained
        check_floor_column(sustained, lambda row: row[2].startswith("engined"))

    (crash,) = tables(section(secs, "2. Crash → READY"))
    for label in CRASH_ROWS:
        assert has_row(crash, label), f"no row {label!r}: {crash}"
    # engined's rows and the cold starts always have samples (the others say "–" if, e.g., vLLM
    # did not exit within the bench's bound)
    assert all(row[-1] != "0" for row in crash
               if row[0].startswith(("engined", "…", "`vllm serve` cold start"))), crash

    freeze, serve_freeze = tables(section(secs, "3. A frozen engine core"))
    for label in FREEZE_ROWS:
        assert has_row(freeze, label), f"no row {label!r}: {freeze}"
    assert all(row[-1] != "0" for row in freeze[:3]), freeze
    for label in SERVE_FREEZE_ROWS:
        assert has_row(serve_freeze, label), f"no row {label!r}: {serve_freeze}"

    (summary,) = tables(section(secs, "Summary"))
    # the overhead rows: tiny-llama's, 2 max_tokens × 2 engined paths
    for kind, n in (("throughput at 8 concurrent (sustained)", 4), ("overhead at 8 concurrent", 4)):
        rows = [row for row in summary if row[0].startswith(kind)]
        assert len(rows) == n, (kind, summary)
        assert all(row[-1] == "PASS" or row[-1].startswith("MISS") for row in rows), summary
    # engined against the floor, report only: sustained and bursts, 2 max_tokens × 2 paths
    for kind in ("engined's own cost: throughput at 8 concurrent (sustained) vs the floor's",
                 "engined's own cost: bursts at 8 concurrent"):
        rows = [row for row in summary if row[0].startswith(kind)]
        assert len(rows) == 4 and all(is_pct(row[1]) and row[-1] == "report only"
                                      for row in rows), (kind, summary)
    assert has_row(summary, "crash → READY vs `vllm serve` cold start"), summary
    assert has_row(summary, "frozen core (SIGSTOP) detected"), summary
