"""The recovery benchmark's smallest run (`python -m bench.recovery --quick`: tiny-llama only, the
vLLM backend is the full run's), so that it cannot rot: it must exit 0, print and write every
table with every row, and leave nothing running. Nothing here asserts speed; only what is not a
timing: every kill was followed by a restart through the launcher under test, every promotion took
the standby's engine over, and of the daemon replacements: in place (A) the daemon keeps its pid,
both engines are kept and adopted and no request fails; the old way (B) brings new engines; after
a crash (C) the new daemon adopts both engines; nothing is restarted. On demand: echo and
tiny-llama each woke 3 times (the vLLM kinds are the full run's); under the swap no request
failed, the resident fleet never woke a model and the budgeted one did.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.benchreport import run_quick, section, sections, tables

pytestmark = [pytest.mark.bench, pytest.mark.timeout(900)]

TINY = "tiny-llama (transformers)"


def test_recovery_quick(tmp_path: Path) -> None:
    text = run_quick("recovery", tmp_path / "recovery.md", 600, printed=True)
    secs = sections(text)
    (crash,) = tables(section(secs, "1. Crash → READY"))
    assert [row[-1] for row in crash if row[0] == TINY] == ["2/2"] * 6, crash
    (launchers,) = [row for row in crash if row[1] == "launcher of the new incarnations"]
    assert launchers[2] == "exec ×2" and launchers[4] == "forkserver ×2", launchers
    (memory,) = tables(section(secs, "2. Memory"))
    assert len([row for row in memory if row[0] == TINY]) == 5, memory
    (standby,) = tables(section(secs, "3. Warm standby promotion"))
    assert [row[-1] for row in standby] == ["2", "2", "2", "2", "3", "2"], standby
    assert standby[-1][2] == "2 of 2", standby  # the standby's engine took over each time

    (upgrade,) = tables(section(secs, "4. Upgrade in place"))
    row = {r[0]: r[1:] for r in upgrade}
    pid = row["daemon pid kept (1 = yes)"]
    assert (pid[0], pid[2], pid[4]) == ("1", "0", "0"), pid
    kept = row["engines kept (same pid and start time)"]
    assert (kept[0], kept[2], kept[4]) == ("2 of 2", "0 of 2", "2 of 2"), kept
    adopted = row["engines adopted (`adopted_at` set)"]
    assert (adopted[0], adopted[4]) == ("2 of 2", "2 of 2"), adopted
    assert row["… failed, all kinds"][0] == "0", row  # in place: no request fails
    restarts = row["engine restarts counted in the round (B: a new daemon counts from 0)"]
    assert (restarts[0], restarts[2], restarts[4]) == ("0", "0", "0"), restarts
    assert int(row["… answered ok"][2]) > 0 and int(row["… answered ok"][4]) > 0, row

    (wake,) = tables(section(secs, "5. On demand: a wake"))
    assert [(row[0], row[-1]) for row in wake] == [
        ("builtin:echo (fork server)", "3"), ("builtin:tiny-llama (fork server)", "3"),
        ("vLLM kinds", "0")], wake
    (swap,) = tables(section(secs, "6. On demand: a swap under load"))
    row = {r[0]: r[1:] for r in swap}
    assert row["requests failed"][:2] == ["0", "0"], swap  # no request fails for a sleeping model
    assert row["requests answered ok"][:2] == ["32", "32"], swap
    wakes = row["wakes during the mix (a swap once 2 are awake)"]
    assert wakes[0] == "0" and int(wakes[1]) > 0, swap

    (summary,) = tables(section(secs, "Summary"))
    verdicts = [r[-1] for r in summary if "crash → READY" in r[0] or "standby" in r[0]]
    assert len(verdicts) == 2 and all(v.startswith(("PASS", "MISS")) for v in verdicts), summary
    assert any(r[0] == "vLLM backend" and r[-1].startswith("skipped") for r in summary), summary
