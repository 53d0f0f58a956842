"""Section 4: new engined code put in place under load. One fleet (2 replicas of tiny-llama under
`supervisor.launcher: forkserver`, the gateway and `http:` on free loopback ports) serves K client
threads that loop `/v1/completions` through the gateway (alternately streamed and not), while the
daemon under them is replaced in three ways, alternating round by round (A, B, C, A, ...):

- A, in place: `POST /v1/upgrade` (what `enginectl upgrade` sends): the same pid re-executes
  engined and adopts the engines;
- B, the old way (`systemctl restart`): SIGTERM (the gateway drains, every engine stops), then a
  new daemon on the same spec file, runtime directory and ports;
- C, a crash: SIGKILL, then a new daemon as in B (systemd's Restart=): the engines outlived it
  (`supervisor.orphan_timeout`) and the new daemon adopts them.

A round: warm-up, the trigger, the load until every client was served after the event, a few
seconds more. Reported per scenario (median and min–max over the rounds): the window's requests
by outcome, the gap, what the clients saw, whether the daemon pid and the engines stayed.
"""

from __future__ import annotations

import signal
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.common import BenchError, Cleanup, Tracker, wait_until
from bench.recovery.daemon import REPLICAS, GatewayDaemon, tiny_backend
from bench.recovery.load import RETRY_S, Load, Req
from bench.report import DASH, Report, counted, med, num, spread, table
from testkit.driver import is_engine_of

GROUP = "tiny"  # the group's name: the model name the gateway serves it under
PROMPT = "upgrade benchmark: the quick brown fox jumps over the lazy dog"
MAX_TOKENS = 16
POLL_S = 0.05  # the bench's status poll while an event runs
A, B, C = "A", "B", "C"
LABELS = {A: "A: upgrade in place", B: "B: SIGTERM + new daemon", C: "C: SIGKILL + new daemon"}


# --- the fleet ------------------------------------------------------------------------------------
class Fleet(GatewayDaemon):
    """2 tiny-llama replicas behind the gateway, in /tmp/euXXXXXXXX. One object for the whole
    run: B and C start a new daemon on the same spec file, runtime directory and port."""

    def __init__(self, cache: Path, tracker: Tracker) -> None:
        super().__init__("eu", tracker, [tiny_backend(cache).spec])
        self.log_engines = (f"{GROUP}-0",)
        self.start_timeout_s, self.start_interval_s = 300.0, POLL_S

    def identity(self) -> tuple[dict[str, tuple[int, float, int, int]], set[int]]:
        """Per engine: (pid, the process's start time, incarnation, restarts); and the pids of
        the fork servers."""
        out = {}
        status = self.status()
        servers = {s["pid"] for s in self.fork_servers(status)}
        for e in status["engines"]:
            if e["pid"] is not None:
                self.tracker.add(e["pid"])
                out[e["name"]] = (e["pid"], psutil.Process(e["pid"]).create_time(),
                                  e["incarnation"], e["restarts"])
        return out, servers


# --- one round ------------------------------------------------------------------------------------
@dataclass
class Round:
    scenario: str
    index: int
    trigger: float  # time.time() of POST /v1/upgrade or SIGTERM
    done: float  # A: status showed the hand-over; B: the new daemon had every engine READY
    stopped: float  # the load was told to stop
    reqs: list[Req]
    daemon_before: int
    daemon_after: int
    before: dict[str, tuple[int, float, int, int]]
    after: dict[str, tuple[int, float, int, int]]
    servers_before: set[int]
    servers_after: set[int]
    facts: dict[str, float | None] = field(default_factory=dict)  # scenario-specific

    # the requests, split at the trigger
    @property
    def window(self) -> list[Req]:
        return [q for q in self.reqs if q.end >= self.trigger]

    @property
    def warmup(self) -> list[Req]:
        return [q for q in self.reqs if q.end < self.trigger]

    def failed(self, kind: str | None = None) -> list[Req]:
        return [q for q in self.window if not q.ok and (kind is None or q.kind == kind)]

    @property
    def engines_kept(self) -> int:
        return sum(1 for name, (pid, created, _, _) in self.before.items()
                   if self.after.get(name, (None, None))[:2] == (pid, created))

    @property
    def restarts(self) -> int:
        """Restarts the daemon counted during the round (a new daemon counts from 0 again)."""
        if self.daemon_before != self.daemon_after:
            return sum(e[3] for e in self.after.values())
        return sum(self.after[n][3] - e[3] for n, e in self.before.items() if n in self.after)

    def first_ok(self, sent_after: float | None = None) -> float | None:
        """Trigger → the first ok answer (to a request sent after `sent_after`, if given)."""
        ends = [q.end for q in self.window if q.ok
                and (sent_after is None or q.start >= sent_after)]
        return min(ends) - self.trigger if ends else None

    def longest_overlapping(self) -> float | None:
        """The longest request, any outcome, that was running at some time of the event."""
        times = [q.end - q.start for q in self.reqs if q.start < self.done and q.end > self.trigger]
        return max(times) if times else None

    def silence(self) -> float | None:
        """The longest time without any ok answer, from the trigger to the end of the load."""
        ends = [self.trigger] + sorted(q.end for q in self.window if q.ok) + [self.stopped]
        return max((b - a for a, b in zip(ends, ends[1:])), default=None)


def load_round(d: Fleet, clients: int, warmup_s: float, settle_s: float,
               event: Any) -> tuple[float, float, float, list[Req], dict[str, float | None]]:
    """Warm up under load, run `event` (returns its trigger and done times and its facts), keep
    the load until every client was served after it, then `settle_s` more."""
    load = Load(d.gateway_port, clients, lambda i, k: (GROUP, (i + k) % 2 == 1), PROMPT,
                MAX_TOKENS).start()
    try:
        wait_until(lambda: sum(q.ok for q in load.snapshot()) >= 2 * clients, 120,
                   "the clients' first answers", POLL_S)
        time.sleep(warmup_s)
        trigger, done, facts = event()
        wait_until(lambda: len({q.client for q in load.snapshot() if q.ok and q.start >= done})
                   == clients, 120, "every client served after the event", POLL_S)
        time.sleep(settle_s)
        stopped = time.time()
    finally:
        reqs = load.stop()
    return trigger, done, stopped, reqs, facts


def upgrade_in_place(d: Fleet) -> tuple[float, float, dict[str, float | None]]:
    """A: POST /v1/upgrade (202 once the new code accepted the spec), then status polled until
    `handovers` counts it."""
    sup = d.status()["supervisor"]
    handovers, cut = sup["handovers"], sup["handover_cut"]
    trigger = time.time()
    code, _, body = d.http("POST", "/v1/upgrade")
    accepted = time.time()
    if code != 202:
        raise BenchError(f"POST /v1/upgrade: HTTP {code}: {body[:500]!r}\n{d.log_tail()}")

    def handed_over() -> dict | None:
        d.check_alive()
        status = d.status()
        return status if status["supervisor"]["handovers"] > handovers else None
    try:
        status = wait_until(handed_over, 60, "the hand-over", POLL_S)
    except BenchError as exc:
        raise BenchError(f"{exc}\n{d.log_tail()}") from None
    done = time.time()
    sup = status["supervisor"]
    return trigger, done, {
        "accepted_s": accepted - trigger, "handover_s": sup["handover_s"],
        "cut": sup["handover_cut"] - cut,
        "adopted": sum(1 for e in status["engines"] if (e["adopted_at"] or 0) >= trigger),
        "pid_reported": sup["pid"]}


def restart_daemon(d: Fleet) -> tuple[float, float, dict[str, float | None]]:
    """B: SIGTERM, wait for the exit, a new daemon on the same spec (until every engine is
    READY), as `systemctl restart` does."""
    old_pid = d.pid
    old_engines = d.spawned_pids() | d.server_pids
    for pid in old_engines:
        if is_engine_of(pid, old_pid):
            d.tracker.add(pid)
    d.status_conn.close()
    trigger = time.time()
    d.signal(signal.SIGTERM)
    code = d.wait_exit(120)
    exited = time.time()
    if code != 0:
        raise BenchError(f"engined exited with {code} on SIGTERM\n{d.log_tail()}")
    orphans = sum(1 for pid in old_engines if is_engine_of(pid, old_pid))
    started = time.time()
    d.start()
    done = time.time()
    engines = d.status()["engines"]
    return trigger, done, {
        "exit_s": exited - trigger, "exited_at": exited, "orphans": float(orphans),
        "ready_s": max(e["since"] for e in engines) - started,
        "startup_s": med([e["startup_s"] for e in engines])}


def crash_daemon(d: Fleet) -> tuple[float, float, dict[str, float | None]]:
    """C: SIGKILL, then a new daemon on the same spec at once (until every engine is READY):
    it adopts the engines the dead one left."""
    d.status_conn.close()
    d.expect_unclean_exit = True
    trigger = time.time()
    d.signal(signal.SIGKILL)
    d.wait_exit(30)
    exited = time.time()
    d.expect_unclean_exit = False
    d.start()
    done = time.time()
    status = d.status()
    return trigger, done, {
        "exited_at": exited, "adopted": sum(1 for e in status["engines"]
                                            if (e["adopted_at"] or 0) >= trigger),
        "ready_s": done - exited}


def run_round(d: Fleet, scenario: str, index: int, clients: int, warmup_s: float,
              settle_s: float) -> Round:
    d.wait_all_ready(60)
    time.sleep(1.0)  # the previous round's tail (its last restarts' warm-up) out of the way
    daemon_before, (before, servers_before) = d.pid, d.identity()
    event = {A: lambda: upgrade_in_place(d), B: lambda: restart_daemon(d),
             C: lambda: crash_daemon(d)}[scenario]
    trigger, done, stopped, reqs, facts = load_round(d, clients, warmup_s, settle_s, event)
    after, servers_after = d.identity()
    rnd = Round(scenario, index, trigger, done, stopped, reqs, daemon_before, d.pid, before,
                after, servers_before, servers_after, facts)
    if scenario == A:
        rnd.facts["daemon_kept"] = float(rnd.facts.pop("pid_reported") == daemon_before
                                         == d.pid)
        rnd.facts["gap_s"] = rnd.facts["handover_s"]
    else:
        rnd.facts["daemon_kept"] = float(d.pid == daemon_before)
        rnd.facts["gap_s"] = rnd.first_ok(sent_after=rnd.facts.pop("exited_at"))
    if scenario == C:  # restarts since the round began: the new daemon continues the count
        rnd.facts["restarts"] = float(sum(rnd.after[n][3] - e[3] for n, e in before.items()
                                          if n in rnd.after))
    failed = rnd.failed()
    print(f"({LABELS[scenario]}, round {index + 1}: {len(rnd.window)} requests in the window, "
          f"{len(failed)} failed; gap {num(rnd.facts['gap_s'], 3, 's')}; engines kept "
          f"{rnd.engines_kept}/{len(before)})", file=sys.stderr, flush=True)
    return rnd


# --- the report -----------------------------------------------------------------------------------
def upgrade_section(cleanup: Cleanup, cache: Path, n: int, clients: int, quick: bool
                    ) -> dict[str, list[Round]]:
    warmup_s, settle_s = (2.0, 2.0) if quick else (4.0, 3.0)
    rounds: dict[str, list[Round]] = {key: [] for key in LABELS}
    d = cleanup.start(Fleet(cache, cleanup.tracker))
    for i in range(n):
        for scenario in LABELS:
            rounds[scenario].append(run_round(d, scenario, i, clients, warmup_s, settle_s))
    cleanup.stop(d)
    return rounds


def cells(values: Iterable[float | None] | None, digits: int, unit: str) -> str:
    """`median | min–max` of the values that are there; – for a row a scenario does not have."""
    vals = [v for v in values or [] if v is not None]
    if not vals:
        return f"{DASH} | {DASH}"
    return f"{num(statistics.median(vals), digits, unit)} | {spread(vals, digits, unit)}"


def fact(key: str) -> Any:
    return lambda x: x.facts.get(key)


ROWS = [  # (label, f(round) for every scenario or one per scenario A B C, digits, unit)
    ("requests in the window (trigger → load stopped)", lambda x: len(x.window), 0, ""),
    ("… answered ok", lambda x: sum(q.ok for q in x.window), 0, ""),
    ("… failed, all kinds", lambda x: len(x.failed()), 0, ""),
    ("… connection refused", lambda x: len(x.failed("refused")), 0, ""),
    ("… connection reset or closed without an answer", lambda x: len(x.failed("reset")), 0, ""),
    ("… HTTP error status, stream cut, timeout or other",
     lambda x: sum(len(x.failed(k)) for k in ("http", "cut", "timeout", "other")), 0, ""),
    ("failed before the trigger (warm-up)", lambda x: sum(not q.ok for q in x.warmup), 0, ""),
    ("the gap (A: `handover_s`; B, C: the signal → first ok answer from the new daemon)",
     fact("gap_s"), 3, "s"),
    ("trigger → event done (A: status shows the hand-over; B, C: every engine READY)",
     lambda x: x.done - x.trigger, 3, "s"),
    ("trigger → first ok answer to a request sent after the trigger",
     lambda x: x.first_ok(sent_after=x.trigger), 3, "s"),
    ("longest request overlapping the event", lambda x: x.longest_overlapping(), 3, "s"),
    ("longest time without an ok answer (all clients)", lambda x: x.silence(), 3, "s"),
    ("daemon pid kept (1 = yes)", fact("daemon_kept"), 0, ""),
    ("engines kept (same pid and start time)", lambda x: x.engines_kept, 0, f"of {REPLICAS}"),
    ("fork servers kept (same pid)", lambda x: len(x.servers_before & x.servers_after), 0, ""),
    ("engine restarts counted in the round (B: a new daemon counts from 0)",
     (lambda x: x.restarts, lambda x: x.restarts, fact("restarts")), 0, ""),
    ("engines adopted (`adopted_at` set)", (fact("adopted"), None, fact("adopted")), 0,
     f"of {REPLICAS}"),
    ("requests cut by the drain bound (`handover_cut`)", (fact("cut"), None, None), 0, ""),
    ("SIGTERM → old daemon exited (drain, engines stopped)", (None, fact("exit_s"), None), 3,
     "s"),
    ("B: new daemon start, C: old daemon gone → every engine READY",
     (None, fact("ready_s"), fact("ready_s")), 3, "s"),
]


def report_upgrade(r: Report, rounds: dict[str, list[Round]], clients: int) -> None:
    r("## 4. Upgrade in place against a daemon restart and a crash, under load", "",
      f"{clients} client threads through the gateway (`/v1/completions`, alternately streamed "
      f"and not, max_tokens {MAX_TOKENS}, greedy; a client that fails closes its connection and "
      f"sends again {RETRY_S * 1e3:.0f} ms later). The window is every request that ended "
      "after the trigger; the gap is A's own `handover_s` (the old code's last accept → the "
      "new code's first), B's and C's signal → the first ok answer to a request sent after the "
      "old daemon exited. Rounds alternate A, B, C on one fleet.", "")
    head = [h for key in LABELS for h in (f"{LABELS[key]}: median", "min–max")]
    r(*table("measure", *head, f"rounds ({'/'.join(LABELS)})"))
    for label, f, digits, unit in ROWS:
        fs = f if isinstance(f, tuple) else (f,) * len(LABELS)
        values = [cells(None if fk is None else [fk(x) for x in rounds[key]], digits, unit)
                  for key, fk in zip(LABELS, fs)]
        r(f"| {label} | {' | '.join(values)} | "
          f"{'/'.join(str(len(rounds[key])) for key in LABELS)} |")
    r("", "Failed requests, per round:")
    for scenario in LABELS:
        for x in rounds[scenario]:
            failed = x.failed()
            at = [q.end - x.trigger for q in failed]
            kinds = counted(f"{q.kind} ({q.detail.split(':')[0]})" for q in failed)
            r(f"- {LABELS[scenario]}, round {x.index + 1}: " + (
                f"{kinds}; ended +{min(at):.3f} … +{max(at):.3f} s after the trigger; first: "
                f"{failed[0].detail[:160]}" if failed else "none"))
    r("")
