"""Pure supervision policy: exit classification, restart decisions, backoff, start limit, liveness.

Nothing here performs I/O or reads a clock: `now` (CLOCK_MONOTONIC seconds) and every input are
passed in, decisions come back as values. The tests are tables.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import math
from dataclasses import dataclass, field

from engined.engine.contract import EXIT_CONFIG
from engined.supervisor.host.exits import ExitStatus
from engined.supervisor.lifecycle.pauses import NO_PAUSES, Pauses
from engined.supervisor.lifecycle.state import Reason
from engined.supervisor.spec.model import BackoffSpec, StartLimitSpec


def exit_reason(status: ExitStatus, killed_for: Reason | None = None) -> Reason:
    """The reason recorded for an exit. If we killed it (hang, stall, ...), that reason wins."""
    if killed_for is not None:
        return killed_for
    if status.signal_name is not None:
        return Reason.SIGNAL
    return Reason.EXIT


class Action(enum.Enum):
    RESTART = "restart"  # after `delay_s` (0 = at once)
    FAIL = "fail"  # FAILED: stays down until an operator starts it
    STOP = "stop"  # STOPPED: the engine is done (clean exit not to be restarted)


@dataclass(frozen=True)
class Decision:
    action: Action
    delay_s: float = 0.0
    why: str = ""


@dataclass(frozen=True)
class FailureHistory:
    """Consecutive failures (for backoff) and failure times (for the start-limit window), and
    consecutive spawns refused for lack of resources (backoff only: never a start-limit count)."""

    consecutive: int = 0
    failure_times: tuple[float, ...] = field(default_factory=tuple)
    shortages: int = 0


def backoff_delay(consecutive: int, backoff: BackoffSpec, jitter_unit: float) -> float:
    """Delay before restart number `consecutive` (1-based) of a run of failures.

    The first is immediate: a one-off crash costs only the respawn. The k-th waits
    initial * factor^(k-2), capped at max, then scaled by 1 ± jitter (jitter_unit in [-1, 1]).
    """
    if consecutive <= 1:
        return 0.0
    exponent = consecutive - 2
    # Guard the power: factor**exponent overflows float long before anyone waits that long.
    raw = backoff.initial_s * math.pow(backoff.factor, min(exponent, 1000)) \
        if backoff.factor > 1 else backoff.initial_s
    capped = min(raw, backoff.max_s) if math.isfinite(raw) else backoff.max_s
    return max(0.0, capped * (1.0 + backoff.jitter * max(-1.0, min(1.0, jitter_unit))))


def record_failure(now: float, history: FailureHistory, ready_since: float | None,
                   backoff: BackoffSpec, start_limit: StartLimitSpec) -> FailureHistory:
    """Add one failure at `now`; a stable READY run of reset_after first clears the streak."""
    consecutive = history.consecutive
    if ready_since is not None and now - ready_since >= backoff.reset_after_s:
        consecutive = 0
    window_start = now - start_limit.interval_s
    times = tuple(t for t in history.failure_times if t > window_start) + (now,)
    return FailureHistory(consecutive + 1, times)


# errnos that mean "the machine is short of something right now" (fds, memory, processes): a
# spawn that fails with one of them is retried with backoff and never counts toward the start
# limit (a two-minute shortage must not park the fleet FAILED). Anything else (ENOENT, EACCES,
# ENOEXEC: a bad interpreter) is a failure like a crash.
SHORTAGE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN,
                             errno.ENOSPC})


def is_shortage(err: int | None) -> bool:
    return err in SHORTAGE_ERRNOS


def decide_spawn_failure(now: float, err: int | None, why: str, history: FailureHistory,
                         backoff: BackoffSpec, start_limit: StartLimitSpec,
                         jitter_unit: float) -> tuple[Decision, FailureHistory]:
    """What to do when a child could not be started at all (posix_spawn, pipe2, pidfd_open
    failed, or the daemon held its spawn back to keep a resource reserve)."""
    if is_shortage(err):
        history = dataclasses.replace(history, shortages=history.shortages + 1)
        # a shortage is never "immediate": the first retry waits `initial` (at least 1 s)
        delay = backoff_delay(history.shortages + 1, backoff, jitter_unit)
        return Decision(Action.RESTART, max(delay, 1.0),
                        f"{why}: a resource shortage, retried (not counted toward the start "
                        f"limit)"), history
    history = record_failure(now, history, None, backoff, start_limit)
    if len(history.failure_times) > start_limit.burst:
        return Decision(Action.FAIL, why=f"{why}; start limit hit: "
                                         f"{len(history.failure_times)} failures within "
                                         f"{start_limit.interval_s:g}s"), history
    delay = backoff_delay(history.consecutive, backoff, jitter_unit)
    return Decision(Action.RESTART, delay, f"{why} (failure {history.consecutive} in a row)"), \
        history


def decide(now: float, restart: str, status: ExitStatus, reason: Reason,
           history: FailureHistory, ready_since: float | None, backoff: BackoffSpec,
           start_limit: StartLimitSpec, jitter_unit: float) -> tuple[Decision, FailureHistory]:
    """What to do after an unexpected exit (not one an operator asked for)."""
    if status.code == EXIT_CONFIG:
        return Decision(Action.FAIL, why="exit 78: invalid engine config or model"), history
    failed = not (status.clean and reason is Reason.EXIT)
    if not failed and restart != "always":
        return Decision(Action.STOP, why=f"clean exit, restart={restart}"), history
    # restart=always: an exit nobody asked for is a failure whatever its code. An engine server
    # may exit 0 after its engine died (vLLM's API server does): restarting that at once, with
    # no backoff and no start limit, would be an endless loop of model loads.
    if restart == "never":
        return Decision(Action.FAIL, why="failed, restart=never"), history
    history = dataclasses.replace(
        record_failure(now, history, ready_since, backoff, start_limit), shortages=0)
    if len(history.failure_times) > start_limit.burst:
        why = (f"start limit hit: {len(history.failure_times)} failures within "
               f"{start_limit.interval_s:g}s (burst {start_limit.burst})")
        return Decision(Action.FAIL, why=why), history
    delay = backoff_delay(history.consecutive, backoff, jitter_unit)
    what = "clean exit, restart=always, counted as a failure: " if not failed else ""
    return Decision(Action.RESTART, delay, f"{what}failure {history.consecutive} in a row"), \
        history


# asyncio runs a timer up to its clock's resolution early; a deadline that close is reached
# (otherwise a watcher would re-arm a near-zero timer until the clock catches up).
DEADLINE_SLACK_S = 1e-6


def reached(now: float, deadline: float) -> bool:
    return now >= deadline - DEADLINE_SLACK_S


@dataclass(frozen=True)
class Liveness:
    """What the daemon knows about one engine's liveness at `now`."""

    starting: bool  # True while STARTING, False while READY
    spawned_at: float
    startup_timeout_s: float
    last_heartbeat_at: float  # daemon receive time of the last heartbeat (or READY time)
    heartbeat_timeout_s: float
    last_iteration_at: float  # the busy loop's own progress stamp, from the last heartbeat
    work_queued: bool  # requests waiting or running in the last heartbeat
    stall_timeout_s: float
    pauses: Pauses = NO_PAUSES  # the daemon's own pauses: every deadline moves back by them
    judge_after: float = float("-inf")  # no verdict before (right after a pause of the daemon)
    over_limit_since: float | None = None  # its heartbeats say it holds more than memory_limit
    # last_iteration_at is the busy loop's own stamp, idle or not (engined's own engines: an
    # idle loop wakes every 0.5 s), so a loop that stopped while idle is seen too
    idle_loop: bool = False


# An engine over its memory_limit for this long (every heartbeat meanwhile saying so) is
# restarted with the reason `memory`: longer than a step's passing peak, far shorter than the
# kernel's OOM killer takes to find it
MEMORY_GRACE_S = 3.0
# An idle engine's busy loop that has not come round for max(stall_timeout, this) is stalled: it
# wakes every 0.5 s while idle, but its heartbeats come from a thread of their own and would go
# on; a client's request would meet it only after stall_timeout more
IDLE_LOOP_FLOOR_S = 15.0


def check_liveness(now: float, live: Liveness) -> tuple[Reason | None, float]:
    """Return (reason to kill, or None; the time at which to check again)."""
    if not reached(now, live.judge_after):
        return None, live.judge_after  # let what queued during the pause be read first
    pauses = live.pauses
    if live.starting:
        deadline = live.spawned_at + live.startup_timeout_s + pauses.after(live.spawned_at)
        return (Reason.STARTUP_TIMEOUT if reached(now, deadline) else None), deadline
    last_seen = live.last_heartbeat_at
    hb_deadline = last_seen + live.heartbeat_timeout_s + pauses.after(last_seen)
    if reached(now, hb_deadline):
        return Reason.HANG, hb_deadline
    if live.over_limit_since is not None:
        over = live.over_limit_since
        memory_deadline = over + MEMORY_GRACE_S + pauses.after(over)
        if reached(now, memory_deadline):
            return Reason.MEMORY, memory_deadline
        hb_deadline = min(hb_deadline, memory_deadline)
    if live.work_queued:
        last_step = live.last_iteration_at
        stall_deadline = last_step + live.stall_timeout_s + pauses.after(last_step)
        if reached(now, stall_deadline):
            return Reason.STALL, stall_deadline
        return None, min(hb_deadline, stall_deadline)
    if live.idle_loop:
        last_step = live.last_iteration_at
        idle_deadline = (last_step + max(live.stall_timeout_s, IDLE_LOOP_FLOOR_S)
                         + pauses.after(last_step))
        if reached(now, idle_deadline):
            return Reason.STALL, idle_deadline
        return None, min(hb_deadline, idle_deadline)
    return None, hb_deadline
