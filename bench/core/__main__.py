"""Supervision core: engined against the pidfd floor, supervisord and circus, side by side.

    python -m bench.core [--quick] [-n KILLS] [--require-peers] [--out FILE]

The run: the peers' venvs, the observer, scenarios 1-3 and 4-5 (bench/core/scenarios.py), the
tables, the summary of the targets and the method.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import HEARTBEATS, BenchError, Cleanup, Tracker
from bench.core.observe import SETTLE_S, Kill, ProcEvents
from bench.core.peers import PEERS, ensure_venv
from bench.core.scenarios import (
    CIRCUS,
    CIRCUS_FAST,
    ENGINED,
    FLOOR,
    FLOOR_ECHO,
    ROWS,
    SV,
    SV_ECHO,
    fleet,
    latency,
)
from bench.report import (
    Report,
    add_out_option,
    machine_load,
    med,
    ms_auto,
    ms_range,
    out_path,
    ratio,
    table,
    times,
)

PROG = "python -m bench.core"
RECORDS = {ENGINED: "`last_exit.at` (GET /v1/status)", FLOOR: "its `exit` line",
           FLOOR_ECHO: "its `exit` line", SV: "`exited:` log line", SV_ECHO: "`exited:` log line",
           CIRCUS: "`reap` event's `time`", CIRCUS_FAST: "`reap` event's `time`"}


def prepare_peers(require: bool) -> tuple[dict[str, Path | None], str]:
    """Each peer's venv, made or reused; one that cannot be made is skipped (and said), or, with
    `require`, fails the run."""
    venvs: dict[str, Path | None] = {}
    notes = []
    for peer, (dist, version) in PEERS.items():
        try:
            path, how = ensure_venv(dist, version)
            venvs[peer] = path
            notes.append(f"{peer}: `{dist}=={version}` in `{path}` ({how})")
        except BenchError as exc:
            if require:
                raise
            venvs[peer] = None
            notes.append(f"{peer}: SKIPPED, its venv could not be made: "
                         f"{str(exc).splitlines()[0]}")
    return venvs, "- peers: " + "; ".join(notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 kills each, fleets of 20 children, 5 s idle, 3 status calls")
    parser.add_argument("-n", type=int, default=None, help="kills per supervisor (default 30)")
    parser.add_argument("--require-peers", action="store_true",
                        help="fail when a peer's venv cannot be made (default: skip it)")
    add_out_option(parser, "core")
    args = parser.parse_args(argv)
    n = args.n or (3 if args.quick else 30)
    size, idle_s, ctl_n = (20, 5.0, 3) if args.quick else (100, 60.0, 20)

    r, tracker = Report(), Tracker()
    cleanup = Cleanup(tracker)
    venvs, peers_line = prepare_peers(args.require_peers)
    events = ProcEvents.open()
    if events is not None:
        cleanup.closers.append(events.close)
    r.header("engined supervision core vs the floor, supervisord and circus", args.quick, PROG,
             peers_line, f"- kills per supervisor: n={n}; fleets of {size} children, "
             f"{idle_s:g} s idle; status calls: n={ctl_n}",
             "- observer: " + ("kernel proc events (netlink proc connector), passive" if events
                               else "polling /proc/<pid>/task/<pid>/children (no proc "
                               "connector here: not root)"))
    load_start, cpu_start, t_run = os.getloadavg(), psutil.cpu_times(), time.monotonic()
    try:
        res = latency(cleanup, events, venvs, n, random.Random(8))
        res.update(fleet(cleanup, venvs, size, idle_s, ctl_n))
        leftovers = tracker.kill_leftovers()
    finally:
        cleanup.close()
    r(machine_load(load_start, cpu_start, time.monotonic() - t_run) + " The rows of each "
      "latency table ran side by side and were killed in turn, so load hits them alike.", "")
    report(r, res, events is not None, size)
    report_summary(r, res, size)
    report_method(r, events is not None)
    return r.finish(leftovers, out_path(args, "core"))


# --- the tables -----------------------------------------------------------------------------------
def kill_med(kills: dict[str, list[Kill]], label: str, attr: str, from_exit: bool = False
             ) -> float | None:
    """The median of `attr` over a supervisor's kills (None if it did not run); `from_exit`:
    counted from the victim's kernel exit event, the supervisor's own share."""
    return med([getattr(k, attr) - (k.exit_s if from_exit else 0.0) for k in kills.get(label, [])
                if getattr(k, attr) is not None and (k.exit_s is not None or not from_exit)])


def report(r: Report, res: dict[str, Any], proc_events: bool, size: int) -> None:
    kills: dict[str, list[Kill]] = res["kills"]
    rows = [label for label in ROWS if label in kills]
    e_resp, e_det = kill_med(kills, ENGINED, "respawn_s"), kill_med(kills, ENGINED, "detect_s")
    r("## 1. Respawn latency (SIGKILL → the replacement process exists)", "",
      *table("supervisor", "median", "min – max", "n", "this ÷ engined",
             "victim gone (kernel) → replacement forked"))
    for label in rows:
        vals = [k.respawn_s for k in kills[label]]
        r(f"| {label} | {ms_auto(med(vals))} | {ms_range(vals)} | {len(vals)} | "
          f"{times(ratio(med(vals), e_resp))} | "
          f"{ms_auto(kill_med(kills, label, 'respawn_s', True))} |")
    r("", "\"Exists\" = " + ("the kernel's fork event of a new process whose parent is the "
                             "supervisor." if proc_events else "a poller first saw a new child "
                             "of the supervisor.") +
      " The last column starts at the victim's exit event: an echo engine (threads, ZeroMQ "
      "sockets) takes longer to die than a sleeping interpreter.", "")
    r("## 2. Detection latency (SIGKILL → the supervisor's own record of the exit)", "",
      *table("supervisor", "the record", "median", "min – max", "n", "this ÷ engined",
             "SIGKILL → victim gone (kernel)", "victim gone → recorded"))
    for label in rows:
        vals = [k.detect_s for k in kills[label]]
        r(f"| {label} | {RECORDS[label]} | {ms_auto(med(vals))} | {ms_range(vals)} | "
          f"{len(vals)} | {times(ratio(med(vals), e_det))} | "
          f"{ms_auto(kill_med(kills, label, 'exit_s'))} | "
          f"{ms_auto(kill_med(kills, label, 'detect_s', True))} |")
    r("", "supervisord runs through a 10-line shim (bench/core/peers.py) that stamps its log "
      "lines with the same `time.time()` in microseconds; circus publishes `watcher.<name>.reap` "
      "with the `time.time()` of its reap. Kills land at random phases of the peers' timers.", "")
    ready, floor_ready = res["ready"], res["floor_ready"]
    r("## 3. Kill → READY (echo engine)", "", *table("measure", "median", "min – max", "n"),
      f"| engined: SIGKILL → READY (the daemon's `since`) | {ms_auto(med(ready))} | "
      f"{ms_range(ready)} | {len(ready)} |",
      f"| floor, echo engine child: SIGKILL → its READY received | {ms_auto(med(floor_ready))} "
      f"| {ms_range(floor_ready)} | {len(floor_ready)} |", "",
      "No peer knows READY: for them the replacement existing is all there is.", "")
    idle, e_idle = res["idle"], res["idle"][ENGINED]
    r(f"## 4. Idle overhead ({size} children, {e_idle['wall_s']:.0f} s, nobody calling)", "",
      *table("supervisor", "children", "CPU s", "% of one core", "peak RSS", "CPU ÷ engined",
             "RSS ÷ engined"))
    for label, x in idle.items():
        r(f"| {label} | {x['children']} | {x['cpu_s']:.3f} | "
          f"{100 * x['cpu_s'] / x['wall_s']:.3f} % | {x['rss_peak'] / 1e6:.1f} MB | "
          f"{times(ratio(x['cpu_s'], e_idle['cpu_s']))} | "
          f"{times(ratio(x['rss_peak'], e_idle['rss_peak']))} |")
    per_hb = e_idle["cpu_s"] / (size * e_idle["wall_s"] / float(
        HEARTBEATS["heartbeat_interval"].rstrip("s")))
    r("", f"All at once, over the same window. CPU = user+sys of the supervisor process itself; "
      f"RSS sampled once a second (MB = 10^6 bytes). engined's {size} echo engines took "
      f"{res['start_s']:.1f} s from spawn to all READY; one echo engine's RSS is "
      f"{res['echo_rss'] / 1e6:.1f} MB. The peers' children sleep; engined receives {size} "
      f"heartbeats a second: {1e6 * per_hb:.0f} µs of its CPU per heartbeat, everything "
      f"included.", "")
    ctl = res["ctl"]
    e_ctl = med(ctl["enginectl"]["t"])
    r(f"## 5. Control latency: `status` with {size} children (wall time of one call)", "",
      *table("command", "median", "min – max", "n", "this ÷ enginectl", "exit codes"))
    for name, x in ctl.items():
        r(f"| {name} | {ms_auto(med(x['t']))} | {ms_range(x['t'])} | {len(x['t'])} | "
          f"{times(ratio(med(x['t']), e_ctl))} | {', '.join(map(str, sorted(x['rc'])))} |")
    r("", "Each call is a fresh process (interpreter, imports, one request, output), spawn to "
      "exit; tools take turns after one untimed round.", "")


def report_summary(r: Report, res: dict[str, Any], size: int) -> None:
    kills, idle, ctl = res["kills"], res["idle"], res["ctl"]
    e_resp, f_resp = kill_med(kills, ENGINED, "respawn_s"), kill_med(kills, FLOOR, "respawn_s")
    e_det, sv_det = kill_med(kills, ENGINED, "detect_s"), kill_med(kills, SV_ECHO, "detect_s")
    e_ready, e_idle = med(res["ready"]), idle[ENGINED]
    rows = []

    def add(target: str, value: str, ref: str, ok: bool | None) -> None:
        rows.append(f"| {target} | {value} | {ref} | "
                    f"{'n/a' if ok is None else 'PASS' if ok else 'MISS'} |")
    add("respawn median < 5 ms", ms_auto(e_resp), "", e_resp < 5e-3)
    add("respawn within 3× of the floor (sleeping child)", times(ratio(e_resp, f_resp)),
        f"floor {ms_auto(f_resp)}", e_resp <= 3 * f_resp)
    add("detection median < 2 ms", ms_auto(e_det), "", e_det < 2e-3)
    add("detection no worse than supervisord's, the same echo engine child", ms_auto(e_det),
        f"supervisord {ms_auto(sv_det)}" if sv_det else "supervisord not run",
        None if sv_det is None else e_det <= sv_det)
    add("echo kill → READY median < 100 ms", ms_auto(e_ready), "", e_ready < 0.1)
    peers = {label: 100 * x["cpu_s"] / x["wall_s"] for label, x in idle.items()
             if label in (SV, CIRCUS, CIRCUS_FAST)}
    cpu = 100 * e_idle["cpu_s"] / e_idle["wall_s"]
    best = min(peers.items(), key=lambda kv: kv[1]) if peers else None
    add(f"idle CPU at {size} children ≤ the better peer's + 1 % of a core", f"{cpu:.3f} %",
        f"{best[0]} {best[1]:.3f} %" if best else "no peer run",
        None if best is None else cpu <= best[1] + 1.0)
    add(f"idle RSS at {size} children < 80 MB", f"{e_idle['rss_peak'] / 1e6:.1f} MB", "",
        e_idle["rss_peak"] < 80e6)
    peer_ctl = {name: med(x["t"]) for name, x in ctl.items() if name != "enginectl"}
    better = min(peer_ctl.items(), key=lambda kv: kv[1]) if peer_ctl else None
    e_ctl = med(ctl["enginectl"]["t"])
    add("`enginectl status` ≤ the better peer's wall time", ms_auto(e_ctl),
        f"{better[0]} {ms_auto(better[1])}" if better else "no peer run",
        None if better is None else e_ctl <= better[1])
    r("## Summary of the targets", "", *table("target", "engined", "reference (same run)",
                                              "result"), *rows, "")


def report_method(r: Report, proc_events: bool) -> None:
    r("## Method", "",
      "- engined runs `builtin:echo` engines started by exec, 1 s heartbeats, every restart "
      "immediate (backoff 0, no start limit); the floor is bench/core/floor.py (asyncio, pidfd, "
      "posix_spawn), with a sleeping interpreter and with engined's own echo engine child; the "
      "peers run pinned versions from their own venvs, restart delay 0, the floor's sleeping "
      "child (and one supervisord engined's echo engine child, for a like-for-like detection).",
      f"- Each kill: the child up (engined: READY; supervisord: RUNNING) plus "
      f"{SETTLE_S * 1e3:.0f} ms (supervisord: + a random 0–1 s; circus: + a random "
      "0–check_delay), then `time.time()`, CLOCK_MONOTONIC and `os.kill(pid, SIGKILL)`. " + (
          "The kernel's proc connector stamps the victim's exit and the replacement's fork; "
          "the bench sleeps through each kill and reads them afterwards." if proc_events else
          "No proc connector: a poller reads /proc/<supervisor>/task/<pid>/children."),
      "- Every process is tracked and stopped by pid; nothing is killed by name.", "")


if __name__ == "__main__":
    sys.exit(main())
