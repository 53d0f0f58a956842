"""Recovery on a busy host: kill → READY of an engine with no other process on the machine and
with thousands of unrelated ones (a GPU node, a Kubernetes node).

    python -m bench.hostload [--quick] [--processes N] [-n KILLS] [--out FILE]
    # default bench/results/hostload.md

When an incarnation exits, engined finds what it left behind before the replacement spawns
(host.reaper). As a child subreaper, whatever an engine left is engined's descendant, so only
those are read; this measures that the cost follows engined's own process count, not the
host's. One daemon runs two `builtin:echo` engines, `ex` (launcher exec) and `fk` (the fork
server). Each round SIGKILLs an engine by pid and times, from the kill, until status shows it
READY again with a new pid (a 5 ms poll of `GET /v1/status` on one keep-alive connection), and
reads its `startup_s` (spawn → READY). Rounds run with no unrelated process, then with N of them
(`sleep` processes of their own session, not engined's descendants), then with none again. A
report; nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

from bench.common import BenchDaemon, Cleanup, Tracker, wait_until
from bench.report import (
    Report,
    add_out_option,
    engined_revision,
    load_average,
    machine_lines,
    num,
    out_path,
    table,
    title,
)

ENGINES = {"ex": "exec", "fk": "forkserver"}


def kill_to_ready(d: BenchDaemon, name: str) -> tuple[float, float]:
    """SIGKILL the engine; seconds until status shows it READY with a new pid, and its
    startup_s."""
    old = d.engine(name)
    started = time.monotonic()
    os.kill(old["pid"], signal.SIGKILL)

    def back() -> dict | None:
        e = d.engine(name)
        return e if e["state"] == "READY" and e["pid"] not in (None, old["pid"]) else None
    e = wait_until(back, 60.0, f"{name} READY again", 0.005)
    elapsed = time.monotonic() - started
    d.tracker.add(e["pid"])
    return elapsed, float(e["startup_s"] or 0.0)


def crowd(count: int, cleanup: Cleanup) -> list[subprocess.Popen]:
    """`count` unrelated processes: sleepers in sessions of their own."""
    procs = []
    for _ in range(count):
        proc = subprocess.Popen(["sleep", "3600"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        cleanup.tracker.add(proc.pid)
        procs.append(proc)
    return procs


def disperse(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hostload",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 kills, 500 processes")
    parser.add_argument("--processes", type=int, default=None, help="unrelated (default 2000)")
    parser.add_argument("-n", type=int, default=None, help="kills per engine and host (8)")
    add_out_option(parser, "hostload")
    args = parser.parse_args(argv)
    count = args.processes or (500 if args.quick else 2000)
    kills = args.n or (3 if args.quick else 8)
    r, tracker = Report(), Tracker()
    cleanup = Cleanup(tracker)
    phases = ("empty host", f"{count} unrelated processes", "empty host again")
    seen: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        r(title("engined recovery on a busy host: kill → READY with unrelated processes",
                args.quick), "", *machine_lines(), engined_revision(), load_average("start"))
        engines = [{"name": name, "model": "builtin:echo", "launcher": launcher}
                   for name, launcher in ENGINES.items()]
        d = cleanup.start(BenchDaemon("eh", tracker, engines), 120.0)
        for phase in phases:
            procs = crowd(count, cleanup) if phase == phases[1] else []
            try:
                time.sleep(1.0)
                for name in ENGINES:
                    seen[(phase, name)] = [kill_to_ready(d, f"{name}-0") for _ in range(kills)]
                    print(f"({phase}, {name}: {[round(t, 4) for t, _ in seen[(phase, name)]]})",
                          file=sys.stderr)
            finally:
                disperse(procs)
        r(f"- engines: 2 × builtin:echo, `ex` launcher exec, `fk` the fork server; {kills} "
          f"SIGKILLs of each per phase; READY seen by a 5 ms status poll", "",
          *table("engine", "measure", *(f"{p} (median)" for p in phases),
                 f"{phases[1]} / {phases[0]}"))
        for name, launcher in ENGINES.items():
            for label, index in (("SIGKILL → READY", 0), ("spawn → READY (`startup_s`)", 1)):
                medians = [statistics.median(x[index] for x in seen[(p, name)]) for p in phases]
                ratio = medians[1] / medians[0] if medians[0] else float("nan")
                r(f"| {name} ({launcher}) | {label} | "
                  + " | ".join(num(m * 1000, 1, "ms") for m in medians) + f" | {ratio:.2f} |")
        r("")
    finally:
        leftovers = cleanup.close()
    return r.finish(leftovers, out_path(args, "hostload"))


if __name__ == "__main__":
    sys.exit(main())
