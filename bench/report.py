"""How every benchmark reports: markdown lines printed as they come and written to a results file,
the header that says what ran where, tables, and how numbers are shown.

- Results files: a full run writes bench/results/NAME.md, a quick run NAME-quick.md
  (git-ignored: a quick run never replaces the committed results of a full one); `--out FILE`
  for elsewhere (`add_out_option`, `out_path`). Written atomically (`Report.write`).
- The header: `machine_lines()` (CPUs, memory, kernel, python, date), `engined_revision()` (the
  commit under test), the load (`load_average`, `machine_load`, `cpu_busy_pct`): on a shared
  machine other work inflates every figure, so a report says how busy the machine was.
- Tables: `table(...)` (header and separator), `dist_row(...)` (label, median, min–max, n).
- Numbers: `None` (and, in the rows of a distribution, NaN) is a value that is not there, shown
  as "–". `ms`, `sec`, `num` at a fixed precision; `ms_auto` by magnitude; `signed_pct`;
  `spread` and `ms_range` (min–max), `med_spread` (median (min–max)); `quantile`, `med`,
  `ratio`, `times`; `counted` (each distinct item with its count).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

from bench.common import ENGINED_SOURCE, ROOT

RESULTS = ROOT / "bench" / "results"
DASH = "–"  # a value that is not there


# --- the report and its file --------------------------------------------------------------------
class Report:
    """Markdown lines, printed as they come and kept for the output file."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, *lines: str) -> None:
        for line in lines:
            print(line, flush=True)
            self.lines.append(line)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    def finish(self, leftovers: Any, out: Path) -> int:
        """The closing line (the load now, and what had to be killed by pid), then the file."""
        self(f"{load_average('end')}; processes left over and killed by pid: "
             f"{leftovers or 'none'}")
        self.write(out)
        return 0

    def write(self, out: Path) -> None:
        """Write the report to `out` atomically (a temporary file, then rename)."""
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(self.text())
        tmp.replace(out)
        print(f"\n(written to {out})")


def default_out(name: str, quick: bool) -> Path:
    """bench/results/NAME.md, or NAME-quick.md for a quick run (git-ignored: a quick run never
    replaces the committed results of a full one)."""
    return RESULTS / (f"{name}-quick.md" if quick else f"{name}.md")


def add_out_option(parser: argparse.ArgumentParser, name: str) -> None:
    """`--out FILE`; without it `out_path` picks `default_out(name, --quick)`."""
    parser.add_argument("--out", default=None, help=f"default bench/results/{name}.md "
                        f"(--quick: bench/results/{name}-quick.md)")


def out_path(args: argparse.Namespace, name: str) -> Path:
    return Path(args.out) if args.out else default_out(name, args.quick)


def title(text: str, quick: bool) -> str:
    """The report's first line: `# TEXT`, and ` (--quick)` for a quick run."""
    return f"# {text}{' (--quick)' if quick else ''}"


# --- the header: what ran where -----------------------------------------------------------------
def machine_lines() -> list[str]:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor() or "?")
    return [f"- machine: {os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), {cpu}, "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM, Linux {platform.release()}",
            f"- python: {platform.python_version()} ({sys.executable})",
            f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"]


def engined_revision() -> str:
    """The commit the engined under test was built from, and whether its sources differ (read
    only: `--no-optional-locks` keeps git from even refreshing its index); the checkout it is
    imported from when that is not this one's."""
    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", "--no-optional-locks", *args], cwd=ENGINED_SOURCE,
                                  capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""
    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "- engined: not a git checkout"
    changed = git("diff", "--name-only", "HEAD", "--", "supervisor", "engine").split()
    where = "" if ENGINED_SOURCE == ROOT else f" (imported from {ENGINED_SOURCE})"
    return (f"- engined: commit {head}{where}" + (f", with uncommitted changes in "
                                                  f"{', '.join(changed)}" if changed else ""))


def cpu_busy_pct(cpu_start: Any) -> float:
    """How busy all CPUs were on average since `cpu_start` (psutil.cpu_times()), in %."""
    cpu_end = psutil.cpu_times()
    busy = (sum(cpu_end) - cpu_end.idle - cpu_end.iowait) - (
        sum(cpu_start) - cpu_start.idle - cpu_start.iowait)
    return 100 * busy / max(1e-9, sum(cpu_end) - sum(cpu_start))


def load_average(when: str) -> str:
    """`- load average at WHEN: X (1 min)`."""
    return f"- load average at {when}: {os.getloadavg()[0]:.2f} (1 min)"


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
             scale: float = 1.0, sep: str = "–") -> str:
    """`| label | median | min–max | n |` of the values that are there (`– | – | 0` if none)."""
    vals = present(values)
    if not vals:
        return f"| {label} | {DASH} | {DASH} | 0 |"
    return (f"| {label} | {num(statistics.median(vals), digits, unit, scale)} | "
            f"{spread(vals, digits, unit, scale, sep)} | {len(vals)} |")


# --- numbers ------------------------------------------------------------------------------------
def present(values: Iterable[float | None]) -> list[float]:
    """The values that are there: neither None nor NaN."""
    return [v for v in values if v is not None and v == v]


def med(values: Iterable[float | None]) -> float | None:
    """Median of the values that are there (None when none is)."""
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def quantile(values: Iterable[float], q: float) -> float | None:
    """The q-quantile (0 ≤ q ≤ 1), linearly interpolated between order statistics; None for no
    values."""
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


def ms_auto(seconds: float | None, tenths: bool = True) -> str:
    """Milliseconds at a precision set by the magnitude: two decimals under 0.1 s, then one
    under 10 s and whole milliseconds with thousands separators from there (`tenths`, for times
    from microseconds to seconds); without `tenths`, whole milliseconds from 0.1 s (loop lag)."""
    if seconds is None:
        return DASH
    if seconds < 0.1:
        return f"{seconds * 1e3:.2f} ms"
    if not tenths:
        return f"{seconds * 1e3:.0f} ms"
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds * 1e3:,.0f} ms"


def signed_pct(value: float | None) -> str:
    return DASH if value is None else f"{value:+.1f} %"


def spread(values: Iterable[float | None], digits: int = 2, unit: str = "s", scale: float = 1.0,
           sep: str = "–") -> str:
    """`min–max unit` of the values that are there, or –."""
    vals = present(values)
    if not vals:
        return DASH
    return f"{num(min(vals), digits, scale=scale)}{sep}{num(max(vals), digits, unit, scale)}"


def ms_range(values: Iterable[float | None]) -> str:
    """`min – max` of the values that are there, each in `ms_auto`, or –."""
    vals = present(values)
    return f"{ms_auto(min(vals))} – {ms_auto(max(vals))}" if vals else DASH


def med_spread(values: Iterable[float | None], digits: int = 2) -> str:
    """`median s (min–max)` in seconds of the values that are there (one: just it), or –."""
    vals = present(values)
    if not vals:
        return DASH
    if len(vals) == 1:
        return sec(vals[0], digits)
    return f"{sec(statistics.median(vals), digits)} ({spread(vals, digits, '')})"


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
