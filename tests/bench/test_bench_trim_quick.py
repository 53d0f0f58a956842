"""The trim benchmark runs once, in its quick mode, so that it cannot rot: `python -m bench.trim
--quick` must exit 0, write its table with every row filled for both engines, and leave nothing
running. Sizes are reported, not asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.benchreport import run_quick, tables

pytestmark = [pytest.mark.bench, pytest.mark.timeout(900)]
ROWS = ("once loaded", "after the first burst", "after the last burst", "largest after a burst")


def test_trim_quick_produces_its_table(tmp_path: Path) -> None:
    out = tmp_path / "trim.md"
    text = run_quick("trim", out, 600)
    (rows,) = tables(text)
    assert [row[0] for row in rows] == list(ROWS), rows
    for row in rows:
        assert len(row) == 4 and all(cell.endswith("MiB") for cell in row[1:]), row
