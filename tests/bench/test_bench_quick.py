"""The peer comparison benchmark runs once, in its quick mode, so that it cannot rot.

`python -m bench.compare --quick` in a subprocess (about 2-3 minutes): it must exit 0 and write a
table for every scenario with every row. Nothing here asserts wall-clock speed (benchmarks report,
tests don't time). Under CI=true the peers must run (`--peers require`: their venvs are created
from PyPI on first use and cached under ~/.cache/engined-bench); elsewhere a peer whose venv
cannot be made (offline) is skipped, and the output must say so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.bench, pytest.mark.timeout(1200)]
TIMEOUT_S = 900  # a bound, not a timing assertion: the quick run takes ~2-3 min

ENGINED = "engined (echo engine)"
FLOORS = ("floor (sleeping child)", "floor (echo engine child)")
SUPERVISORD = ("supervisord (child output piped, its default)",
               "supervisord (echo engine child, output piped)",
               "supervisord (child stdio → /dev/null)")
CIRCUS = ("circus (default check_delay: 5 s)", "circus (check_delay = 0.1 s)")
TARGETS = ("respawn median < 5 ms", "respawn within 3× of the floor", "detection median < 2 ms",
           "detection no worse than supervisord", "echo kill → READY median < 100 ms",
           "idle CPU at 100 children", "idle RSS at 100 children < 80 MB",
           "`enginectl status` ≤ the better peer", "scrape median < 20 ms",
           "heartbeats flow during")


def sections(text: str) -> dict[str, str]:
    """Markdown split at `## `/`### ` headings: heading -> body."""
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def table_rows(body: str) -> list[str]:
    """First cells of the table rows (header and separator excluded)."""
    rows = [line for line in body.splitlines() if line.startswith("| ")]
    return [row.split("|")[1].strip() for row in rows[2:]]


def section(secs: dict[str, str], prefix: str) -> str:
    found = [body for heading, body in secs.items() if heading.startswith(prefix)]
    assert len(found) == 1, f"expected one section {prefix!r}, headings: {list(secs)}"
    return found[0]


def test_compare_quick_produces_every_table(tmp_path: Path) -> None:
    out = tmp_path / "compare.md"
    peers = "require" if os.environ.get("CI") else "auto"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ENGINED_") and k not in ("NOTIFY_SOCKET", "PYTHONPATH")}
    done = subprocess.run([sys.executable, "-m", "bench.compare", "--quick", "--peers", peers,
                           "--out", str(out)], cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    text = out.read_text()
    assert text in done.stdout.replace("\r", "")  # the same tables were printed

    peers_line = next(line for line in text.splitlines() if line.startswith("- peers:"))
    have_sv = "supervisord: SKIPPED" not in peers_line
    have_circus = "circus: SKIPPED" not in peers_line
    if peers == "require":
        assert have_sv and have_circus, peers_line
    else:  # a missing peer is said, never silently dropped
        assert ("supervisor==" in peers_line) == have_sv, peers_line
        assert ("circus==" in peers_line) == have_circus, peers_line
    peer_rows = (SUPERVISORD if have_sv else ()) + (CIRCUS if have_circus else ())

    secs = sections(text)
    for prefix in ("## 1. Respawn latency", "## 2. Detection latency"):
        rows = table_rows(section(secs, prefix))
        for label in (ENGINED, *FLOORS, *peer_rows):
            assert label in rows, f"{prefix}: no row {label!r} in {rows}"
    ready = table_rows(section(secs, "### Kill → READY"))
    assert any(r.startswith("engined: SIGKILL → READY") for r in ready), ready

    idle = table_rows(section(secs, "## 3. Idle overhead"))
    assert any(r.startswith("engined (100 echo engines") for r in idle), idle
    assert "floor (sleeping child)" in idle, idle
    if have_sv:
        assert any(r.startswith("supervisord") for r in idle), idle
    if have_circus:
        assert sum(r.startswith("circus") for r in idle) == 2, idle

    ctl = table_rows(section(secs, "## 4. Control latency"))
    assert "enginectl" in ctl, ctl
    if have_sv:
        assert "supervisorctl" in ctl, ctl
    if have_circus:
        assert sum(r.startswith("circusctl") for r in ctl) == 2, ctl

    llm = table_rows(section(secs, "## 5. Crash → READY"))
    assert any(r.startswith("engined: SIGKILL → READY") for r in llm), llm
    assert any(r.startswith("cold `python -c`") for r in llm), llm

    scrape = table_rows(section(secs, "## 6. Scrape"))
    assert len(scrape) == 2, scrape

    summary = section(secs, "## Summary of the targets")
    targets = table_rows(summary)
    for target in TARGETS:
        assert any(t.startswith(target) for t in targets), f"no target row {target!r}: {targets}"
    results = [row.rsplit("|", 2)[-2].strip() for row in summary.splitlines()
               if row.startswith("| ")][2:]
    assert all(r == "PASS" or r.startswith("MISS") or r == "n/a" for r in results), results
    if have_sv and have_circus:
        assert "n/a" not in results, results
