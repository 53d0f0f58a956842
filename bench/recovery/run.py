"""One backend under both launchers: an exec and a forkserver daemon started one after the other
(their starts are section 3), kills alternating between them (section 1), their memory (section
2), then the warm standby daemon (section 4). `Run` holds all of it for the report.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from bench.common import BenchError, Cleanup, Tracker
from bench.recovery.crash import Kill, kill_once
from bench.recovery.daemon import LAUNCHERS, Backend, Daemon, Generate
from bench.recovery.memory import Memory, measure_memory
from bench.recovery.standby import Promotion, standby_exists, standby_kill, teardown_floor
from bench.report import med


@dataclass
class Run:
    backend: Backend
    daemons: dict[str, Daemon]
    kills: dict[str, list[Kill]]
    memory: dict[str, Memory]
    first: dict[str, list[dict[str, Any]]]  # engines' status at first READY
    servers: list[dict[str, Any]]  # the forkserver daemon's fork servers after start
    daemon_pids: dict[str, int]
    promotions: list[Promotion] = field(default_factory=list)
    standby: str | None = None  # why standby promotion was not measured
    floor: list[float] = field(default_factory=list)  # kernel teardown of a like process


def run_backend(backend: Backend, n: int, cleanup: Cleanup, tracker: Tracker) -> Run:
    daemons: dict[str, Daemon] = {}
    first: dict[str, list[dict[str, Any]]] = {}
    for launcher in LAUNCHERS:  # one after the other: each start has the machine to itself
        d = cleanup.start(Daemon(backend, launcher, tracker))
        daemons[launcher] = d
        first[launcher] = d.status()["engines"]
    servers = daemons["forkserver"].fork_servers()
    gens = {launcher: Generate(d.socket) for launcher, d in daemons.items()}
    cleanup.closers.extend(g.close for g in gens.values())
    kills: dict[str, list[Kill]] = {launcher: [] for launcher in LAUNCHERS}
    for i in range(n):
        order = LAUNCHERS if i % 2 == 0 else LAUNCHERS[::-1]
        for launcher in order:
            kills[launcher].append(kill_once(daemons[launcher], gens[launcher]))
    memory = {launcher: measure_memory(daemons[launcher], gens[launcher])
              for launcher in LAUNCHERS}
    pids = {launcher: d.pid for launcher, d in daemons.items()}
    for launcher in LAUNCHERS:
        gens[launcher].close()
        cleanup.stop(daemons[launcher])  # its memory back before the next daemon starts
        daemons[launcher].remove_dir()
    run = Run(backend, daemons, kills, memory, first, servers, pids)
    if not standby_exists():
        run.standby = "not measured (standby not built yet)"
        return run
    # Warm standby: its own daemon (1 serving replica + 1 standby, forkserver), after the others
    d = Daemon(backend, "forkserver", tracker, standby=1)
    daemons["standby"] = d
    gen = Generate(d.socket)
    try:
        cleanup.start(d)
        d.fork_servers()
        run.promotions = [standby_kill(d, gen) for _ in range(n)]
        # the floor under the same conditions as the kills (this daemon idle beside it)
        own = med([p.victim_uss_mb for p in run.promotions]) or 1.0
        mapped = med([p.victim_rss_mb for p in run.promotions]) or own
        time.sleep(1.0)
        run.floor = teardown_floor(own, max(0.0, mapped - own), tracker)
    except BenchError as exc:  # the rest of the report stands; the row says what went wrong
        run.standby = f"error: {str(exc).splitlines()[0][:300]}"
        print(f"standby: {exc}", file=sys.stderr)
    finally:
        gen.close()
        if d.proc is not None:
            pids["standby"] = d.proc.pid
        if d in cleanup.started:
            cleanup.stop(d)
        d.remove_dir()
    return run
