"""engined against supervisord, circus and the pidfd floor, side by side in one run.

    python -m bench.compare [--quick] [--out FILE] [--peers auto|require|none]

The run: the peers' venvs, the observer (the kernel's proc events where they work), scenarios
1-2 (bench/compare/latency.py), 3, 4 and 6 (fleet.py), 5 (cold_start.py), then the report and
the summary of the targets (summary.py).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import psutil

from bench.common import BenchError, Cleanup, Tracker
from bench.compare.cold_start import cold_start_scenario, report_cold_start
from bench.compare.fleet import (
    FLEET,
    fleet_scenarios,
    report_control,
    report_idle,
    report_scrape,
)
from bench.compare.latency import latency_scenarios, report_detection, report_respawn
from bench.compare.summary import report_method, report_summary
from bench.core import ProcEvents
from bench.peers import PEERS, ensure_venv
from bench.report import (
    Report,
    add_out_option,
    engined_revision,
    machine_lines,
    machine_load,
    out_path,
    title,
)


def prepare_peers(mode: str, timeout_s: float, r: Report) -> dict[str, Path | None]:
    venvs: dict[str, Path | None] = {}
    notes = []
    for peer, (dist, version) in PEERS.items():
        if mode == "none":
            venvs[peer] = None
            notes.append(f"{peer}: skipped (--peers none)")
            continue
        try:
            path, how = ensure_venv(dist, version, timeout_s=timeout_s)
            venvs[peer] = path
            notes.append(f"{peer}: `{dist}=={version}` in `{path}` ({how})")
        except BenchError as exc:
            if mode == "require":
                raise
            venvs[peer] = None
            notes.append(f"{peer}: SKIPPED, its venv could not be made: "
                         f"{str(exc).splitlines()[0]}")
    r("- peers: " + "; ".join(notes))
    return venvs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="n=5 kills, 10 s idle, 5 control calls, 2 LLM crashes")
    add_out_option(parser, "compare")
    parser.add_argument("-n", type=int, default=None, help="kills per supervisor (default 30)")
    parser.add_argument("--idle", type=float, default=None, help="idle window, s (default 60)")
    parser.add_argument("--ctl-n", type=int, default=None, help="status calls per tool (20)")
    parser.add_argument("--llm-n", type=int, default=None,
                        help="tiny-llama crashes and cold starts (default 10); 0 skips")
    parser.add_argument("--peers", choices=("auto", "require", "none"), default="auto",
                        help="auto: create/reuse the peer venvs, skip a peer whose venv cannot be "
                        "made (said in the output); require: fail instead; none: floor + engined")
    parser.add_argument("--venv-timeout", type=float, default=300.0)
    parser.add_argument("--no-proc-events", action="store_true",
                        help="use the polling observer even where the proc connector works")
    args = parser.parse_args(argv)
    q = args.quick
    n = args.n or (5 if q else 30)
    idle_s = args.idle or (10.0 if q else 60.0)
    ctl_n = args.ctl_n or (5 if q else 20)
    llm_n = args.llm_n if args.llm_n is not None else (2 if q else 10)
    scrape_n, burst_n = 50, 200
    out = out_path(args, "compare")

    r, tracker, rng = Report(), Tracker(), random.Random(8)
    cleanup = Cleanup(tracker)
    res: dict = {}
    t_run = time.monotonic()
    r(title("engined vs supervisord vs circus", q), "", *machine_lines(), engined_revision())
    load_start, cpu_start = os.getloadavg(), psutil.cpu_times()
    venvs = prepare_peers(args.peers, args.venv_timeout, r)
    events = None if args.no_proc_events else ProcEvents.open()
    if events is not None:
        cleanup.closers.append(events.close)
    r(f"- kills per supervisor: n={n}; idle window: {idle_s:g} s at {FLEET} children; "
      f"status calls: n={ctl_n}; scrapes: n={scrape_n} + a burst of {burst_n}; "
      f"tiny-llama crashes: n={llm_n}",
      "- observer: " + ("kernel proc events (netlink proc connector), passive" if events else
                        "polling /proc/<pid>/task/<pid>/children (no proc connector here)"), "")
    try:
        res.update(latency_scenarios(cleanup, events, venvs, rng, n))
        res.update(fleet_scenarios(cleanup, venvs, idle_s, ctl_n, scrape_n, burst_n))
        res.update(cold_start_scenario(cleanup, llm_n))
        leftovers = tracker.kill_leftovers()
    finally:
        cleanup.close()
    overruns = events.overruns if events is not None else 0

    r(machine_load(load_start, cpu_start, time.monotonic() - t_run) + " The rows of each latency "
      "table ran side by side and were killed in turn, so load hits them alike.", "")
    report_respawn(r, res, events is not None)
    report_detection(r, res)
    report_idle(r, res)
    report_control(r, res)
    report_cold_start(r, res)
    report_scrape(r, res)
    report_summary(r, res)
    report_method(r, events is not None, leftovers, overruns)
    r.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
