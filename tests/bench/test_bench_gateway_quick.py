"""The gateway benchmark's smallest run (`python -m bench.gateway --quick`), so that it cannot
rot: it must exit 0, print and write every table with every row, and leave nothing running.
Nothing here asserts speed; only the counts that are not timings: every path answered every
request with the same number of tokens, no request is lost through the gateway when an engine is
killed, while the control socket (no failover) loses what was in flight on the victim.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from testkit.benchreport import run_quick, section, sections, tables

pytestmark = [pytest.mark.bench, pytest.mark.timeout(900)]

PATHS = ("direct: engine protocol over ZeroMQ (baseline)",
         "direct: engine protocol over ZeroMQ, streamed (baseline)",
         "gateway `/v1/completions` (aiohttp)",
         "gateway `/v1/completions`, streamed SSE (aiohttp)")


def test_gateway_quick(tmp_path: Path) -> None:
    text = run_quick("gateway", tmp_path / "gateway.md", 600, printed=True)
    secs = sections(text)
    for model, table in zip(("tiny", "echo"), tables(section(secs, "1. Overhead"))):
        for concurrency in ("1", "8"):
            got = [row[1] for row in table if row[0] == concurrency]
            assert sorted(got) == sorted(PATHS), (model, concurrency, got)
        for row in table:
            assert re.fullmatch(r"\d+(\.\d+)? ms", row[3]), row  # latency p50
            assert re.fullmatch(r"[\d.]+ / [\d.]+ / [\d.]+ ms", row[7]), row  # on-CPU
            # echo's answer is its prompt's first 64 characters on every path
            assert row[8] == "64" if model == "echo" else row[8].isdigit(), row
    (kills,) = tables(section(secs, "2. Requests lost per engine kill"))
    assert [row[0] for row in kills] == ["1", "2", "all 2"], kills
    in_flight_gw, lost_gw, moved, in_flight_ctl, lost_ctl = map(int, kills[-1][2:])
    assert in_flight_gw > 0 and in_flight_ctl > 0, kills  # the kills landed on busy replicas
    assert lost_gw == 0 and moved > 0, kills  # the gateway moved every request of the victim
    assert lost_ctl > 0, kills  # no failover: what was on the victim is gone
    (summary,) = tables(section(secs, "Summary of the targets"))
    assert len(summary) == 4, summary
    assert all(row[2] in ("PASS", "report only") or row[2].startswith("MISS")
               for row in summary), summary
