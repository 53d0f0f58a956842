"""The fast-recovery benchmark runs once, in its quick mode, so that it cannot rot.

`python -m bench.recovery --quick` in a subprocess (about 1 minute with tiny-llama alone, 2-3
with the vLLM backend): it must exit 0 and write every table with every row, and nothing it
started may be left running. Nothing here asserts wall-clock speed (benchmarks report, tests
don't time), nor whether a target passed: only that each verdict is PASS, MISS or says why it
was not measured.

The vLLM part runs where the benchmark finds a vLLM interpreter (ENGINED_VLLM_PYTHON, passed on
as --vllm-python, else its own defaults); without one the report must say it was skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from testkit.benchreport import section, sections, tables

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.bench, pytest.mark.timeout(1200)]
TIMEOUT_S = 900  # a bound, not a timing assertion

TINY = "tiny-llama (transformers)"
VLLM = "vLLM backend (`backend: vllm`)"
CRASH_ROWS = ("SIGKILL → READY (daemon's `since`)",
              "SIGKILL → READY seen by a 20 ms status poll",
              "SIGKILL → first token served",
              "… of which SIGKILL → exit recorded",
              "… of which spawn → READY (`startup_s`)",
              "… of which the child's build → warm-up",
              "launcher of the new incarnations")
MEMORY_TOTALS = ("RSS per engine", "USS per engine", "PSS per engine", "PSS of the fleet",
                 "USS of the fleet")
STARTUP_ROWS = ("daemon start → both replicas READY", "first start of", "restart after a kill",
                "launcher at first start", "fork server (")


def rows_of(rows: list[list[str]], backend: str, prefix: str) -> list[list[str]]:
    return [row for row in rows if row[0] == backend and row[1].startswith(prefix)]


def left_running(daemon_pids: set[int]) -> list[str]:
    """Live processes that belong to one of the bench's daemons: the daemons themselves, or
    anything carrying their mark (engines, fork servers, guards)."""
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


def test_recovery_quick_produces_every_table(tmp_path: Path) -> None:
    out = tmp_path / "recovery.md"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ENGINED_") and k not in ("NOTIFY_SOCKET", "PYTHONPATH")}
    argv = [sys.executable, "-m", "bench.recovery", "--quick", "--out", str(out)]
    if os.environ.get("ENGINED_VLLM_PYTHON"):
        argv += ["--vllm-python", os.environ["ENGINED_VLLM_PYTHON"]]
    done = subprocess.run(argv, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    text = out.read_text()
    assert text in done.stdout.replace("\r", "")  # the same tables were printed
    assert "processes left over and killed by pid: none" in text, text[-500:]
    pids_line = re.search(r"^- daemon pids: (.*)$", text, re.M)
    assert pids_line, text[-500:]
    daemon_pids = {int(p) for p in re.findall(r"\b(\d+)\b", pids_line.group(1))}
    assert len(daemon_pids) >= 2, pids_line.group(0)
    assert left_running(daemon_pids) == []
    check_report(text)


def check_report(text: str) -> None:
    vllm_ran = "- vLLM backend: **skipped**" not in text
    backends = (TINY, VLLM) if vllm_ran else (TINY,)
    secs = sections(text)

    (crash,) = tables(section(secs, "1. Crash → READY"))
    for backend in backends:
        for label in CRASH_ROWS:
            found = rows_of(crash, backend, label)
            assert len(found) == 1, (backend, label, crash)
            assert found[0][-1] not in ("0/0", "0/1", "1/0"), found  # samples on both sides
        # every measured restart says which launcher started it
        (launchers,) = rows_of(crash, backend, "launcher of the new incarnations")
        assert launchers[2].startswith("exec"), launchers
        assert "forkserver" in launchers[4] or "exec (" in launchers[4], launchers
    if not vllm_ran:
        assert any(row[0] == "vLLM backend" and row[1].startswith("skipped") for row in crash)

    per_process, totals = tables(section(secs, "2. Memory"))
    for backend in backends:
        assert [row for row in per_process if row[:2] == [backend, "exec"]
                and row[2].startswith("engine ")], per_process
        assert [row for row in per_process if row[:2] == [backend, "forkserver"]
                and row[2].startswith("engine ")], per_process
        for label in MEMORY_TOTALS:
            assert len(rows_of(totals, backend, label)) == 1, (backend, label, totals)

    (startup,) = tables(section(secs, "3. Startup"))
    for backend in backends:
        for label in STARTUP_ROWS:
            assert rows_of(startup, backend, label), (backend, label, startup)

    (standby,) = tables(section(secs, "4. Warm standby promotion"))
    for backend in backends:
        assert [row for row in standby if row[0] == backend], (backend, standby)

    (summary,) = tables(section(secs, "Summary"))
    verdicts = [row[-1] for row in summary]
    for backend in backends:
        (ready,) = [row for row in summary if row[0].startswith(f"{backend}: crash → READY")]
        assert ready[-1] == "PASS" or ready[-1].startswith("MISS"), ready
        assert [row for row in summary if row[0].startswith(f"{backend}: crash → first token")]
        (spare,) = [row for row in summary if row[0].startswith(f"{backend}: warm standby")]
        assert spare[-1] == "PASS" or spare[-1].startswith(("MISS", "not measured")), spare
    assert not [v for v in verdicts if v.startswith("error")], summary
    if not vllm_ran:
        assert any(row[0].startswith("vLLM backend") and row[-1].startswith("skipped")
                   for row in summary), summary
