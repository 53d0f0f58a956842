"""The busy-host recovery benchmark runs once, in its quick mode, so that it cannot rot:
`python -m bench.hostload --quick` must exit 0, write its table with every row filled, and leave
nothing running (its unrelated processes included). Times are reported, not asserted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchreport import tables

REPO_ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.bench, pytest.mark.timeout(900)]


def test_hostload_quick_produces_its_table(tmp_path: Path) -> None:
    out = tmp_path / "hostload.md"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ENGINED_") and k not in ("NOTIFY_SOCKET", "PYTHONPATH")}
    done = subprocess.run([sys.executable, "-m", "bench.hostload", "--quick", "--out", str(out)],
                          cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    text = out.read_text()
    assert "processes left over and killed by pid: none" in text, text[-500:]
    (rows,) = tables(text)
    assert [row[:2] for row in rows] == [
        ["ex (exec)", "SIGKILL → READY"], ["ex (exec)", "spawn → READY (`startup_s`)"],
        ["fk (forkserver)", "SIGKILL → READY"], ["fk (forkserver)", "spawn → READY (`startup_s`)"]]
    for row in rows:
        assert len(row) == 6 and all(cell.endswith(" ms") for cell in row[2:5]), row
