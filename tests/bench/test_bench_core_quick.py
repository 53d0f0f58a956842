"""The supervision-core benchmark's smallest run (`python -m bench.core --quick`), so that it cannot
rot: it must exit 0, print and write every table with every supervisor's row, a verdict for every
target, and leave nothing running. Nothing here asserts speed. Under CI=true the peers must run
(`--require-peers`: their venvs are made from PyPI once and cached); elsewhere a peer whose venv
cannot be made is skipped, and the report must say so.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from testkit.benchreport import run_quick, section, sections, tables

pytestmark = [pytest.mark.bench, pytest.mark.timeout(900)]

ENGINED_ROWS = ("engined (echo engine)", "floor (sleeping child)", "floor (echo engine child)")
SV_ROWS = ("supervisord (sleeping child, output piped)",
           "supervisord (echo engine child, output piped)")
CIRCUS_ROWS = ("circus (default check_delay: 5 s)", "circus (check_delay = 0.1 s)")
TARGETS = ("respawn median < 5 ms", "respawn within 3× of the floor", "detection median < 2 ms",
           "detection no worse than supervisord's", "echo kill → READY median < 100 ms",
           "idle CPU at 20 children", "idle RSS at 20 children", "`enginectl status` ≤")


def test_core_quick(tmp_path: Path) -> None:
    require = ("--require-peers",) if os.environ.get("CI") else ()
    text = run_quick("core", tmp_path / "core.md", 600, *require, printed=True)
    peers_line = next(line for line in text.splitlines() if line.startswith("- peers:"))
    have_sv, have_circus = "supervisord: SKIPPED" not in peers_line, \
        "circus: SKIPPED" not in peers_line
    rows = ENGINED_ROWS + (SV_ROWS if have_sv else ()) + (CIRCUS_ROWS if have_circus else ())
    secs = sections(text)
    for name, n in (("1. Respawn latency", 3), ("2. Detection latency", 4)):
        (kills,) = tables(section(secs, name))
        assert [row[0] for row in kills] == list(rows), kills
        assert all(row[n] == "3" for row in kills), kills  # every kill was seen
    (ready,) = tables(section(secs, "3. Kill → READY"))
    assert [row[-1] for row in ready] == ["3", "3"], ready
    (idle,) = tables(section(secs, "4. Idle overhead"))
    assert [row[1] for row in idle] == ["20"] * len(idle), idle  # every child up
    assert len(idle) == 2 + have_sv + 2 * have_circus, idle
    (ctl,) = tables(section(secs, "5. Control latency"))
    assert all(row[-1] == "0" for row in ctl), ctl  # every status call succeeded
    assert len(ctl) == 1 + have_sv + 2 * have_circus, ctl
    (summary,) = tables(section(secs, "Summary of the targets"))
    for target in TARGETS:
        assert any(row[0].startswith(target) for row in summary), (target, summary)
    assert all(row[-1] in ("PASS", "MISS") or (row[-1] == "n/a" and not (have_sv and have_circus))
               for row in summary), summary
