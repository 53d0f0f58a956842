"""The vLLM benchmark's smallest run (`python -m bench.vllm --quick`), so that it cannot rot: it
must exit 0, print and write every table with every row, and leave nothing running. Nothing here
asserts speed, nor whether a target passed: only that each verdict is PASS or MISS, and what is
not a timing: every request answered with max_tokens tokens on both paths of section 1, and the
checks of section 2 (testkit/servingcheck.py).

It needs the vLLM venv, found as the vLLM tier finds it (ENGINED_VLLM_PYTHON, else
<repo>/.venv-vllm/bin/python). Without it the test skips, except under CI=true, where it fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.benchreport import run_quick_vllm_bench, section, sections, tables
from testkit.driver import vllm_python_or_skip
from testkit.servingcheck import check_serving

pytestmark = [pytest.mark.bench, pytest.mark.vllm, pytest.mark.timeout(900)]

PATHS = ("direct `LLMEngine` (add_request + step, one process)",
         "engined: gateway `POST /v1/completions`")


def test_vllm_quick(tmp_path: Path) -> None:
    python = vllm_python_or_skip("the vLLM benchmark")
    text = run_quick_vllm_bench(tmp_path / "vllm.md", python, 600)
    (direct,) = tables(section(sections(text), "1. Sustained load"))
    assert [(row[0], row[1]) for row in direct] == [(c, p) for c in ("1", "8") for p in PATHS]
    assert [row[7] for row in direct] == ["64"] * 4, direct  # every request made max_tokens
    assert [row[8] for row in direct] == ["4", "4", "16", "16"], direct  # and was answered
    assert direct[-1][-1] == "PASS" or direct[-1][-1].startswith("MISS"), direct
    check_serving(text)
    (summary,) = tables(section(sections(text), "Summary"))
    assert summary[0][0].startswith("throughput at 8 concurrent (sustained)"), summary
    assert summary[0][-1] == "PASS" or summary[0][-1].startswith("MISS"), summary
