"""Pure supervision policy: exit classification, restart decisions, backoff, start limit, liveness.

Nothing here performs I/O or reads a clock: `now` (CLOCK_MONOTONIC seconds) and every input are
passed in, decisions come back as values. The tests are tables.
"""

from __future__ import annotations

import enum
import math
import os
import signal
from dataclasses import dataclass, field

from engined.engine.contract import EXIT_CONFIG
from engined.supervisor.spec import BackoffSpec, StartLimitSpec


class Reason(enum.Enum):
    """Why an engine (re)started or went down; used in metrics, status and logs."""

    EXIT = "exit"
    SIGNAL = "signal"
    HANG = "hang"
    STALL = "stall"
    STARTUP_TIMEOUT = "startup_timeout"
    GROUP = "group"
    MANUAL = "manual"
    RELOAD = "reload"


@dataclass(frozen=True)
class ExitStatus:
    """How a child ended: exactly one of `code` and `signal` is set."""

    code: int | None = None
    signal: int | None = None

    @classmethod
    def from_wait_status(cls, status: int) -> ExitStatus:
        if os.WIFSIGNALED(status):
            return cls(signal=os.WTERMSIG(status))
        return cls(code=os.waitstatus_to_exitcode(status))

    @property
    def signal_name(self) -> str | None:
        """The killing signal, or the one behind a 128+N exit after cleanup (143 -> SIGTERM)."""
        num = self.signal
        if num is None and self.code is not None and 128 < self.code < 128 + 65:
            num = self.code - 128
        if num is None:
            return None
        try:
            return signal.Signals(num).name
        except ValueError:
            return f"SIG{num}"

    @property
    def clean(self) -> bool:
        return self.code == 0

    def describe(self, unexpected: bool = True) -> str:
        """`unexpected`: nobody here sent the signal, so a SIGKILL hints at the OOM killer."""
        if self.signal is not None:
            hint = (" (out of memory? check the kernel log)"
                    if unexpected and self.signal == signal.SIGKILL else "")
            return f"killed by {self.signal_name}{hint}"
        if self.code == EXIT_CONFIG:
            return "exit 78 (invalid engine config or model)"
        if self.signal_name is not None:
            return f"exit {self.code} (terminated by {self.signal_name} after cleanup)"
        return f"exit {self.code}"


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
    """Consecutive failures (for backoff) and failure times (for the start-limit window)."""

    consecutive: int = 0
    failure_times: tuple[float, ...] = field(default_factory=tuple)


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


def decide(now: float, restart: str, status: ExitStatus, reason: Reason,
           history: FailureHistory, ready_since: float | None, backoff: BackoffSpec,
           start_limit: StartLimitSpec, jitter_unit: float) -> tuple[Decision, FailureHistory]:
    """What to do after an unexpected exit (not one an operator asked for)."""
    if status.code == EXIT_CONFIG:
        return Decision(Action.FAIL, why="exit 78: invalid engine config or model"), history
    failed = not (status.clean and reason is Reason.EXIT)
    if not failed:
        if restart == "always":
            return Decision(Action.RESTART, why="clean exit, restart=always"), history
        return Decision(Action.STOP, why=f"clean exit, restart={restart}"), history
    if restart == "never":
        return Decision(Action.FAIL, why="failed, restart=never"), history
    history = record_failure(now, history, ready_since, backoff, start_limit)
    if len(history.failure_times) > start_limit.burst:
        why = (f"start limit hit: {len(history.failure_times)} failures within "
               f"{start_limit.interval_s:g}s (burst {start_limit.burst})")
        return Decision(Action.FAIL, why=why), history
    delay = backoff_delay(history.consecutive, backoff, jitter_unit)
    return Decision(Action.RESTART, delay, f"failure {history.consecutive} in a row"), history


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


def check_liveness(now: float, live: Liveness) -> tuple[Reason | None, float]:
    """Return (reason to kill, or None; the time at which to check again)."""
    if live.starting:
        deadline = live.spawned_at + live.startup_timeout_s
        return (Reason.STARTUP_TIMEOUT if reached(now, deadline) else None), deadline
    hb_deadline = live.last_heartbeat_at + live.heartbeat_timeout_s
    if reached(now, hb_deadline):
        return Reason.HANG, hb_deadline
    if live.work_queued:
        stall_deadline = live.last_iteration_at + live.stall_timeout_s
        if reached(now, stall_deadline):
            return Reason.STALL, stall_deadline
        return None, min(hb_deadline, stall_deadline)
    return None, hb_deadline
