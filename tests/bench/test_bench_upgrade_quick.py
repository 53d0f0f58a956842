"""The upgrade benchmark runs once, in its quick mode, so that it cannot rot.

`python -m bench.upgrade --quick` in a subprocess (well under a minute here: one round of each
scenario, tiny-llama): it must exit 0 and write every table with every row, and nothing it started
may be left running. Nothing here asserts wall-clock speed (benchmarks report, tests don't time);
only what is not a timing: in place (A), the daemon keeps its pid, both engines keep their
processes and are adopted, no request fails and nothing is restarted; the old way (B), a new
daemon with new engines, none of the old daemon's left behind; after a crash (C), a new daemon
that adopted both engines, nothing restarted.
"""

from __future__ import annotations

import re
from pathlib import Path

import psutil
import pytest

from testkit.benchreport import run_quick, section, sections, tables

pytestmark = [pytest.mark.bench, pytest.mark.timeout(900)]
TIMEOUT_S = 600  # a bound, not a timing assertion: the quick run takes well under a minute

REQUEST_ROWS = ("requests in the window (trigger → load stopped)", "… answered ok",
                "… failed, all kinds", "… connection refused",
                "… connection reset or closed without an answer", "… HTTP error status",
                "… stream cut, timeout or other error", "failed before the trigger (warm-up)",
                "ok answers/s in the warm-up", "ok answers/s in the window")
STALL_ROWS = ("the gap (A: `handover_s`; B, C: the signal → first ok answer from the new "
              "daemon)",
              "trigger → event done (A: status shows the hand-over; B, C: new daemon, every "
              "engine READY)",
              "trigger → first ok answer (any request)",
              "trigger → first ok answer to a request sent after the trigger",
              "longest request overlapping the event", "longest time without an ok answer, window",
              "… the same in the warm-up (for scale)", "request time in the warm-up (median)")
FLEET_ROWS = ("daemon pid kept (1 = yes)", "engines kept (same pid and start time)",
              "fork servers kept (same pid)",
              "engine restarts the daemon counted in the round (B: a new daemon counts from 0)",
              "engines adopted (`adopted_at` set)",
              "POST /v1/upgrade → 202 (the new code's check)",
              "requests cut by the drain bound (`handover_cut`)",
              "`engined_handover_seconds` (/metrics)",
              "SIGTERM → old daemon exited (drain, engines stopped)",
              "engines of the old daemon alive after it exited",
              "engines' `startup_s` (spawn → READY, median of the replicas)",
              "old daemon gone → every engine READY under the new one",
              "new daemon start → every engine READY (`since`)")
# which scenarios (A, B, C) have each row that not all have
ONLY = {FLEET_ROWS[4]: "AC", FLEET_ROWS[5]: "A", FLEET_ROWS[6]: "A", FLEET_ROWS[7]: "A",
        FLEET_ROWS[8]: "B", FLEET_ROWS[9]: "B", FLEET_ROWS[10]: "B", FLEET_ROWS[11]: "C",
        FLEET_ROWS[12]: "B"}
RESTARTS = FLEET_ROWS[3]
A, B, C = 1, 3, 5  # a scenario's median column
SECONDS = re.compile(r"\d+\.\d{3} s")


def left_running(daemon_pids: set[int]) -> list[str]:
    """Live processes of the bench's daemons: a daemon itself, or anything carrying a daemon's
    mark in its environment (engines, fork servers, the guard)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            if proc.pid in daemon_pids and ("engined.supervisor.daemon" in cmdline
                                            or cmdline.startswith("engined: supervisor")):
                found.append(f"daemon {proc.pid}: {cmdline[:120]}")
                continue
            env = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        marks = (env.get("ENGINED_PARENT_PID", ""), env.get("ENGINED_OWNER", "").split("/")[0])
        if any(m.isdigit() and int(m) in daemon_pids for m in marks):
            found.append(f"{proc.pid} {cmdline[:120]}")
    return found


def test_upgrade_quick_produces_every_table(tmp_path: Path) -> None:
    out = tmp_path / "upgrade.md"
    text = run_quick("upgrade", out, TIMEOUT_S, printed=True)
    pids_line = re.search(r"^- daemon pids: (.*)$", text, re.M)
    assert pids_line, text[-500:]
    daemon_pids = {int(p) for p in re.findall(r"\b(\d+)\b", pids_line.group(1))}
    assert len(daemon_pids) == 3, pids_line.group(0)  # the first, B's and C's new daemons
    assert left_running(daemon_pids) == []
    check_report(text)


def by_label(body: str, labels: tuple[str, ...]) -> dict[str, list[str]]:
    """The section's one table, by row label: every label there, once, and nothing else;
    each row: label, then median and min–max for A, B and C, rounds."""
    (rows,) = tables(body)
    assert [row[0] for row in rows] == list(labels), rows
    for row in rows:
        assert len(row) == 8 and row[7] == "1/1/1", row  # one round of each
    return {row[0]: row for row in rows}


def check_report(text: str) -> None:
    secs = sections(text)
    requests = by_label(section(secs, "1. Requests through the gateway"), REQUEST_ROWS)
    stall = by_label(section(secs, "2. The gap"), STALL_ROWS)
    fleet = by_label(section(secs, "3. The engines and the daemon"), FLEET_ROWS)

    for row in requests.values():  # every request row measured for every scenario
        assert "–" not in (row[A], row[B], row[C]), row
    for row in stall.values():
        assert all(SECONDS.fullmatch(row[k]) for k in (A, B, C)), row
    for label, where in ONLY.items():
        for name, k in zip("ABC", (A, B, C)):
            assert (fleet[label][k] != "–") == (name in where), (name, fleet[label])

    # every scenario served requests in its window
    assert all(int(requests["… answered ok"][k]) > 0 for k in (A, B, C)), requests
    # A, in place: nothing failed, nothing refused, nothing cut, the same processes
    assert requests["… failed, all kinds"][1] == "0", requests["… failed, all kinds"]
    assert requests["… connection refused"][1] == "0", requests["… connection refused"]
    assert fleet["daemon pid kept (1 = yes)"][1] == "1", fleet
    assert fleet["engines kept (same pid and start time)"][1] == "2 of 2", fleet
    assert fleet[RESTARTS][1] == "0", fleet
    assert fleet["engines adopted (`adopted_at` set)"][1] == "2 of 2", fleet
    assert fleet["requests cut by the drain bound (`handover_cut`)"][1] == "0", fleet
    # B, the old way: a new daemon, new engines, none of the old daemon's left behind
    assert fleet["daemon pid kept (1 = yes)"][3] == "0", fleet
    assert fleet["engines kept (same pid and start time)"][3] == "0 of 2", fleet
    assert fleet["engines of the old daemon alive after it exited"][3] == "0", fleet
    # C, a crash: a new daemon that adopted both engines (what the dead gateway had in flight
    # is lost with it), nothing restarted
    assert fleet["daemon pid kept (1 = yes)"][C] == "0", fleet
    assert fleet["engines kept (same pid and start time)"][C] == "2 of 2", fleet
    assert fleet["engines adopted (`adopted_at` set)"][C] == "2 of 2", fleet
    assert fleet[RESTARTS][C] == "0", fleet
    # nothing failed before any trigger
    assert requests["failed before the trigger (warm-up)"][1:6:2] == ["0", "0", "0"], requests

    failures = section(secs, "4. Failed requests")
    assert re.search(r"^- A: upgrade in place, round 1: none$", failures, re.M), failures
    assert re.search(r"^- B: SIGTERM \+ new daemon, round 1: ", failures, re.M), failures
    assert re.search(r"^- C: SIGKILL \+ new daemon, round 1: ", failures, re.M), failures
    section(secs, "Method")
