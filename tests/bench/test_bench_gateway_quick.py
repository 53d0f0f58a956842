"""The gateway benchmark runs once, in its quick mode, so that it cannot rot.

`python -m bench.gateway --quick` in a subprocess (about 1.5 minutes): it must exit 0 and write
every table with every row. Nothing here asserts wall-clock speed (benchmarks report, tests don't
time): only that each measurement is there, and the one count that is not a timing: no request
is lost through the gateway when an engine is killed, while the control socket (no failover)
loses what was in flight on the victim.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from testkit.benchreport import run_quick

pytestmark = [pytest.mark.bench, pytest.mark.timeout(900)]
TIMEOUT_S = 600  # a bound, not a timing assertion: the quick run takes ~1.5 min

PATHS = ("direct: engine protocol over ZeroMQ (baseline)",
         "direct: engine protocol over ZeroMQ, streamed (baseline)",
         "control socket `POST /v1/generate`",
         "control socket `POST /v1/generate`, streamed (NDJSON)",
         "gateway `/v1/completions` (aiohttp)",
         "gateway `/v1/completions`, streamed SSE (aiohttp)",
         "gateway via the `openai` client",
         "gateway via the `openai` client, streamed")
STREAMED = tuple(p for p in PATHS if "stream" in p)


def sections(text: str) -> dict[str, str]:
    """Markdown split at `## `/`### ` headings: heading -> body."""
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def section(secs: dict[str, str], prefix: str) -> str:
    found = [body for heading, body in secs.items() if heading.startswith(prefix)]
    assert len(found) == 1, f"expected one section {prefix!r}, headings: {list(secs)}"
    return found[0]


def rows(body: str) -> list[list[str]]:
    """The cells of each table row (header and separator excluded)."""
    lines = [line for line in body.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines[2:]]


def test_gateway_quick_produces_every_table(tmp_path: Path) -> None:
    out = tmp_path / "gateway.md"
    text = run_quick("gateway", out, TIMEOUT_S, printed=True, leftovers=False)
    secs = sections(text)

    section(secs, "## 1. Overhead vs talking to the engine directly")
    for model in ("tiny-llama", "echo"):
        table = rows(section(secs, f"### {model} "))
        for concurrency in ("1", "8"):
            got = [row[1] for row in table if row[0] == concurrency]
            assert sorted(got) == sorted(PATHS), (model, concurrency, got)
        for row in table:
            assert re.fullmatch(r"\d+(\.\d+)? ms", row[3]), row  # latency p50
            if "(baseline)" not in row[1]:
                assert row[5].endswith("%") and row[6].endswith("%"), row  # overhead vs direct
            assert re.fullmatch(r"[\d.]+ / [\d.]+ / [\d.]+ ms", row[8]), row  # on-CPU
            # tokens/request: echo's answer is its prompt's first 64 characters on every path
            assert row[9] == "64" if model == "echo" else row[9].isdigit(), row

    ttft = rows(section(secs, "## 2. Time to first token"))
    for model in ("tiny", "echo"):
        for concurrency in ("1", "8"):
            got = [row[2] for row in ttft if row[:2] == [model, concurrency]]
            assert sorted(got) == sorted(STREAMED), (model, concurrency, got)
    assert all(row[3].endswith(" ms") for row in ttft), ttft

    kills = rows(section(secs, "## 3. Requests lost per engine kill"))
    assert [row[0] for row in kills] == ["1", "2", "all 2"], kills
    total = kills[-1]
    in_flight_gw, lost_gw, moved, in_flight_ctl, lost_ctl = map(int, total[2:])
    assert in_flight_gw > 0 and in_flight_ctl > 0, total  # the kills landed on busy replicas
    assert lost_gw == 0, total  # the gateway moved every request of the victim
    assert moved > 0, total
    assert lost_ctl > 0, total  # no failover: what was on the victim is gone

    lag = rows(section(secs, "## 4. Daemon event-loop lag"))
    assert [row[0] for row in lag] == ["idle", "16 SSE streams", "64 SSE streams"], lag
    for row in lag:
        assert re.fullmatch(r"\d+ \(\d+\)", row[1]), row  # ticks (expected)
        assert re.fullmatch(r"\d+\.\d{3}", row[6]), row  # stalled seconds
    assert all(int(row[8]) > 0 for row in lag[1:]), lag  # streams completed under load
    assert all(row[9] == "0" for row in lag), lag  # no stream failed

    summary = rows(section(secs, "## Summary of the targets"))
    assert len(summary) == 5, summary
    assert all(row[2] in ("PASS", "report only") or row[2].startswith("MISS")
               for row in summary), summary
    assert "openai client vs plain aiohttp" in section(secs, "## Summary of the targets")
    section(secs, "## Method")
