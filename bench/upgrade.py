"""Putting new engined code in place under load: `enginectl upgrade` against a daemon restart,
and a daemon SIGKILLed then started again (it adopts the engines).

    python -m bench.upgrade [--quick] [--rounds N] [--clients K] [--out FILE] [--cache-dir DIR]
                                     # default bench/results/upgrade.md,
                                     # --quick: bench/results/upgrade-quick.md

One fleet (2 replicas of `builtin:tiny-llama`, transformers, `supervisor.launcher: forkserver`,
the gateway and the HTTP endpoint on free loopback ports) serves K client threads that loop
`/v1/completions` through the gateway (alternately streamed and not, max_tokens 16, greedy), while
the daemon under them is replaced, in three ways that alternate round by round (A, B, C, A, ...):

- A, in place: `POST /v1/upgrade` on the control socket (what `enginectl upgrade` sends; it then
  polls status, as the bench does): the same pid re-executes engined and adopts the engines;
- B, the old way (`systemctl restart`): SIGTERM to the daemon (it drains the gateway and stops
  every engine), then a new daemon on the same spec file, runtime directory and ports;
- C, a crash: SIGKILL to the daemon, then a new daemon as in B (what systemd's Restart= does):
  the engines outlived it (`supervisor.orphan_timeout`) and the new daemon adopts them.

Each round: the clients warm up, the trigger, the load goes on until the fleet has served every
client again and then a few seconds more. Reported per scenario (median and min–max over the
rounds): the requests of the window (trigger → load stopped) by outcome, the gap (A: the daemon's
own `handover_s`; B: SIGTERM → the first ok answer to a request sent after the old daemon
exited), what the clients saw (the longest request overlapping the event, trigger → the first ok
answer, the longest time without one), whether the daemon pid and the engine processes stayed, and
B's cold start. Every process is tracked and stopped by pid; nothing is killed by name. Nothing
here asserts wall-clock speed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psutil

from bench.common import HEARTBEATS, BenchDaemon, BenchError, Cleanup, Tracker, wait_until
from bench.models import build_checkpoint
from bench.recovery.daemon import REPLICAS, tiny_backend
from bench.report import (
    DASH,
    Report,
    add_out_option,
    counted,
    cpu_busy_pct,
    engined_revision,
    load_average,
    machine_lines,
    med,
    num,
    out_path,
    spread,
    table,
    title,
)
from testkit.driver import free_port, is_engine_of

GROUP = "tiny"  # the group's name: the model name the gateway serves it under
PROMPT = "upgrade benchmark: the quick brown fox jumps over the lazy dog"
MAX_TOKENS = 16
RETRY_S = 0.05  # a client waits this long after a failed request before its next one
REQUEST_TIMEOUT_S = 120.0  # the clients' socket timeout (a bound, far above any request here)
POLL_S = 0.05  # the bench's status poll while an event runs
A, B, C = "A", "B", "C"
LABELS = {A: "A: upgrade in place", B: "B: SIGTERM + new daemon", C: "C: SIGKILL + new daemon"}
STOP_TIMEOUT = "10s"  # the spec's stop_timeout (bench.common's): bounds both drains


# --- the load -------------------------------------------------------------------------------------
@dataclass
class Req:
    start: float  # time.time() when the request was sent (its connection opened, if new)
    end: float  # when its answer was read to the end, or it failed
    kind: str  # ok | refused | reset | http | cut | timeout | other
    detail: str = ""  # the failure: HTTP status, exception type and message
    streamed: bool = False
    client: int = 0  # which client thread sent it

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


class Load:
    """K client threads, each with its own keep-alive `http.client` connection to the gateway,
    looping `/v1/completions` (alternately streamed and not) until stopped; every request is
    kept as a `Req`. After a failure a client closes its connection and waits RETRY_S."""

    def __init__(self, port: int, clients: int) -> None:
        self.port = port
        self.reqs: list[Req] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True,
                                         name=f"client-{i}") for i in range(clients)]

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(REQUEST_TIMEOUT_S + 10)
        if any(t.is_alive() for t in self.threads):
            raise BenchError("a client thread did not finish its request")

    def snapshot(self) -> list[Req]:
        with self.lock:
            return list(self.reqs)

    def _client(self, i: int) -> None:
        conn: http.client.HTTPConnection | None = None
        k = i
        while not self.stopping.is_set():
            streamed = k % 2 == 1
            k += 1
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", self.port,
                                                  timeout=REQUEST_TIMEOUT_S)
            start = time.time()
            kind, detail = self._once(conn, streamed)
            req = Req(start, time.time(), kind, detail, streamed, i)
            with self.lock:
                self.reqs.append(req)
            if not req.ok:
                conn.close()
                conn = None
                self.stopping.wait(RETRY_S)
        if conn is not None:
            conn.close()

    @staticmethod
    def _once(conn: http.client.HTTPConnection, streamed: bool) -> tuple[str, str]:
        body = json.dumps({"model": GROUP, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                           "temperature": 0, "stream": streamed})
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                text = resp.read()[:200].decode(errors="replace")
                return "http", f"HTTP {resp.status}: {text}"
            if not streamed:
                answer = json.loads(resp.read())
                return ("ok", "") if answer.get("choices") else ("other", f"no choices: {answer}")
            done = False
            for line in resp:  # SSE: `data: {...}` lines, then `data: [DONE]`
                done = done or line.strip() == b"data: [DONE]"
            return ("ok", "") if done else ("cut", "the stream ended without data: [DONE]")
        except ConnectionRefusedError as exc:
            return "refused", f"{type(exc).__name__}: {exc}"
        except (ConnectionResetError, BrokenPipeError) as exc:  # RemoteDisconnected included
            return "reset", f"{type(exc).__name__}: {exc}"
        except http.client.IncompleteRead as exc:
            return "cut", f"IncompleteRead: {exc!r}"[:200]
        except TimeoutError as exc:
            return "timeout", f"{type(exc).__name__}: {exc}"
        except (OSError, http.client.HTTPException, ValueError) as exc:
            return "other", f"{type(exc).__name__}: {exc}"[:200]


# --- the fleet ------------------------------------------------------------------------------------
class Fleet(BenchDaemon):
    """engined with 2 tiny-llama replicas (bench.recovery's), `supervisor.launcher:
    forkserver`, the gateway and `http:` on free loopback ports, in /tmp/euXXXXXXXX. One object
    for the whole run: B restarts it on the same spec file, runtime directory and ports."""

    log_lines = 30

    def __init__(self, cache: Path, tracker: Tracker) -> None:
        self.gateway_port, self.http_port = free_port(), free_port()
        super().__init__("eu", tracker, [tiny_backend(cache).spec],
                         http=f"127.0.0.1:{self.http_port}", status_timeout_s=30.0,
                         supervisor={"gateway": f"127.0.0.1:{self.gateway_port}",
                                     "launcher": "forkserver"})
        self.log_engines = (f"{GROUP}-0",)
        self.pids: list[int] = []  # every daemon pid, in order

    def start(self, timeout_s: float | None = None, interval_s: float | None = None) -> None:
        try:
            super().start(timeout_s or 300.0, interval_s or POLL_S)
        finally:
            if self.proc is not None and self.proc.pid not in self.pids:
                self.pids.append(self.proc.pid)

    def identity(self) -> tuple[dict[str, tuple[int, float, int, int]], set[int]]:
        """Per engine: (pid, the process's start time, incarnation, restarts); and the pids of
        the fork servers."""
        out = {}
        status = self.status()
        servers = {s["pid"] for s in status["supervisor"].get("fork_servers") or []
                   if s.get("pid")}
        for pid in servers:
            self.server_pids.add(pid)
            self.tracker.add(pid)
        for e in status["engines"]:
            if e["pid"] is not None:
                self.tracker.add(e["pid"])
                out[e["name"]] = (e["pid"], psutil.Process(e["pid"]).create_time(),
                                  e["incarnation"], e["restarts"])
        return out, servers

    def metric(self, name: str) -> float | None:
        """One sample's value from GET /metrics on the `http:` port (None if absent)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics",
                                    timeout=30) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.rsplit(" ", 1)[1])
        return None


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

    def silence(self, warmup: bool = False) -> float | None:
        """The longest time without any ok answer: in the window from the trigger on, or in
        the warm-up from its first ok answer on."""
        if warmup:
            ends = sorted(q.end for q in self.warmup if q.ok)
            ends += [self.trigger] if ends else []
        else:
            ends = [self.trigger] + sorted(q.end for q in self.window if q.ok) + [self.stopped]
        return max((b - a for a, b in zip(ends, ends[1:])), default=None)

    def rate(self, warmup: bool = False) -> float | None:
        """ok answers per second: in the warm-up (first to last ok answer), or in the window."""
        if warmup:
            ends = sorted(q.end for q in self.warmup if q.ok)
            return (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 else None
        ok = sum(1 for q in self.window if q.ok)
        return ok / (self.stopped - self.trigger)

    def median_request(self) -> float | None:
        return med([q.end - q.start for q in self.warmup if q.ok])


def load_round(d: Fleet, clients: int, warmup_s: float, settle_s: float,
               event: Any) -> tuple[float, float, float, list[Req], dict[str, float | None]]:
    """Warm up under load, run `event` (returns its trigger and done times and its facts), keep
    the load until every client was served after it, then `settle_s` more."""
    load = Load(d.gateway_port, clients).start()
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
        load.stop()
    return trigger, done, stopped, load.snapshot(), facts


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
        "metric_s": d.metric("engined_handover_seconds"),
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
def cells(values: Iterable[float | None] | None, digits: int, unit: str) -> str:
    """`median | min–max` of the values that are there; – for a row a scenario does not have."""
    if values is None:
        return f"{DASH} | {DASH}"
    vals = [v for v in values if v is not None]
    if not vals:
        return f"{DASH} | {DASH}"
    return f"{num(statistics.median(vals), digits, unit)} | {spread(vals, digits, unit)}"


def report_rows(r: Report, rounds: dict[str, list[Round]],
                rows: list[tuple[str, Any, int, str]]) -> None:
    """One row per (label, f(round) for every scenario or a tuple of one per scenario, A B C,
    None where a scenario does not have it, digits, unit)."""
    head = [h for key in LABELS for h in (f"{LABELS[key]}: median", "min–max")]
    r(*table("measure", *head, f"rounds ({'/'.join(LABELS)})"))
    for label, f, digits, unit in rows:
        fs = f if isinstance(f, tuple) else (f,) * len(LABELS)
        values = [cells(None if fk is None else [fk(x) for x in rounds[key]], digits, unit)
                  for key, fk in zip(LABELS, fs)]
        r(f"| {label} | {' | '.join(values)} | "
          f"{'/'.join(str(len(rounds[key])) for key in LABELS)} |")
    r("")


def fact(key: str) -> Any:
    return lambda x: x.facts.get(key)


REQUEST_ROWS = [
    ("requests in the window (trigger → load stopped)", lambda x: len(x.window), 0, ""),
    ("… answered ok", lambda x: sum(q.ok for q in x.window), 0, ""),
    ("… failed, all kinds", lambda x: len(x.failed()), 0, ""),
    ("… connection refused", lambda x: len(x.failed("refused")), 0, ""),
    ("… connection reset or closed without an answer", lambda x: len(x.failed("reset")), 0, ""),
    ("… HTTP error status", lambda x: len(x.failed("http")), 0, ""),
    ("… stream cut, timeout or other error",
     lambda x: sum(len(x.failed(k)) for k in ("cut", "timeout", "other")), 0, ""),
    ("failed before the trigger (warm-up)", lambda x: sum(not q.ok for q in x.warmup), 0, ""),
    ("ok answers/s in the warm-up", lambda x: x.rate(warmup=True), 1, "/s"),
    ("ok answers/s in the window", lambda x: x.rate(), 1, "/s"),
]
STALL_ROWS = [
    ("the gap (A: `handover_s`; B, C: the signal → first ok answer from the new daemon)",
     fact("gap_s"), 3, "s"),
    ("trigger → event done (A: status shows the hand-over; B, C: new daemon, every engine "
     "READY)", lambda x: x.done - x.trigger, 3, "s"),
    ("trigger → first ok answer (any request)", lambda x: x.first_ok(), 3, "s"),
    ("trigger → first ok answer to a request sent after the trigger",
     lambda x: x.first_ok(sent_after=x.trigger), 3, "s"),
    ("longest request overlapping the event", lambda x: x.longest_overlapping(), 3, "s"),
    ("longest time without an ok answer, window", lambda x: x.silence(), 3, "s"),
    ("… the same in the warm-up (for scale)", lambda x: x.silence(warmup=True), 3, "s"),
    ("request time in the warm-up (median)", lambda x: x.median_request(), 3, "s"),
]
FLEET_ROWS = [
    ("daemon pid kept (1 = yes)", fact("daemon_kept"), 0, ""),
    ("engines kept (same pid and start time)", lambda x: x.engines_kept, 0, f"of {REPLICAS}"),
    ("fork servers kept (same pid)", lambda x: len(x.servers_before & x.servers_after), 0, ""),
    ("engine restarts the daemon counted in the round (B: a new daemon counts from 0)",
     (lambda x: x.restarts, lambda x: x.restarts, fact("restarts")), 0, ""),
    ("engines adopted (`adopted_at` set)", (fact("adopted"), None, fact("adopted")), 0,
     f"of {REPLICAS}"),
    ("POST /v1/upgrade → 202 (the new code's check)", (fact("accepted_s"), None, None), 3, "s"),
    ("requests cut by the drain bound (`handover_cut`)", (fact("cut"), None, None), 0, ""),
    ("`engined_handover_seconds` (/metrics)", (fact("metric_s"), None, None), 3, "s"),
    ("SIGTERM → old daemon exited (drain, engines stopped)", (None, fact("exit_s"), None), 3,
     "s"),
    ("engines of the old daemon alive after it exited", (None, fact("orphans"), None), 0, ""),
    ("engines' `startup_s` (spawn → READY, median of the replicas)",
     (None, fact("startup_s"), None), 3, "s"),
    ("old daemon gone → every engine READY under the new one", (None, None, fact("ready_s")),
     3, "s"),
    ("new daemon start → every engine READY (`since`)", (None, fact("ready_s"), None), 3, "s"),
]


def report_failures(r: Report, rounds: dict[str, list[Round]]) -> None:
    r("## 4. Failed requests, one line per round", "")
    for scenario in LABELS:
        for x in rounds[scenario]:
            failed = x.failed()
            if not failed:
                r(f"- {LABELS[scenario]}, round {x.index + 1}: none")
                continue
            at = [q.end - x.trigger for q in failed]
            kinds = counted(f"{q.kind} ({q.detail.split(':')[0]})" for q in failed)
            r(f"- {LABELS[scenario]}, round {x.index + 1}: {kinds}; ended at "
              f"+{min(at):.3f} … +{max(at):.3f} s after the trigger; first: "
              f"{failed[0].detail[:160]}")
    r("")


def report(r: Report, rounds: dict[str, list[Round]], clients: int, warmup_s: float,
           settle_s: float) -> None:
    r("## 1. Requests through the gateway, trigger → load stopped", "")
    report_rows(r, rounds, REQUEST_ROWS)
    r("## 2. The gap and what the clients saw", "")
    report_rows(r, rounds, STALL_ROWS)
    r("## 3. The engines and the daemon", "")
    report_rows(r, rounds, FLEET_ROWS)
    report_failures(r, rounds)
    r("## Method", "",
      f"One daemon (its spec file, runtime directory and ports) serves the whole run: "
      f"{REPLICAS} replicas of `builtin:tiny-llama` (transformers, 1 thread, max_batch_size 8) "
      f"under `supervisor.launcher: forkserver`, the gateway and `http:` on free loopback ports, "
      f"`stop_timeout` {STOP_TIMEOUT} (the drain bound of both A and B). Rounds alternate A, B, "
      f"C, A, ...; A upgrades the running daemon in place, B SIGTERMs it, waits for its exit "
      f"(it drains the gateway and stops every engine) and starts a new daemon on the same spec "
      f"at once, as `systemctl restart` would; C SIGKILLs it and starts a new daemon at once, "
      f"as systemd's Restart= would after a crash (the engines outlive it by "
      f"`supervisor.orphan_timeout`, default 60 s, and are adopted; what was in flight through "
      f"the dead daemon's gateway is lost with it); the next round runs on whatever the last "
      f"one left. A round: {clients} client threads (one keep-alive `http.client` connection each) "
      f"loop `POST /v1/completions` through the gateway, alternately streamed (SSE read to "
      f"`data: [DONE]`) and not (the JSON must have `choices`), `max_tokens` {MAX_TOKENS}, "
      f"greedy; a client that fails closes its connection and sends again after "
      f"{RETRY_S * 1e3:.0f} ms (so the count of refused connections is set by that pace). "
      f"Once every client has had answers, {warmup_s:g} s of warm-up, then the trigger (A: "
      f"`POST /v1/upgrade` on the control socket, what `enginectl upgrade` sends before it "
      f"polls status; B: SIGTERM; C: SIGKILL), then the load goes on until every client has "
      f"been answered after the event was done (A: a {POLL_S * 1e3:.0f} ms status poll shows "
      f"`handovers` counted up; B, C: the new daemon has every engine READY) and "
      f"{settle_s:g} s more. The "
      f"window is every request that ended after the trigger. The gap: A, the daemon's own "
      f"`handover_s` (the old code's last accept → the new code's first); B and C, the signal → "
      f"the first ok answer to a request sent after the old daemon exited. \"Longest request "
      f"overlapping the event\": of the requests running at some time between the trigger and "
      f"the event done, the longest (any outcome). \"Longest time without an ok answer\": the "
      f"largest interval between consecutive ok answers of all clients, from the trigger to the "
      f"end of the load. Engines kept: same pid and same process start time "
      f"(`/proc/PID/stat`) before and after. Times are the bench's `time.time()` (the "
      f"daemon's `since` for READY); nothing is asserted about speed.", "")


# --- the run --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.upgrade",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 round of each scenario, 4 clients, shorter warm-up")
    add_out_option(parser, "upgrade")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of each scenario (default 5; --quick: 1)")
    parser.add_argument("--clients", type=int, default=None,
                        help="client threads (default 8; --quick: 4)")
    parser.add_argument("--cache-dir", default=None,
                        help="ENGINED_CACHE_DIR for the model (default: a fresh temporary one)")
    args = parser.parse_args(argv)
    n = args.rounds or (1 if args.quick else 5)
    clients = args.clients or (4 if args.quick else 8)
    warmup_s, settle_s = (2.0, 2.0) if args.quick else (4.0, 3.0)
    out = out_path(args, "upgrade")

    r, tracker = Report(), Tracker()
    cleanup = Cleanup(tracker)
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="engined-bench-cache-"))
    if args.cache_dir is None:
        cleanup.dirs.append(cache)
    rounds: dict[str, list[Round]] = {key: [] for key in LABELS}
    cpu_start = psutil.cpu_times()
    d: Fleet | None = None
    try:
        r(title("engined upgrade benchmark: in place vs a daemon restart vs a crash, under load",
                args.quick), "", *machine_lines(), engined_revision(), load_average("start"))
        checkpoint = build_checkpoint(cache)  # untimed, exactly as an engine would on first use
        r(f"- fleet: {REPLICAS} replicas of builtin:tiny-llama ({checkpoint.name}; torch "
          f"{version('torch')}, transformers {version('transformers')}; float32, CPU, threads "
          f"1, max_batch_size 8), `supervisor.launcher: forkserver`, gateway and `http:` on "
          f"loopback; heartbeats every {HEARTBEATS['heartbeat_interval']}, stop_timeout "
          f"{STOP_TIMEOUT}",
          f"- load: {clients} client threads through the gateway, `/v1/completions` alternately "
          f"streamed and not, max_tokens {MAX_TOKENS}, greedy; warm-up {warmup_s:g} s, "
          f"{settle_s:g} s after every client was served again",
          f"- rounds: {n} of each scenario, alternating A, B, C, A, ... on one fleet", "")
        d = cleanup.start(Fleet(cache, tracker))
        for i in range(n):
            for scenario in LABELS:
                rounds[scenario].append(run_round(d, scenario, i, clients, warmup_s, settle_s))
    finally:
        leftovers = cleanup.close()

    busy = cpu_busy_pct(cpu_start)
    report(r, rounds, clients, warmup_s, settle_s)
    pids = ", ".join(str(p) for p in (d.pids if d is not None else []))
    r(f"- daemon pids: {pids}",
      f"{load_average('end')}; all CPUs {busy:.0f} % busy during the run; processes left "
      f"over and killed by pid: {leftovers or 'none'}"
      + (f"; {d.stop_note}" if d is not None and d.stop_note else ""))
    r.write(out)
    return 0  # a report, not a gate


if __name__ == "__main__":
    sys.exit(main())
