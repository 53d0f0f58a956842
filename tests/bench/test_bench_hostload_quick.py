"""The busy-host recovery benchmark runs once, in its quick mode, so that it cannot rot:
`python -m bench.hostload --quick` must exit 0, write its table with every row filled, and leave
nothing running (its unrelated processes included). Times are reported, not asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.benchreport import run_quick, tables

pytestmark = [pytest.mark.bench, pytest.mark.timeout(900)]


def test_hostload_quick_produces_its_table(tmp_path: Path) -> None:
    out = tmp_path / "hostload.md"
    text = run_quick("hostload", out, 600)
    (rows,) = tables(text)
    assert [row[:2] for row in rows] == [
        ["ex (exec)", "SIGKILL → READY"], ["ex (exec)", "spawn → READY (`startup_s`)"],
        ["fk (forkserver)", "SIGKILL → READY"], ["fk (forkserver)", "spawn → READY (`startup_s`)"]]
    for row in rows:
        assert len(row) == 6 and all(cell.endswith(" ms") for cell in row[2:5]), row
