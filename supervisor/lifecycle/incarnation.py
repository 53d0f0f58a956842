"""One process of a replica, and everything that belongs to that process alone.

A replica (supervisor.replica) is a slot: desired state, lifecycle state, failure record and
backoff outlive its processes. Each process it starts is an `Incarnation`: its address (the
name and number its messages carry and its requests are routed by), its owner mark, its child
(pid, output pipe, exit future), port, what it has told us (`Vitals`), its stop deadline, how
its liveness is judged (supervisor.liveness), its log mark and the messages that came before its
spawn returned. It is created when the spawn starts and moves as one object: a warm standby's
promotion hands its incarnation to the replica it replaces (gunicorn's one object per worker
pid; trio's `Process`).
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from engined.engine import protocol as proto
from engined.supervisor.host.launcher import Child
from engined.supervisor.lifecycle.loopmonitor import LoopMonitor
from engined.supervisor.lifecycle.policy import Liveness, reached
from engined.supervisor.lifecycle.state import Reason
from engined.supervisor.logs import PipeReader
from engined.supervisor.spec.model import EngineSpec

KILL_WAIT_S = 5.0  # after SIGKILL a process is normally reaped in milliseconds
Deliver = Callable[[proto.ChildMessage], object]


class Kind(enum.Enum):
    """What runs in the process: which transport reaches it and who speaks for its liveness."""

    ENGINE = "engine"  # engined's engine child: ZeroMQ, heartbeats
    COMMAND = "command"  # a server of its own (`command:`): HTTP, probes


class LivenessStrategy(Protocol):
    """How the incarnation is judged alive (supervisor.lifecycle.liveness: chosen at spawn,
    by what the engine is)."""

    kind: Kind

    @property
    def heartbeat_timeout_s(self) -> float: ...

    @property
    def stale_after_s(self) -> float:
        """A last sign of life older than this takes a READY replica out of routing (long before
        it is declared hung: a frozen engine stops getting requests at once)."""

    @property
    def verdict(self) -> str | None:
        """Set when an outside judge (failed probes) declared the incarnation hung."""

    @property
    def verdict_reason(self) -> Reason:
        """What the verdict's kill counts as: hang (probes), canary (an idle canary request)."""

    def begin(self, address: tuple[str, int], port: int | None, deliver: Deliver,
              wake: Callable[[], None]) -> None:
        """The incarnation's process exists: start watching it from outside, if that is how."""

    def end(self) -> None: ...

    def missing(self, reason: Reason, cleaning_up: bool) -> str:
        """What the incarnation failed to show, for the kill's log line ("no heartbeat")."""


@dataclass
class Vitals:
    """What the incarnation has told us."""

    spawned_at: float  # monotonic
    heartbeat: proto.Heartbeat | None = None
    heartbeat_at: float | None = None  # monotonic receive time (or the READY's)
    ready: proto.Ready | None = None
    ready_at: float | None = None
    phase: str = "spawned"
    cleanup_at: float | None = None  # the child announced its cleanup: it is exiting
    over_limit_since: float | None = None  # its heartbeats say it holds more than memory_limit

    @property
    def busy(self) -> bool:
        """Work queued or running, or blocked on DP peers: what makes a frozen loop a stall."""
        hb = self.heartbeat
        return bool(hb and (hb.waiting or hb.running or hb.in_collective))


class Incarnation:
    def __init__(self, address: tuple[str, int], token: str,
                 liveness: LivenessStrategy) -> None:
        self.address = address  # (name, number) its messages carry; its routing identity
        self.token = token  # the mark its processes inherit (what the reaper finds them by)
        self.liveness = liveness
        self.child: Child | None = None  # None while its spawn is in flight
        self.pipe: PipeReader | None = None
        self.vitals: Vitals | None = None
        self.log_mark = 0  # its first line in the replica's log
        self.term_deadline: float | None = None  # SIGKILL when reached (stopping or killed)
        # A forked child runs before its spawn returns: what it says meanwhile (HELLO, even
        # READY) is kept here and replayed once it is attached.
        self.early: list[proto.ChildMessage] = []
        self.adopted_at: float | None = None  # handed over by an engined upgrade (unix time)
        self.reattaching = False  # adopted, not yet reachable again (STARTING until it is)
        self.resumed_since: float | None = None  # the READY run it had before (unix time)
        self.asleep = False  # in vLLM's sleep mode (sleep_mode level1/level2): no canary

    @property
    def kind(self) -> Kind:
        return self.liveness.kind

    @property
    def port(self) -> int | None:
        return self.child.port if self.child is not None else None

    @property
    def attached(self) -> bool:
        return self.child is not None

    @property
    def alive(self) -> bool:
        return self.child is not None and self.child.alive

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child is not None and self.child.alive else None

    def attach(self, child: Child, pipe: PipeReader, log_mark: int) -> list[proto.ChildMessage]:
        """Its spawn returned: the process is known. Returns the messages it sent before."""
        self.child, self.pipe, self.log_mark = child, pipe, log_mark
        self.vitals = Vitals(spawned_at=child.spawned_at)
        early, self.early = self.early, []
        return early

    # --- what routing asks --------------------------------------------------------------------
    def heartbeat_age(self, now: float) -> float | None:
        """Seconds since its last sign of life, while it serves (READY, not in its cleanup)."""
        vitals = self.vitals
        if (not self.alive or vitals is None or vitals.phase != "serving"
                or vitals.heartbeat_at is None):
            return None
        return now - vitals.heartbeat_at

    @property
    def avoid_after_loss_s(self) -> float:
        """A request lost on it is not sent back while liveness may still be deciding."""
        return self.liveness.heartbeat_timeout_s

    def fresh(self, now: float) -> bool:
        """Serving, and heard from lately (its liveness says how lately)."""
        age = self.heartbeat_age(now)
        return age is not None and age <= self.liveness.stale_after_s

    # --- messages ------------------------------------------------------------------------------
    def on_heartbeat(self, msg: proto.Heartbeat, now: float) -> bool:
        """True when work just began: the stall deadline may now come first."""
        vitals = self.vitals
        assert vitals is not None
        was_busy, was_over = vitals.busy, vitals.over_limit_since is not None
        vitals.heartbeat_at, vitals.heartbeat = now, msg
        over = msg.memory_headroom is not None and msg.memory_headroom < 0
        if over and not was_over:
            vitals.over_limit_since = now
        elif not over:
            vitals.over_limit_since = None
        return (vitals.busy and not was_busy) or (over and not was_over)

    def on_progress(self, msg: proto.Progress, now: float, starting: bool) -> None:
        vitals = self.vitals
        assert vitals is not None
        if msg.phase == proto.PHASE_CLEANUP:
            vitals.phase = msg.phase
            if vitals.cleanup_at is None:
                vitals.cleanup_at = now  # only moves the hang deadline later: no wake-up
        elif starting:
            # Loading phases; READY travels on another socket and may overtake the last.
            vitals.phase = msg.phase

    def on_ready(self, msg: proto.Ready, now: float) -> float:
        """Returns its startup time (spawn -> READY)."""
        vitals = self.vitals
        assert vitals is not None
        vitals.ready, vitals.ready_at, vitals.heartbeat_at = msg, now, now
        vitals.phase = "serving"
        return now - vitals.spawned_at

    def adopted(self, now: float) -> None:
        """Promoted from a standby: READY under its new replica from `now`."""
        vitals = self.vitals
        assert vitals is not None
        vitals.ready_at = vitals.heartbeat_at = now
        self.term_deadline = None

    # --- liveness ------------------------------------------------------------------------------
    def facts(self, starting: bool, spec: EngineSpec, monitor: LoopMonitor) -> Liveness:
        """What policy.check_liveness judges."""
        vitals = self.vitals
        assert vitals is not None
        startup_timeout_s, stall_timeout_s = spec.startup_timeout_s, spec.stall_timeout_s
        pauses, judge_after = monitor.pauses, monitor.judge_after
        if vitals.cleanup_at is not None:
            # Exiting on its own (an exception, an external SIGTERM): its heartbeats stopped as
            # its cleanup began, and a cleanup (CUDA release, gc) may outlast heartbeat_timeout.
            # It gets stop_timeout from its announcement, as a requested stop would.
            return Liveness(starting=False, spawned_at=vitals.spawned_at,
                            startup_timeout_s=startup_timeout_s,
                            last_heartbeat_at=vitals.cleanup_at,
                            heartbeat_timeout_s=spec.stop_timeout_s,
                            last_iteration_at=vitals.cleanup_at, work_queued=False,
                            stall_timeout_s=stall_timeout_s, pauses=pauses,
                            judge_after=judge_after)
        last_seen = vitals.heartbeat_at or vitals.spawned_at
        hb = vitals.heartbeat
        return Liveness(starting=starting, spawned_at=vitals.spawned_at,
                        startup_timeout_s=startup_timeout_s, last_heartbeat_at=last_seen,
                        heartbeat_timeout_s=self.liveness.heartbeat_timeout_s,
                        last_iteration_at=hb.last_iteration_at if hb else last_seen,
                        work_queued=vitals.busy, stall_timeout_s=stall_timeout_s,
                        pauses=pauses, judge_after=judge_after,
                        over_limit_since=vitals.over_limit_since,
                        idle_loop=self.kind is Kind.ENGINE and hb is not None)

    # --- signals -------------------------------------------------------------------------------
    def terminate(self, now: float, stop_timeout_s: float, deadline: float | None) -> None:
        """SIGTERM to its process group; SIGKILL at the earlier of stop_timeout and `deadline`."""
        child = self.child
        assert child is not None
        own = now + stop_timeout_s
        self.term_deadline = min(own, deadline) if deadline is not None else own
        child.signal_group(signal.SIGTERM)
        child.signal_group(signal.SIGCONT)  # a stopped (SIGSTOP) process must see the SIGTERM

    def escalate(self, now: float) -> tuple[bool, float]:
        """SIGKILL once the stop deadline passes. Returns (killed now, when to look again)."""
        deadline = self.term_deadline if self.term_deadline is not None else now
        if not reached(now, deadline):
            return False, deadline
        self.kill(now)
        return True, now + KILL_WAIT_S

    def kill(self, now: float) -> None:
        """SIGKILL to its process group (it is normally reaped within milliseconds)."""
        assert self.child is not None
        self.term_deadline = now + KILL_WAIT_S
        self.child.signal_group(signal.SIGKILL)

    def ended(self) -> None:
        """Its exit is known: stop watching it, read the rest of its output, and kill any
        straggler left in its group (it must not keep a GPU)."""
        self.liveness.end()
        if self.pipe is not None:
            self.pipe.drain()
        if self.child is not None:
            self.child.signal_group(signal.SIGKILL)
        self.term_deadline = None
