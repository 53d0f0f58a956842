"""Scenarios 1 and 2: every supervisor side by side, killed in turn: respawn latency (SIGKILL → the
replacement exists, the kernel's fork event) and detection latency (SIGKILL → the supervisor's own
record of the exit), and engined's kill → READY against the floor's echo engine. The supervisors:
engined (an echo engine), the floor (a sleeping child and the echo engine child), supervisord
(piped, not piped, the echo engine child) and circus (default check_delay and 0.1 s); kills are
observed as bench.core observes them.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import Cleanup, wait_until
from bench.compare.labels import (
    CIRCUS,
    CIRCUS_FAST,
    ENGINED,
    FLOOR,
    FLOOR_ECHO,
    PEER_ROWS,
    SV,
    SV_ECHO,
    SV_NOPIPE,
)
from bench.core import (
    SETTLE_S,
    Engined,
    Floor,
    Kill,
    ProcEvents,
    ReadyListener,
    engine_child_env,
    engined_kill_once,
    engined_kill_to_ready,
    floor_kill_once,
    floor_kill_to_ready,
    kill_once,
)
from bench.peers import Circus, Supervisord
from bench.report import Report, med, ms_auto, ms_range, ratio, times

PEER_KILL_TIMEOUT_S = 20.0  # circus at its default check_delay (5 s) reaps only on its timer


# --- the runners ----------------------------------------------------------------------------------
class Subject:
    """One supervisor in the latency scenarios: how to kill its child once and read the result."""

    def __init__(self, label: str, thing, kill: Callable[[], Kill]) -> None:
        self.label, self.thing, self.kill = label, thing, kill
        self.kills: list[Kill] = []


def supervisord_kill_once(s: Supervisord, events: ProcEvents | None, rng: random.Random) -> Kill:
    victim = s.victim()  # RUNNING (the status request itself wakes supervisord's loop)
    # supervisord's loop sleeps in poll(timeout=1 s) from its last wake-up, and our status request
    # was one: a fixed pause would always land at the same phase of its timer. Randomise it.
    time.sleep(rng.uniform(0.0, 1.0))
    k = kill_once(s.pid, victim, events, PEER_KILL_TIMEOUT_S)
    logged = wait_until(lambda: s.exit_logged(k.t_wall), 5.0, f"{s.label}: `exited:` log line")
    k.detect_s = logged - k.t_wall
    if s.has_listener:
        notified = wait_until(lambda: s.exit_notified(victim), 5.0,
                              f"{s.label}: PROCESS_STATE_EXITED at the listener")
        k.notify_s = notified - k.t_wall
    return k


def circus_kill_once(c: Circus, events: ProcEvents | None, rng: random.Random) -> Kill:
    victim = c.victim()
    # circus reaps and respawns only on its check_delay timer, whose phase our kill cadence
    # would otherwise lock onto: kill at a random phase of it.
    time.sleep(rng.uniform(0.0, c.check_delay))
    k = kill_once(c.pid, victim, events, PEER_KILL_TIMEOUT_S)
    wait_until(lambda: victim in c.reaped, 10.0, f"{c.label}: reap event")
    k.detect_s = c.reaped[victim] - k.t_wall
    k.notify_s = c.reap_received[victim] - k.t_wall
    return k


def latency_scenarios(cleanup: Cleanup, events: ProcEvents | None,
                      venvs: dict[str, Path | None], rng: random.Random, n: int) -> dict:
    """Every supervisor started side by side, each killed n times in turn (scenarios 1 and 2);
    then engined and the floor's echo engine killed in turn, to READY."""
    tracker = cleanup.tracker
    sv_venv, circus_venv = venvs["supervisord"], venvs["circus"]
    res: dict = {}
    listener = ReadyListener(cleanup)
    daemon = Engined(1, tracker)
    floor = Floor(1, tracker)
    floor_echo = Floor(1, tracker, [sys.executable, "-m", "engined.engine"],
                       engine_child_env(listener))
    subjects = [Subject(ENGINED, daemon, lambda: engined_kill_once(daemon, tracker, events)),
                Subject(FLOOR, floor, lambda: floor_kill_once(floor, events)),
                Subject(FLOOR_ECHO, floor_echo, lambda: floor_kill_once(floor_echo, events))]
    if sv_venv:
        sv = Supervisord(sv_venv, 1, tracker, label=SV)
        sv_np = Supervisord(sv_venv, 1, tracker, piped=False, label=SV_NOPIPE)
        # the same echo engine child engined runs, against a READY listener of its own
        sv_listener = ReadyListener(cleanup)
        sv_echo = Supervisord(sv_venv, 1, tracker, label=SV_ECHO,
                              child_env=engine_child_env(sv_listener))
        subjects += [Subject(SV, sv, lambda: supervisord_kill_once(sv, events, rng)),
                     Subject(SV_ECHO, sv_echo,
                             lambda: supervisord_kill_once(sv_echo, events, rng)),
                     Subject(SV_NOPIPE, sv_np,
                             lambda: supervisord_kill_once(sv_np, events, rng))]
    if circus_venv:
        cc = Circus(circus_venv, 1, tracker, None, CIRCUS)
        cf = Circus(circus_venv, 1, tracker, 0.1, CIRCUS_FAST)
        subjects += [Subject(CIRCUS, cc, lambda: circus_kill_once(cc, events, rng)),
                     Subject(CIRCUS_FAST, cf, lambda: circus_kill_once(cf, events, rng))]
    for s in subjects:
        if hasattr(s.thing, "remove_dir") and hasattr(s.thing, "dir"):
            cleanup.dirs.append(s.thing.dir)  # removed at the end, whenever it stopped
        cleanup.start(s.thing)
    time.sleep(1.0)
    for _ in range(n):
        for s in subjects:
            time.sleep(SETTLE_S)
            s.kills.append(s.kill())
    res["kills"] = {s.label: s.kills for s in subjects}
    for s in subjects:
        if s.thing not in (daemon, floor_echo):
            cleanup.stop(s.thing)

    # kill → READY: engined and the floor's echo engine in turn, quiet observer
    ready, floor_ready = [], []
    for _ in range(n):
        time.sleep(SETTLE_S)
        ready.append(engined_kill_to_ready(daemon, tracker, None))
        time.sleep(SETTLE_S)
        floor_ready.append(floor_kill_to_ready(floor_echo, listener))
    cleanup.stop(floor_echo)
    cleanup.stop(daemon)
    daemon.remove_dir()
    res.update(ready=ready, floor_ready=floor_ready)
    return res


# --- report ---------------------------------------------------------------------------------------
def kill_rows(kills: dict[str, list[Kill]]) -> list[str]:
    """The supervisors that ran, in the tables' order."""
    return [k for k in (ENGINED, FLOOR, FLOOR_ECHO, *PEER_ROWS) if k in kills]


def kill_med(kills: dict[str, list[Kill]], label: str, attr: str) -> float | None:
    """The median of `attr` over `label`'s kills (None if that supervisor did not run)."""
    return med([getattr(k, attr) for k in kills[label]]) if label in kills else None


def kill_share(kills: dict[str, list[Kill]], label: str, attr: str) -> float | None:
    """The same, counted from the victim's kernel exit event: the supervisor's own share."""
    return med([getattr(k, attr) - k.exit_s for k in kills.get(label, [])
                if getattr(k, attr) is not None and k.exit_s is not None])


def report_respawn(r: Report, res: dict, proc_events: bool) -> None:
    """Scenario 1 and engined's kill → READY."""
    kills: dict[str, list[Kill]] = res["kills"]
    rows = kill_rows(kills)

    def m(label: str, attr: str) -> float | None:
        return kill_med(kills, label, attr)

    def share(label: str, attr: str) -> float | None:
        return kill_share(kills, label, attr)

    r("## 1. Respawn latency (SIGKILL → replacement process exists)", "",
      "| supervisor | median | min – max | n | this ÷ engined | victim gone (kernel) → "
      "replacement forked |", "| --- | --- | --- | --- | --- | --- |")
    e_resp = m(ENGINED, "respawn_s")
    for label in rows:
        vals = [k.respawn_s for k in kills[label]]
        r(f"| {label} | {ms_auto(med(vals))} | {ms_range(vals)} | {len(vals)} | "
          f"{times(ratio(med(vals), e_resp))} | {ms_auto(share(label, 'respawn_s'))} |")
    r("", "\"Exists\" = " + (
        "the kernel's fork event of a new process whose parent is the supervisor."
        if proc_events else "the polling observer first saw a new child of the supervisor.") +
      " Restart delay is 0 everywhere: engined `backoff.initial: 0s` (and no start limit), "
      "supervisord `autorestart=true, startsecs=0`, circus `respawn = true, warmup_delay = 0`. "
      "The floor respawns inside its pidfd callback. The last column starts at the kernel's exit "
      "event of the victim and so leaves out the teardown of the killed process (an echo engine "
      "takes longer to die than a sleeping interpreter).", "")
    ready, floor_ready = res["ready"], res["floor_ready"]
    r("### Kill → READY (echo engine)", "", "| measure | median | min – max | n |",
      "| --- | --- | --- | --- |",
      "| engined: SIGKILL → READY (the daemon's `since`) | "
      f"{ms_auto(med([x['since_s'] for x in ready]))}"
      f" | {ms_range([x['since_s'] for x in ready])} | {len(ready)} |",
      f"| … of which spawn → READY (`startup_s`) | "
      f"{ms_auto(med([x['startup_s'] for x in ready]))} | "
      f"{ms_range([x['startup_s'] for x in ready])} | {len(ready)} |",
      f"| floor, echo engine child: SIGKILL → its READY received by the bench | "
      f"{ms_auto(med([x['since_s'] for x in floor_ready]))} | "
      f"{ms_range([x['since_s'] for x in floor_ready])} | {len(floor_ready)} |", "",
      "No peer has a notion of READY: for them the replacement existing is all there is "
      "(their \"RUNNING\"/\"active\" is a process that exists).", "")



def report_detection(r: Report, res: dict) -> None:
    """Scenario 2."""
    kills: dict[str, list[Kill]] = res["kills"]
    rows = kill_rows(kills)

    def m(label: str, attr: str) -> float | None:
        return kill_med(kills, label, attr)

    def share(label: str, attr: str) -> float | None:
        return kill_share(kills, label, attr)

    r("## 2. Detection latency (SIGKILL → the supervisor's own record of the exit)", "",
      "| supervisor | the record | median | min – max | n | this ÷ engined | SIGKILL → victim "
      "gone (kernel) | victim gone → recorded |",
      "| --- | --- | --- | --- | --- | --- | --- | --- |")
    gone = {label: ms_auto(m(label, "exit_s")) for label in rows}
    record = {ENGINED: "`last_exit.at` (GET /v1/status)", FLOOR: "its `exit` line",
              FLOOR_ECHO: "its `exit` line", SV: "`exited:` log line",
              SV_ECHO: "`exited:` log line",
              SV_NOPIPE:
              "`exited:` log line", CIRCUS: "`reap` event's `time` (pub-sub)",
              CIRCUS_FAST: "`reap` event's `time` (pub-sub)"}
    e_det = m(ENGINED, "detect_s")
    for label in rows:
        vals = [k.detect_s for k in kills[label]]
        r(f"| {label} | {record[label]} | {ms_auto(med(vals))} | {ms_range(vals)} | "
          f"{len(vals)} | {times(ratio(med(vals), e_det))} | {gone[label]} | "
          f"{ms_auto(share(label, 'detect_s'))} |")
        if label in (SV, SV_ECHO, SV_NOPIPE):
            vals = [k.notify_s for k in kills[label]]
            r(f"| {label} | event listener receives PROCESS_STATE_EXITED | {ms_auto(med(vals))} | "
              f"{ms_range(vals)} | {len(vals)} | {times(ratio(med(vals), e_det))} | "
              f"{gone[label]} | {ms_auto(share(label, 'notify_s'))} |")
    r("", "supervisord stamps log lines in milliseconds; it runs here through a 10-line shim "
      "(bench/peers.py) that prints the same `time.time()` its line is stamped with in "
      "microseconds, nothing else changed. The kernel columns split each detection at the "
      "victim's exit event: first the killed process's own teardown (which no supervisor "
      "controls: an echo engine, with its threads and ZeroMQ sockets, takes longer to die than "
      "a sleeping interpreter), then the supervisor's own reaction. "
      "Its event listener is a separate process speaking "
      "supervisord's listener protocol that writes `time.time()` when an event's header "
      "arrives. circus publishes `watcher.<name>.reap` with the `time.time()` of its reap; "
      "the bench subscribes to that stream. Kills land at random phases of the peers' timers: "
      "supervisord's waits a random 0–1 s after its child was seen RUNNING (its loop sleeps in "
      "a 1 s poll), circus's a random 0–check_delay.", "")

