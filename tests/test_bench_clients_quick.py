"""The hostile-clients benchmark runs once, in its quick mode, so that it cannot rot, and as the
stress test the issue asks for: `python -m bench.clients --quick` must exit 0 (it fails when
the engines' requests do not all go back to 0 after a phase, e.g. streams whose clients hung up
and were not aborted), every stream must complete or be hung up, the good client must be
answered under the slow flood, and nothing may be left running. Times are reported, not
asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from benchreport import tables

REPO_ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.bench, pytest.mark.timeout(900)]


def test_clients_quick_holds_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "clients.md"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ENGINED_") and k not in ("NOTIFY_SOCKET", "PYTHONPATH")}
    done = subprocess.run([sys.executable, "-m", "bench.clients", "--quick", "--out", str(out)],
                          cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=800)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    text = out.read_text()
    assert "processes left over and killed by pid: none" in text, text[-500:]
    assert "restarts during the run: 0" in text, text
    (rows,) = tables(text)
    assert [row[0] for row in rows] == ["slow flood", "streams", "disconnects"], rows
    flood, streams, drops = (row[1] for row in rows)
    answered = int(re.search(r"good client: (\d+) answered", flood).group(1))
    assert answered >= 1, flood
    assert re.search(r"1000 streams: 1000 completed, 0 failed", streams), streams
    assert re.search(r"300 streams: 300 hung up after their first token, 0 failed", drops), drops
