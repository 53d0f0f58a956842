"""Event-loop lag at 100 engines, from the daemon's own histogram (supervisor/loop.py).

    python -m bench.loop            # full: 60 s per phase (~3-4 min), writes bench/results/loop.md
    python -m bench.loop --quick    # 10 s per phase (~1 min), bench/results/loop-quick.md

engined runs 100 `builtin:echo` replicas (1 s heartbeats, immediate restarts: bench.common's
spec) with `http: 127.0.0.1:<free port>`; once all are READY the bench reads
`engined_event_loop_lag_seconds` (the loop monitor's ticker, every 0.25 s: how late it woke) and
`engined_event_loop_stalled_seconds_total` from GET /metrics before and after each phase:
(a) idle, nobody calling; (b) a scrape storm, back-to-back GET /metrics from one client thread on
one keep-alive connection; (c) churn, a random echo engine of this daemon SIGKILLed (by pid) every
0.5 s. Per phase: the histogram delta (tick count, mean from `_sum`, p50/p90/p99 interpolated
within buckets like Prometheus' histogram_quantile, the highest bucket reached), the stalled
seconds delta, and the daemon's CPU (psutil). Every process started here is tracked by pid and
stopped by pid, never by name.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import psutil

from bench.common import (
    BenchError,
    Cleanup,
    Tracker,
    cpu_s,
    read_children,
    terminate,
    wait_until,
)
from bench.core import Engined
from bench.metrics import (
    TICK_S,
    Lag,
    Scraper,
    Snapshots,
    bound,
    bucket,
    est,
    lag_ms,
    read_lag,
)
from bench.report import (
    Report,
    add_out_option,
    cpu_busy_pct,
    engined_revision,
    machine_lines,
    machine_load,
    out_path,
    table,
    title,
)
from testkit.driver import free_port, is_engine_of

FLEET = 100
KILL_EVERY_S = 0.5
CHURN_SAMPLE_EVERY = 10  # --timeline: in churn, one extra scrape every 10th kill (5 s)
SAMPLE_S = 0.5  # the /proc sampler's period (daemon CPU and machine busy, for the spikes)
SPIKE_S = 0.05  # a tick later than this is listed with what it coincided with
MAX_SPIKES = 15  # listed per phase
SETTLE_S = 3.0  # after all READY (and between phases): last READYs, heartbeats flowing

_OUR_KILL_RE = re.compile(r"WARNING \[exit\] \S+ pid \d+ killed by SIGKILL.*restarting now")


# --- phases -------------------------------------------------------------------------------------
@dataclass
class Phase:
    name: str
    delta: Lag | None = None
    wall_s: float = 0.0
    daemon_cpu_pct: float = 0.0
    bench_cpu_pct: float = 0.0
    machine_busy_pct: float = 0.0
    loadavg: tuple[float, float] = (0.0, 0.0)  # 1-min load average at start, at end
    restarts: int = 0
    before_read_s: float = 0.0  # the "before" GET /metrics (it can delay one tick of the phase)
    warnings: list[str] = field(default_factory=list)
    spikes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def floor(self) -> bool:
        return "floor" in self.name


class Measure:
    """Readings around one phase: the loop metrics (own keep-alive connection), the daemon's
    CPU times, this process's, the whole machine's, restarts from GET /v1/status."""

    def __init__(self, daemon: Engined, snap: Scraper, phase: Phase) -> None:
        self.daemon, self.snap, self.phase = daemon, snap, phase
        self.proc, self.me = psutil.Process(daemon.pid), psutil.Process()

    def __enter__(self) -> Measure:
        self.restarts0 = restarts(self.daemon)
        self.load0 = os.getloadavg()[0]
        self.wall0 = time.time()
        started = time.monotonic()
        self.lag0 = read_lag(self.snap)
        self.phase.before_read_s = time.monotonic() - started
        self.cpu0, self.me0, self.machine0 = cpu_s(self.proc), cpu_s(self.me), psutil.cpu_times()
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            return
        p = self.phase
        t1 = time.monotonic()
        cpu1, me1 = cpu_s(self.proc), cpu_s(self.me)
        p.machine_busy_pct = cpu_busy_pct(self.machine0)
        lag1 = read_lag(self.snap)
        p.wall_s = t1 - self.t0
        p.delta = lag1 - self.lag0
        p.daemon_cpu_pct = 100 * (cpu1 - self.cpu0) / p.wall_s
        p.bench_cpu_pct = 100 * (me1 - self.me0) / p.wall_s
        p.loadavg = (self.load0, os.getloadavg()[0])
        status = self.daemon.status()["engines"]
        p.restarts = sum(e["restarts"] for e in status) - self.restarts0
        p.warnings = [f"{stamp - self.wall0:+.1f} s {level} {msg[:140]}"
                      for stamp, level, msg in self.daemon.daemon_log()
                      if stamp >= self.wall0 - 0.01 and level in ("WARNING", "ERROR", "CRITICAL")]


class Sampler:
    """Every SAMPLE_S, from /proc only (the daemon is not asked): the daemon's CPU seconds and
    the whole machine's busy CPU seconds; `around(a, b)` says how busy both were then."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.samples: list[tuple[float, float, float]] = []  # (monotonic, daemon cpu, busy)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def busy_s() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - t.iowait

    def _run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.samples.append((time.monotonic(), cpu_s(self.proc), self.busy_s()))
            except psutil.Error:
                return
            self.stop_event.wait(SAMPLE_S)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(5)

    def around(self, a: float, b: float) -> str:
        """Daemon CPU and machine busy over the sampling span that covers [a, b]."""
        samples = list(self.samples)
        before = [x for x in samples if x[0] <= a] or samples[:1]
        after = [x for x in samples if x[0] >= b] or samples[-1:]
        if not before or not after or after[0][0] <= before[-1][0]:
            return ""
        (t0, d0, m0), (t1, d1, m1) = before[-1], after[0]
        wall = max(1e-9, t1 - t0)
        return (f"; over {t1 - t0:.1f} s around it the daemon used {100 * (d1 - d0) / wall:.0f} % "
                f"of a core, the machine {100 * (m1 - m0) / wall / (os.cpu_count() or 1):.0f} % "
                "of all CPUs")


def restarts(daemon: Engined) -> int:
    return sum(e["restarts"] for e in daemon.status()["engines"])


def spikes_between(readings: list[Lag], t0: float, what_then, sampler: Sampler) -> list[str]:
    """Intervals between consecutive readings in which a tick came later than SPIKE_S."""
    out = []
    for a, b in zip(readings, readings[1:]):
        d = b - a
        top = d.max_bucket()
        if top is not None and top[0] >= SPIKE_S:
            out.append(f"{max(0.0, a.t - t0):.1f}–{b.t - t0:.1f} s: {d.above(SPIKE_S):.0f} tick(s) "
                       f"> {SPIKE_S * 1e3:.0f} ms, highest in ({top[0]:g}, {top[1]:g}] s"
                       + what_then(a.t, b.t) + sampler.around(a.t, b.t))
    return out


# A bare asyncio ticker with the loop monitor's period and buckets, in its own process, side by
# side with the idle phase: what this machine's timers and scheduler give any asyncio loop.
FLOOR_TICKER = """
import asyncio, bisect, json, os, sys, time
bounds, duration, tick = json.loads(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
async def main():
    counts, total, n = [0] * (len(bounds) + 1), 0.0, 0
    end = time.monotonic() + duration
    while time.monotonic() < end:
        expected = time.monotonic() + tick
        await asyncio.sleep(tick)
        late = max(0.0, time.monotonic() - expected)
        counts[bisect.bisect_left(bounds, late)] += 1
        total, n = total + late, n + 1
    cum, running = [], 0
    for c in counts:
        running += c
        cum.append(running)
    t = os.times()
    print(json.dumps({"cum": cum, "sum": total, "count": n, "cpu_s": t.user + t.system}))
asyncio.run(main())
"""


def idle_phase(daemon: Engined, snap: Scraper, duration_s: float, bounds: list[float],
               tracker: Tracker) -> tuple[Phase, Phase]:
    """The idle phase, and the bare asyncio ticker's run beside it (as a Phase of its own)."""
    p, floor = Phase("idle"), Phase("idle: floor (bare asyncio ticker, own process)")
    proc = subprocess.Popen([sys.executable, "-c", FLOOR_TICKER, json.dumps(bounds),
                             str(duration_s), str(TICK_S)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, text=True)
    tracker.add(proc.pid)
    try:
        with Measure(daemon, snap, p):
            time.sleep(duration_s)
        out, _ = proc.communicate(timeout=30)
    finally:
        terminate(proc, 5)
    if proc.returncode != 0:
        raise BenchError(f"the floor ticker exited with {proc.returncode}")
    data = json.loads(out)
    floor.delta = Lag(tuple(zip([*bounds, math.inf], map(float, data["cum"]))), data["sum"],
                      data["count"], 0.0, duration_s)
    floor.wall_s = duration_s
    floor.daemon_cpu_pct = 100 * data["cpu_s"] / duration_s  # its whole life, start-up included
    floor.machine_busy_pct, floor.loadavg = p.machine_busy_pct, p.loadavg
    return p, floor


def storm_phase(daemon: Engined, port: int, snap: Scraper, duration_s: float,
                sampler: Sampler) -> Phase:
    """Back-to-back GET /metrics on one keep-alive connection from this (one) thread. Every
    scrape carries the histogram too, so it is also the timeline."""
    p = Phase("scrape storm")
    storm = Scraper(port)
    took: list[tuple[float, float]] = []  # (monotonic start, duration)
    readings: list[Lag] = []
    try:
        storm.get()  # connect
        with Measure(daemon, snap, p) as m:
            deadline = time.monotonic() + duration_s
            while (now := time.monotonic()) < deadline:
                t, _recv, body = storm.get()
                took.append((now, t))
                readings.append(Lag.parse(body, now + t))
    finally:
        storm.close()
    durations = [d for _s, d in took]
    q = (statistics.quantiles(durations, n=100, method="inclusive") if len(durations) > 1
         else durations * 99)

    def then(a: float, b: float) -> str:
        inside = [d for s, d in took if a < s + d <= b]  # the scrape(s) that carried it
        return (f"; the scrape that reported it took {max(inside) * 1e3:.0f} ms"
                if inside else "")
    p.spikes = spikes_between([m.lag0, *readings], m.t0, then, sampler)
    p.extra = {"scrapes": len(took), "rate": len(took) / p.wall_s,
               "scrape_med": statistics.median(durations), "scrape_p99": q[98],
               "scrape_max": max(durations)}
    return p


def churn_phase(daemon: Engined, snap: Scraper, duration_s: float, tracker: Tracker,
                rng: random.Random, sampler: Sampler, timeline: bool) -> Phase:
    """A random echo engine of this daemon SIGKILLed every KILL_EVERY_S on a fixed schedule:
    the daemon's children from /proc (the daemon is not asked), each checked to be its engine
    (ENGINED_PARENT_PID) and signalled through a psutil handle (no pid reuse)."""
    p = Phase("churn")
    kills: list[float] = []
    skipped = 0
    readings: list[Lag] = []
    with Measure(daemon, snap, p) as m:
        readings.append(m.lag0)
        deadline = m.t0 + duration_s
        next_kill, slot = m.t0 + KILL_EVERY_S, 0
        while next_kill < deadline:
            slot += 1
            time.sleep(max(0.0, next_kill - time.monotonic()))
            next_kill += KILL_EVERY_S
            children = list(read_children(daemon.pid))
            rng.shuffle(children)
            for pid in children:
                try:
                    victim = psutil.Process(pid)
                    if not is_engine_of(pid, daemon.pid):
                        continue
                    victim.send_signal(signal.SIGKILL)
                except psutil.Error:
                    continue
                kills.append(time.monotonic())
                break
            else:
                skipped += 1
            if timeline and slot % CHURN_SAMPLE_EVERY == 0:
                readings.append(read_lag(snap))
        time.sleep(max(0.0, deadline - time.monotonic()))

    def then(a: float, b: float) -> str:
        return f"; {sum(a <= k <= b for k in kills)} kills in it"
    p.spikes = spikes_between([*readings, read_lag(snap)], m.t0, then, sampler)
    t_back = time.monotonic()
    try:
        wait_until(lambda: all(e["state"] == "READY" for e in daemon.status()["engines"]),
                   60, "every engine READY again after the churn", 0.1)
    except BenchError as exc:
        raise BenchError(f"{exc}\n{daemon.log_tail()}") from None
    for e in daemon.status()["engines"]:
        tracker.add(e["pid"])
    p.extra = {"kills": len(kills), "skipped": skipped, "samples": len(readings) - 1,
               "ready_again_s": time.monotonic() - t_back}
    return p


# --- report -------------------------------------------------------------------------------------
def report(r: Report, phases: list[Phase], phase_s: float, fleet_start_s: float,
           load_start, cpu_start, run_s: float, leftovers: list[int], stop_note: str) -> None:
    r(machine_load(load_start, cpu_start, run_s) + " Other work on a shared machine shows up as "
      "lag too: the per-phase machine columns say how busy it was.", "",
      f"{FLEET}-engine fleet start (spawn → all READY, as seen by polling): {fleet_start_s:.1f} s.",
      "", f"## Event-loop lag at {FLEET} echo engines ({phase_s:g} s per phase)", "",
      *table("phase", "ticks (expected)", "mean", "p50", "p90", "p99", "max bucket",
             f"ticks > {SPIKE_S * 1e3:.0f} ms", "stalled s", "daemon CPU", "machine busy",
             "restarts"))
    for p in phases:
        d = p.delta
        assert d is not None
        n = d.count
        r(f"| {p.name} | {n:.0f} ({p.wall_s / TICK_S:.0f}) | "
          f"{lag_ms(d.total / n if n else None)} | {est(d, 0.5)} | {est(d, 0.9)} | "
          f"{est(d, 0.99)} | "
          f"{bucket(d.max_bucket())} | {d.above(SPIKE_S):.0f} | {d.stalled:.3f} | "
          f"{p.daemon_cpu_pct:.1f} % | {p.machine_busy_pct:.0f} % (load {p.loadavg[0]:.2f}→"
          f"{p.loadavg[1]:.2f}) | {'–' if p.floor else p.restarts} |")
    storm = next(p for p in phases if p.name == "scrape storm").extra
    churn = next(p for p in phases if p.name == "churn").extra
    r("", "- daemon CPU: its user+sys `cpu_times()` delta over the phase, % of one core; machine "
      "busy: all CPUs, everything on the machine (this bench's own share: "
      + ", ".join(f"{p.name} {p.bench_cpu_pct:.0f} %" for p in phases if not p.floor)
      + " of one core). The floor row is a bare asyncio loop sleeping 0.25 s at a time "
      "(`asyncio.sleep`, the loop monitor's ticker without a daemon around it) in its own "
      "process during the idle phase, with the same buckets: what this machine's timers and "
      "scheduler give any asyncio loop; its CPU column is its own CPU.",
      f"- scrape storm: {storm['scrapes']} scrapes ({storm['rate']:.0f}/s), one at a time on one "
      f"keep-alive connection; a scrape took median {lag_ms(storm['scrape_med'])}, p99 "
      f"{lag_ms(storm['scrape_p99'])}, max {lag_ms(storm['scrape_max'])}.",
      f"- churn: {churn['kills']} SIGKILLs (one every {KILL_EVERY_S:g} s"
      + (f"; {churn['skipped']} slots found no live engine" if churn['skipped'] else "")
      + f"); every engine READY again {churn['ready_again_s']:.1f} s after the last one.",
      "- p50/p90/p99 are estimates: linear interpolation inside a bucket, as "
      "`histogram_quantile()` does; below the first bound (1 ms) the histogram cannot tell "
      "0.1 ms from 0.9 ms, so a quantile marked † says only \"< 1 ms\" (the mean, from `_sum`, "
      "is exact). Max bucket: the highest bucket with a tick in it.", "")
    bounds = [le for le, _ in phases[0].delta.buckets]  # type: ignore[union-attr]
    labels = [f"≤ {bound(bounds[0])}"] + [
        f"> {bound(lo)}" if hi == math.inf else f"{bound(lo)} – {bound(hi)}"
        for lo, hi in zip(bounds, bounds[1:])]
    rows = []
    for p in phases:
        cum = [c for _, c in p.delta.buckets]  # type: ignore[union-attr]
        rows.append([a - b for a, b in zip(cum, [0.0, *cum[:-1]])])
    used = [i for i in range(len(bounds)) if any(row[i] for row in rows)] or [0]
    shown = list(range(max(used) + 1))
    r("### Ticks per bucket (histogram delta)", "",
      *table("phase", *(labels[i] for i in shown)),
      *(f"| {p.name} | " + " | ".join(f"{row[i]:.0f}" for i in shown) + " |"
        for p, row in zip(phases, rows)), "")
    r(f"### Ticks later than {SPIKE_S * 1e3:.0f} ms, and what they coincided with", "")
    any_spike = False
    for p in phases:
        if p.spikes:
            any_spike = True
            r(f"- {p.name}:", *(f"  - {s}" for s in p.spikes[:MAX_SPIKES]))
            if len(p.spikes) > MAX_SPIKES:
                r(f"  - … {len(p.spikes) - MAX_SPIKES} more")
        elif p.name.startswith("idle") and p.delta is not None and p.delta.above(SPIKE_S):
            any_spike = True
            r(f"- {p.name}: {p.delta.above(SPIKE_S):.0f} (no timeline in the idle phase: "
              "nothing scrapes it)")
    if not any_spike:
        r("- none")
    r("", "The \"before\" reading of each phase (a `GET /metrics`; the tick due while it "
      "is served lands in the phase, late by up to its duration) took: "
      + ", ".join(f"{p.name} {lag_ms(p.before_read_s)}" for p in phases if not p.floor) + ".")
    r("", "Timeline: in the storm every scrape carries the histogram, so a late tick is placed "
      "between two scrapes; " + (
          f"in churn (--timeline) an extra scrape every {CHURN_SAMPLE_EVERY} kills "
          f"({churn['samples']} in all, each of which can itself delay one tick by up to a "
          "scrape's time)" if churn["samples"] else
          "churn and idle have only their two readings (no extra scrape perturbs them; "
          "`--timeline` adds one every 5 s in churn to place its late ticks)") + ".", "")
    r("### Daemon warnings during the phases", "")
    any_warning = False
    for p in phases:
        ours = [w for w in p.warnings if _OUR_KILL_RE.search(w)]
        other = [w for w in p.warnings if not _OUR_KILL_RE.search(w)]
        if ours:
            any_warning = True
            r(f"- {p.name}: {len(ours)} × `[exit] … killed by SIGKILL … restarting now` (the "
              "bench's own kills)")
        for w in other[:20]:
            any_warning = True
            r(f"- {p.name}: {w}")
        if len(other) > 20:
            r(f"- {p.name}: … {len(other) - 20} more")
    if not any_warning:
        r("- none")
    r("", "## Method", "",
      f"- engined: `python -m engined.supervisor.daemon -c SPEC` (testkit/driver.py's Daemon via "
      f"bench.common.BenchDaemon), {FLEET} `builtin:echo` replicas, 1 s heartbeats, immediate "
      "restarts (`backoff` 0 s, `start_limit.burst: 1000000`), `http: 127.0.0.1:<free port>`, "
      "runtime dir `/tmp/ebXXXXXXXX/rt`.",
      f"- After all READY and {SETTLE_S:g} s of settling, three phases, {SETTLE_S:g} s apart: "
      "idle (nobody calls the daemon); scrape storm (back-to-back `GET /metrics` from one "
      "thread, one keep-alive connection); churn (every "
      f"{KILL_EVERY_S:g} s on a fixed schedule, a random child of the daemon from "
      "`/proc/<pid>/task/<pid>/children` that is its engine (`ENGINED_PARENT_PID`; its "
      "`engined.supervisor.host.guard` child is not one, so it is never picked) is SIGKILLed "
      "through a psutil handle).",
      "- Each phase is bracketed by two `GET /metrics` on a second keep-alive connection; the "
      "numbers are their difference: `engined_event_loop_lag_seconds` (ticker every "
      f"{TICK_S:g} s, observation = how late it woke) and "
      "`engined_event_loop_stalled_seconds_total` (wake-ups ≥ 1 s late). The daemon renders "
      "a scrape's body on the loop (its per-engine process sampling runs in a worker thread "
      f"that competes for the GIL; a scrape took ~{lag_ms(storm['scrape_med'])} end to end here), "
      "so the tick due during the "
      "\"before\" reading (a chance of about scrape time / tick period) lands in the phase "
      "late by up to that much: at most one such tick per phase. The reading connection "
      "reconnects when the daemon has closed it after 10 s idle. Restarts: the sum of "
      "`restarts` in `GET /v1/status` before and after.",
      f"- Cleanup: SIGTERM to the daemon, wait, SIGKILL leftovers by pid; leftover processes "
      f"after the clean shutdown: {leftovers or 'none'}" + (f"; {stop_note}" if stop_note else "")
      + ".")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loop",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 s per phase")
    parser.add_argument("--phase", type=float, default=None,
                        help="seconds per phase (default 60; --quick 10)")
    add_out_option(parser, "loop")
    parser.add_argument("--timeline", action="store_true",
                        help=f"churn: one extra GET /metrics every {CHURN_SAMPLE_EVERY} kills, to "
                        "place its late ticks in time (each scrape can delay a tick itself)")
    parser.add_argument("--seed", type=int, default=8, help="victim choice in the churn phase")
    args = parser.parse_args(argv)
    phase_s = args.phase or (10.0 if args.quick else 60.0)
    out = out_path(args, "loop")

    r, tracker = Report(), Tracker()
    cleanup = Cleanup(tracker)

    def on_sigterm(signum: int, frame: object) -> None:  # `timeout` sends SIGTERM: clean up
        raise SystemExit(f"bench.loop: signal {signum}, cleaning up")
    signal.signal(signal.SIGTERM, on_sigterm)
    t_run = time.monotonic()
    r(title("engined event-loop lag", args.quick), "", *machine_lines(),
      engined_revision(), f"- {FLEET} echo engines; {phase_s:g} s per phase", "")
    load_start, cpu_start = os.getloadavg(), psutil.cpu_times()
    snap: Scraper | None = None
    stop_note = ""
    try:
        port = free_port()
        daemon = Engined(FLEET, tracker, http=f"127.0.0.1:{port}")
        t0 = time.monotonic()
        cleanup.start(daemon, timeout_s=300)
        fleet_start_s = time.monotonic() - t0
        time.sleep(SETTLE_S)
        sampler = cleanup.start(Sampler(daemon.pid))
        snap = Snapshots(port)
        bounds = [le for le, _ in read_lag(snap).buckets[:-1]]  # connect; fail early if absent
        phases = [*idle_phase(daemon, snap, phase_s, bounds, tracker)]
        time.sleep(SETTLE_S)
        phases.append(storm_phase(daemon, port, snap, phase_s, sampler))
        time.sleep(SETTLE_S)
        phases.append(churn_phase(daemon, snap, phase_s, tracker, random.Random(args.seed),
                                  sampler, args.timeline))
        snap.close()
        cleanup.stop(sampler)
        cleanup.stop(daemon, 60)
        stop_note = daemon.stop_note
        daemon.remove_dir()
        leftovers = tracker.kill_leftovers()
    finally:
        if snap is not None:
            snap.close()
        cleanup.close()
    report(r, phases, phase_s, fleet_start_s, load_start, cpu_start, time.monotonic() - t_run,
           leftovers, stop_note)
    r.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
