"""How every benchmark reports: markdown lines printed as they come and written to a results file,
the header that says what ran where, tables, and how numbers are shown.

- Results files: a full run writes bench/results/NAME.md, a quick run NAME-quick.md
  (git-ignored: a quick run never replaces the committed results of a full one); `--out FILE`
  for elsewhere (`add_out_option`, `out_path`). Written atomically (`Report.write`).
- The header (`Report.header`, the one function every result starts from): the commit under
  test (full sha, and the files that differed from it), the date, the machine (CPU model, cores,
  memory, kernel, python), the command that made it, and the load at the start. bench/stale.py
  reads it back: a result older than its benchmark's own code is flagged.
- The load (`machine_load`, `cpu_busy_pct`): on a shared machine other work inflates every
  figure, so a report says how busy the machine was.
- Tables: `table(...)` (header and separator), `dist_row(...)` (label, median, min–max, n).
- Numbers: `None` (and, in a distribution, NaN) is a value that is not there, shown as "–".
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

from bench.common import ROOT

RESULTS = ROOT / "bench" / "results"
DASH = "–"  # a value that is not there
# what a result's commit line counts as "uncommitted changes": the code under test and the
# benchmark's own (its results excluded)
WATCHED = ("supervisor", "engine", "bench", "testkit", ":(exclude)bench/results")


# --- the report and its file --------------------------------------------------------------------
class Report:
    """Markdown lines, printed as they come and kept for the output file."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, *lines: str) -> None:
        for line in lines:
            print(line, flush=True)
            self.lines.append(line)

    def header(self, title_text: str, quick: bool, prog: str, *more: str) -> None:
        """The first lines of every result: `# TITLE`, then the commit, date, machine, command
        (`prog` and this process's arguments) and the load at the start; then `more`."""
        self(f"# {title_text}{' (--quick)' if quick else ''}", "", *header_lines(prog), *more,
             "")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    def finish(self, leftovers: Any, out: Path) -> int:
        """The closing line (the load now, and what had to be killed by pid), then the file."""
        self(f"- load average at end: {os.getloadavg()[0]:.2f} (1 min); processes left over and "
             f"killed by pid: {leftovers or 'none'}")
        self.write(out)
        return 0

    def write(self, out: Path) -> None:
        """Write the report to `out` atomically (a temporary file, then rename)."""
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(self.text())
        tmp.replace(out)
        print(f"\n(written to {out})")


def add_out_option(parser: argparse.ArgumentParser, name: str) -> None:
    """`--out FILE`; without it `out_path` picks bench/results/NAME.md (or NAME-quick.md)."""
    parser.add_argument("--out", default=None, help=f"default bench/results/{name}.md "
                        f"(--quick: bench/results/{name}-quick.md)")


def out_path(args: argparse.Namespace, name: str) -> Path:
    if args.out:
        return Path(args.out)
    return RESULTS / (f"{name}-quick.md" if args.quick else f"{name}.md")


# --- the header: what ran where -----------------------------------------------------------------
def git(*args: str) -> str:
    """A read-only git command in the repository (`--no-optional-locks`: no index refresh);
    its output, or "" when it fails."""
    try:
        done = subprocess.run(["git", "--no-optional-locks", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def revision() -> str:
    """`SHA` of HEAD, with ` + uncommitted changes in FILES` when the code under test or the
    benchmark's own differs from it."""
    head = git("rev-parse", "HEAD")
    if not head:
        return "not a git checkout"
    changed = git("diff", "--name-only", "HEAD", "--", *WATCHED).split()
    return head + (f" + uncommitted changes in {', '.join(changed)}" if changed else "")


def header_lines(prog: str) -> list[str]:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor() or "?")
    command = " ".join([prog, *map(shlex.quote, sys.argv[1:])])
    return [f"- commit: {revision()}",
            f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
            f"- machine: {cpu}, {os.cpu_count()} cores (nproc {len(os.sched_getaffinity(0))}), "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM, Linux {platform.release()}, "
            f"python {platform.python_version()}",
            f"- command: {command}",
            f"- load average at start: {os.getloadavg()[0]:.2f} (1 min)"]


def cpu_busy_pct(cpu_start: Any) -> float:
    """How busy all CPUs were on average since `cpu_start` (psutil.cpu_times()), in %."""
    cpu_end = psutil.cpu_times()
    busy = (sum(cpu_end) - cpu_end.idle - cpu_end.iowait) - (
        sum(cpu_start) - cpu_start.idle - cpu_start.iowait)
    return 100 * busy / max(1e-9, sum(cpu_end) - sum(cpu_start))


def machine_load(load_start: tuple[float, ...], cpu_start: Any,
                 run_s: float | None = None) -> str:
    """The load during a run: the load average at start and now, how busy all CPUs were since
    `cpu_start` (and the run's length); the caller adds how to read its rows against it."""
    return (f"- machine load during the run: load average {load_start[0]:.2f} at start, "
            f"{os.getloadavg()[0]:.2f} at end; all CPUs {cpu_busy_pct(cpu_start):.0f} % busy on "
            f"average (everything on the machine, this benchmark included)"
            + ("" if run_s is None else f"; run time {run_s:.0f} s") + ".")


# --- tables -------------------------------------------------------------------------------------
def table(*columns: str) -> tuple[str, str]:
    """A markdown table's header and separator lines."""
    return "| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"


def dist_row(label: str, values: Iterable[float | None], digits: int = 2, unit: str = "s",
             scale: float = 1.0) -> str:
    """`| label | median | min–max | n |` of the values that are there (`– | – | 0` if none)."""
    vals = present(values)
    if not vals:
        return f"| {label} | {DASH} | {DASH} | 0 |"
    return (f"| {label} | {num(statistics.median(vals), digits, unit, scale)} | "
            f"{spread(vals, digits, unit, scale)} | {len(vals)} |")


# --- numbers ------------------------------------------------------------------------------------
def present(values: Iterable[float | None]) -> list[float]:
    """The values that are there: neither None nor NaN."""
    return [v for v in values if v is not None and v == v]


def med(values: Iterable[float | None]) -> float | None:
    """Median of the values that are there (None when none is)."""
    vals = present(values)
    return statistics.median(vals) if vals else None


def quantile(values: Iterable[float], q: float) -> float | None:
    """The q-quantile (0 ≤ q ≤ 1), linearly interpolated between order statistics."""
    vals = sorted(values)
    if not vals:
        return None
    pos = (len(vals) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def num(value: float | None, digits: int = 2, unit: str = "", scale: float = 1.0) -> str:
    """`value * scale` with `digits` decimals and the unit, or – for None."""
    if value is None:
        return DASH
    return f"{value * scale:.{digits}f}" + (f" {unit}" if unit else "")


def ms(seconds: float | None, digits: int = 2) -> str:
    return num(seconds, digits, "ms", 1e3)


def sec(seconds: float | None, digits: int = 2) -> str:
    return num(seconds, digits, "s")


def ms_auto(seconds: float | None) -> str:
    """Milliseconds at a precision set by the magnitude (µs to seconds)."""
    if seconds is None:
        return DASH
    if seconds < 0.1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds * 1e3:,.0f} ms"


def signed_pct(value: float | None) -> str:
    return DASH if value is None else f"{value:+.1f} %"


def spread(values: Iterable[float | None], digits: int = 2, unit: str = "s",
           scale: float = 1.0) -> str:
    """`min–max unit` of the values that are there, or –."""
    vals = present(values)
    if not vals:
        return DASH
    return f"{num(min(vals), digits, scale=scale)}–{num(max(vals), digits, unit, scale)}"


def ms_range(values: Iterable[float | None]) -> str:
    """`min – max` of the values that are there, each in `ms_auto`, or –."""
    vals = present(values)
    return f"{ms_auto(min(vals))} – {ms_auto(max(vals))}" if vals else DASH


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where it means nothing (a value missing, b not positive)."""
    return None if a is None or b is None or b <= 0 else a / b


def times(x: float | None) -> str:
    """A factor: `0.42×`, `12.3×`, `1,234×`; – for None."""
    if x is None:
        return DASH
    return f"{x:,.0f}×" if x >= 100 else (f"{x:.1f}×" if x >= 10 else f"{x:.2f}×")


def counted(items: Iterable[str]) -> str:
    """`a ×2, b ×1`: each distinct item with how often it came, in order of first appearance."""
    seen: dict[str, int] = {}
    for item in items:
        seen[item] = seen.get(item, 0) + 1
    return ", ".join(f"{k} ×{v}" for k, v in seen.items()) or DASH

