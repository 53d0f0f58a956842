"""The hostile-clients benchmark runs once, in its quick mode, so that it cannot rot, and as the
stress test the issue asks for: `python -m bench.clients --quick` must exit 0 (it fails when
the engines' requests do not all go back to 0 after a phase, e.g. streams whose clients hung up
and were not aborted), every stream must complete or be hung up, the good client must be
answered under the slow flood, and nothing may be left running. Times are reported, not
asserted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from testkit.benchreport import run_quick, tables

pytestmark = [pytest.mark.bench, pytest.mark.timeout(900)]


def test_clients_quick_holds_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "clients.md"
    text = run_quick("clients", out, 800)
    assert "restarts during the run: 0" in text, text
    (rows,) = tables(text)
    assert [row[0] for row in rows] == ["slow flood", "streams", "disconnects"], rows
    flood, streams, drops = (row[1] for row in rows)
    answered = int(re.search(r"good client: (\d+) answered", flood).group(1))
    assert answered >= 1, flood
    assert re.search(r"1000 streams: 1000 completed, 0 failed", streams), streams
    assert re.search(r"300 streams: 300 hung up after their first token, 0 failed", drops), drops
