"""The trim benchmark runs once, in its quick mode, so that it cannot rot: `python -m bench.trim
--quick` must exit 0, write its table with every row filled for both engines, and leave nothing
running. Sizes are reported, not asserted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchreport import tables

REPO_ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.bench, pytest.mark.timeout(900)]
ROWS = ("once loaded", "after the first burst", "after the last burst", "largest after a burst")


def test_trim_quick_produces_its_table(tmp_path: Path) -> None:
    out = tmp_path / "trim.md"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ENGINED_") and k not in ("NOTIFY_SOCKET", "PYTHONPATH")}
    done = subprocess.run([sys.executable, "-m", "bench.trim", "--quick", "--out", str(out)],
                          cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    text = out.read_text()
    assert "processes left over and killed by pid: none" in text, text[-500:]
    (rows,) = tables(text)
    assert [row[0] for row in rows] == list(ROWS), rows
    for row in rows:
        assert len(row) == 4 and all(cell.endswith("MiB") for cell in row[1:]), row
