"""The scenarios, measured: every supervisor side by side and killed in turn (respawn and
detection latency), engined's kill → READY against the floor's echo engine, then fleets of N
children each, all at once (idle CPU and RSS, then `status` wall time, tools in turn).
"""

from __future__ import annotations

import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from bench.common import ROOT, Cleanup, cpu_s, engine_processes, wait_until, without_engined_vars
from bench.core.observe import (
    SETTLE_S,
    Engined,
    Floor,
    Kill,
    ProcEvents,
    ReadyListener,
    engined_kill,
    engined_kill_to_ready,
    kill_once,
)
from bench.core.peers import Circus, Supervisord, peer_env

ENGINED = "engined (echo engine)"
FLOOR = "floor (sleeping child)"
FLOOR_ECHO = "floor (echo engine child)"
SV = "supervisord (sleeping child, output piped)"
SV_ECHO = "supervisord (echo engine child, output piped)"
CIRCUS = "circus (default check_delay: 5 s)"
CIRCUS_FAST = "circus (check_delay = 0.1 s)"
ROWS = (ENGINED, FLOOR, FLOOR_ECHO, SV, SV_ECHO, CIRCUS, CIRCUS_FAST)
PEER_KILL_TIMEOUT_S = 20.0  # circus at its default check_delay reaps only on its timer


def supervisord_kill(s: Supervisord, events: ProcEvents | None, rng: random.Random) -> Kill:
    victim = s.victim()  # RUNNING: the status request itself woke supervisord's loop
    # its loop sleeps in poll(timeout=1 s) from its last wake-up: a fixed pause would always
    # land at the same phase of that timer
    time.sleep(rng.uniform(0.0, 1.0))
    k = kill_once(s.pid, victim, events, PEER_KILL_TIMEOUT_S)
    logged = wait_until(lambda: s.exit_logged(k.t_wall), 5.0, f"{s.label}: `exited:` line")
    k.detect_s = logged - k.t_wall
    return k


def circus_kill(c: Circus, events: ProcEvents | None, rng: random.Random) -> Kill:
    victim = c.victim()
    # circus reaps only on its check_delay timer, whose phase a fixed cadence would lock onto
    time.sleep(rng.uniform(0.0, c.check_delay))
    k = kill_once(c.pid, victim, events, PEER_KILL_TIMEOUT_S)
    wait_until(lambda: victim in c.reaped, 10.0, f"{c.label}: its reap event")
    k.detect_s = c.reaped[victim] - k.t_wall
    return k


def latency(cleanup: Cleanup, events: ProcEvents | None, venvs: dict[str, Path | None],
            n: int, rng: random.Random) -> dict[str, Any]:
    """Every supervisor up at once, each killed n times in turn (scenarios 1 and 2); then engined
    and the floor's echo engine killed in turn to READY (scenario 3)."""
    tracker = cleanup.tracker
    daemon, floor = Engined(1, tracker), Floor(1, tracker)
    floor_echo = Floor(1, tracker, ReadyListener(cleanup))
    kills: dict[str, tuple[Any, Callable[[], Kill]]] = {
        ENGINED: (daemon, lambda: engined_kill(daemon, events)),
        FLOOR: (floor, lambda: floor.kill(events)),
        FLOOR_ECHO: (floor_echo, lambda: floor_echo.kill(events))}
    if (venv := venvs["supervisord"]) is not None:
        sv = Supervisord(venv, 1, tracker, SV)
        sv_echo = Supervisord(venv, 1, tracker, SV_ECHO, ReadyListener(cleanup).child_env())
        kills[SV] = (sv, lambda: supervisord_kill(sv, events, rng))
        kills[SV_ECHO] = (sv_echo, lambda: supervisord_kill(sv_echo, events, rng))
    if (venv := venvs["circus"]) is not None:
        cc, cf = Circus(venv, 1, tracker, CIRCUS), Circus(venv, 1, tracker, CIRCUS_FAST, 0.1)
        kills[CIRCUS] = (cc, lambda: circus_kill(cc, events, rng))
        kills[CIRCUS_FAST] = (cf, lambda: circus_kill(cf, events, rng))
    for thing, _ in kills.values():
        if hasattr(thing, "remove_dir"):
            cleanup.dirs.append(thing.dir)
        cleanup.start(thing)
    time.sleep(1.0)
    res: dict[str, Any] = {"kills": {label: [] for label in kills}}
    for _ in range(n):
        for label, (_, kill) in kills.items():
            time.sleep(SETTLE_S)
            res["kills"][label].append(kill())
    for label, (thing, _) in kills.items():
        if label not in (ENGINED, FLOOR_ECHO):
            cleanup.stop(thing)
    res["ready"], res["floor_ready"] = [], []
    for _ in range(n):
        time.sleep(SETTLE_S)
        res["ready"].append(engined_kill_to_ready(daemon))
        time.sleep(SETTLE_S)
        res["floor_ready"].append(floor_echo.kill_to_ready())
    cleanup.stop(floor_echo)
    cleanup.stop(daemon)
    return res


def timed_call(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, int]:
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=60)
    return time.perf_counter() - started, done.returncode


def fleet(cleanup: Cleanup, venvs: dict[str, Path | None], size: int, idle_s: float,
          ctl_n: int) -> dict[str, Any]:
    """engined with `size` echo engines beside the floor and the peers with `size` sleeping
    children each: nobody calls for `idle_s` (scenario 4), then `status` calls (scenario 5)."""
    tracker = cleanup.tracker
    big = Engined(size, tracker)
    fleets: dict[str, Any] = {ENGINED: big, FLOOR: Floor(size, tracker)}
    if (venv := venvs["supervisord"]) is not None:
        fleets[SV] = Supervisord(venv, size, tracker, SV)
    if (venv := venvs["circus"]) is not None:
        fleets[CIRCUS] = Circus(venv, size, tracker, CIRCUS)
        fleets[CIRCUS_FAST] = Circus(venv, size, tracker, CIRCUS_FAST, 0.1)
    t0 = time.monotonic()
    cleanup.start(big, timeout_s=900)
    res: dict[str, Any] = {"start_s": time.monotonic() - t0}
    for thing in fleets.values():
        cleanup.dirs.extend([thing.dir] if hasattr(thing, "dir") else [])
        if thing is not big:
            cleanup.start(thing)
    time.sleep(3.0)  # the last READY and spawns done, heartbeats flowing
    procs = {label: psutil.Process(thing.pid) for label, thing in fleets.items()}
    cpu0 = {label: cpu_s(p) for label, p in procs.items()}
    rss = {label: [p.memory_info().rss] for label, p in procs.items()}
    w0 = time.monotonic()
    while (left := w0 + idle_s - time.monotonic()) > 0:
        time.sleep(min(1.0, left))
        for label, p in procs.items():
            rss[label].append(p.memory_info().rss)
    wall = time.monotonic() - w0
    res["idle"] = {label: {"cpu_s": cpu_s(p) - cpu0[label], "wall_s": wall,
                           "rss_peak": max(rss[label]), "children": len(engine_processes(p))}
                   for label, p in procs.items()}
    res["echo_rss"] = statistics.median(c.memory_info().rss for c in engine_processes(procs[
        ENGINED]))

    ctl = Path(sys.executable).parent / "enginectl"
    calls = {"enginectl": ([str(ctl), "--socket", big.socket, "status"],
                           without_engined_vars(), ROOT)}
    if SV in fleets:
        calls["supervisorctl"] = (fleets[SV].ctl_argv(), peer_env(), fleets[SV].dir)
    for label, name in ((CIRCUS, "circusctl (default check_delay)"),
                        (CIRCUS_FAST, "circusctl (check_delay = 0.1 s)")):
        if label in fleets:
            calls[name] = (fleets[label].ctl_argv(), peer_env(), fleets[label].dir)
    res["ctl"] = {name: {"t": [], "rc": set()} for name in calls}
    for i in range(ctl_n + 1):  # the first round warms the page cache, untimed
        for name, (argv, env, cwd) in calls.items():
            took, rc = timed_call(argv, env, cwd)
            res["ctl"][name]["rc"].add(rc)
            if i:
                res["ctl"][name]["t"].append(took)
    for thing in fleets.values():
        if thing is not big:
            cleanup.stop(thing)
    cleanup.stop(big, 60)
    return res
