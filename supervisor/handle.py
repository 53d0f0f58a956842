"""One supervised engine replica: spawn, watch, signal, await exit, apply the policy's decision.

Each handle runs one coroutine (`run`) on the daemon's event loop, which owns all of its state.
Operator commands (stop/start/restart), control messages from the child and the child's exit
only change fields and wake that coroutine; every decision comes from `supervisor.policy`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import logging
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from engine import protocol as proto
from supervisor.launcher import Child, ExitRecord, Launcher
from supervisor.logs import LogSink, PipeReader
from supervisor.policy import (Action, Decision, FailureHistory, Liveness, Reason,
                               check_liveness, decide, exit_reason)
from supervisor.spec import EngineSpec
from supervisor.state import EngineState, check_transition

if TYPE_CHECKING:
    from supervisor.gang import GangGroup

log = logging.getLogger("engined.engine")

EXIT_TAIL_LINES = 20
_KILL_WAIT_S = 5.0  # after SIGKILL a process is normally reaped in milliseconds


class Desired(enum.Enum):
    RUN = "run"
    STOPPED = "stopped"


class Command(enum.Enum):
    STOP = "stop"
    RESTART = "restart"
    GANG_STOP = "gang_stop"  # a data-parallel peer failed: stop, then wait for the gang


@dataclass(frozen=True)
class LastExit:
    code: int | None
    signal: str | None
    reason: str
    at: float
    description: str
    log_tail: list[str]

    def to_json(self) -> dict:
        return {"code": self.code, "signal": self.signal, "reason": self.reason, "at": self.at,
                "description": self.description, "log_tail": self.log_tail}


@dataclass(frozen=True)
class HandleDeps:
    """What every handle shares; built once in the daemon's main."""

    loop: asyncio.AbstractEventLoop
    launcher: Launcher
    log_dir: Path
    control_endpoint: str
    request_endpoint: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    on_exit: Callable[[EngineHandle, int], None]  # (handle, incarnation): fail its requests
    on_state: Callable[[EngineHandle, EngineState, EngineState], None]
    rng: random.Random = field(default_factory=random.Random)


class EngineHandle:
    def __init__(self, spec: EngineSpec, deps: HandleDeps) -> None:
        self.spec = spec
        self.deps = deps
        self.state = EngineState.STOPPED
        self.desired = Desired.RUN
        self.incarnation = 0
        self.child: Child | None = None
        self.log = LogSink(deps.log_dir / f"{spec.name}.log")
        self.history = FailureHistory()
        self.restarts: collections.Counter[Reason] = collections.Counter()
        self.last_exit: LastExit | None = None
        self.since = time.time()
        self.spawned_wall: float | None = None
        self.startup_s: float | None = None
        self.ready_since: float | None = None
        self.last_heartbeat_at: float | None = None
        self.heartbeat: proto.Heartbeat | None = None
        self.ready_info: proto.Ready | None = None
        self.phase = ""
        self.cleanup_at: float | None = None  # the child announced its cleanup (it is exiting)
        self.cleanup: dict[str, float] = {}
        self.stale_messages = 0
        self.cpu_seconds_exited = 0.0  # CPU of earlier incarnations, so the counter never resets
        self.requests: collections.Counter[str] = collections.Counter()  # outcome -> count
        self.restart_at: float | None = None
        self.fail_reason = ""
        self._spawn_due: float | None = None
        self._pending_reason: Reason | None = None
        self._command: Command | None = None
        self._term_deadline: float | None = None
        self._pipe: PipeReader | None = None
        self._log_mark = 0
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.gang: GangGroup | None = None  # set for data-parallel ranks

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child is not None and self.child.alive else None

    # --- lifecycle coroutine -----------------------------------------------------------------
    def start_supervising(self) -> None:
        self._spawn_due = time.monotonic() if self.desired is Desired.RUN else None
        self._task = self.deps.loop.create_task(self.run(), name=f"engine:{self.name}")

    async def run(self) -> None:
        while True:
            due = self._spawn_due
            now = time.monotonic()
            if due is not None and now >= due and self.desired is Desired.RUN:
                self._spawn_due = None
                self._spawn()
                await self._watch()
                continue
            await self._sleep(None if due is None else due - now)

    async def _sleep(self, timeout_s: float | None) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def _spawn(self) -> None:
        self.incarnation += 1
        config = self._child_config()
        self.child = self.deps.launcher.spawn(config, dict(self.spec.env))
        self._pipe = PipeReader(self.deps.loop, self.child.output_fd, self.log)
        self._log_mark = self.log.lines_total
        if self._pending_reason is not None:
            self.restarts[self._pending_reason] += 1
            self._pending_reason = None
        self.spawned_wall = time.time()
        self.heartbeat, self.ready_info, self.ready_since = None, None, None
        self.last_heartbeat_at, self.phase, self.restart_at = None, "spawned", None
        self.cleanup_at = None
        self._set_state(EngineState.STARTING)
        self.log.note(f"spawned pid {self.child.pid} incarnation {self.incarnation}")
        log.info("[spawn] %s pid %d incarnation %d", self.name, self.child.pid, self.incarnation)

    async def _watch(self) -> None:
        """Until the child exits: enforce liveness and carry out stop/restart commands."""
        child = self.child
        assert child is not None
        killed_for: Reason | None = None
        requested: Command | None = None
        while child.alive:
            now = time.monotonic()
            next_at: float | None = None
            if self._command is not None and requested is None:
                requested, self._command = self._command, None
                self._begin_stop(child, now)
            if requested is not None or killed_for is not None:
                next_at = self._escalate(child, now)
            else:
                killed_for, next_at = check_liveness(now, self._liveness())
                if killed_for is not None:
                    self._kill_for(child, killed_for)
                    next_at = self._term_deadline
            await self._wait_exit_or_wake(child, None if next_at is None else next_at - now)
        self._on_exit(child, child.exited.result(), killed_for, requested)

    async def _wait_exit_or_wake(self, child: Child, timeout_s: float | None) -> None:
        self._wake.clear()
        waker = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({child.exited, waker}, timeout=timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waker.cancel()

    def _begin_stop(self, child: Child, now: float) -> None:
        self._set_state(EngineState.STOPPING)
        deadline = now + self.spec.stop_timeout_s
        self._term_deadline = min(deadline, self._term_deadline or deadline)
        log.info("[stop] %s pid %d: SIGTERM to its process group", self.name, child.pid)
        child.signal_group(signal.SIGTERM)
        child.signal_group(signal.SIGCONT)  # a stopped (SIGSTOP) process must see the SIGTERM

    def _escalate(self, child: Child, now: float) -> float:
        """SIGKILL once the stop deadline passes; return when to look again."""
        deadline = self._term_deadline if self._term_deadline is not None else now
        if now >= deadline:
            log.warning("[stop] %s pid %d did not exit in time: SIGKILL", self.name, child.pid)
            child.signal_group(signal.SIGKILL)
            self._term_deadline = now + _KILL_WAIT_S
            return now + _KILL_WAIT_S
        return deadline

    def _kill_for(self, child: Child, reason: Reason) -> None:
        age = time.monotonic() - (self.last_heartbeat_at or child.spawned_at)
        if reason is Reason.STALL:
            what = "loop progress"
        elif reason is Reason.STARTUP_TIMEOUT:
            what = "READY in time"
        elif self.cleanup_at is not None:
            what = "exit within stop_timeout of its cleanup"
        else:
            what = "heartbeat"
        log.warning("[%s] %s pid %d: no %s (last heartbeat %.1fs ago): SIGKILL to its group",
                    reason.value, self.name, child.pid, what, age)
        self._set_state(EngineState.STOPPING)
        self._term_deadline = time.monotonic() + _KILL_WAIT_S
        child.signal_group(signal.SIGKILL)

    def _liveness(self) -> Liveness:
        child = self.child
        assert child is not None
        starting = self.state is EngineState.STARTING
        hb = self.heartbeat
        last_seen = self.last_heartbeat_at or child.spawned_at
        live = Liveness(starting=starting, spawned_at=child.spawned_at,
                        startup_timeout_s=self.spec.startup_timeout_s,
                        last_heartbeat_at=last_seen,
                        heartbeat_timeout_s=self.deps.heartbeat_timeout_s,
                        last_iteration_at=hb.last_iteration_at if hb else last_seen,
                        work_queued=_busy(hb),
                        stall_timeout_s=self.spec.stall_timeout_s)
        if self.cleanup_at is None:
            return live
        # Exiting on its own (an exception, an external SIGTERM): its heartbeats stopped as its
        # cleanup began, and a cleanup (CUDA release, gc) may outlast heartbeat_timeout. It gets
        # stop_timeout from its announcement, as a requested stop would.
        return dataclasses.replace(live, last_heartbeat_at=self.cleanup_at,
                                   heartbeat_timeout_s=self.spec.stop_timeout_s, work_queued=False)

    # --- exit --------------------------------------------------------------------------------
    def _on_exit(self, child: Child, record: ExitRecord, killed_for: Reason | None,
                 requested: Command | None) -> None:
        if self._pipe is not None:
            self._pipe.drain()
        child.signal_group(signal.SIGKILL)  # stragglers in its group must not keep a GPU
        self._term_deadline = None
        self.deps.on_exit(self, self.incarnation)
        self.cpu_seconds_exited += record.cpu_seconds
        status = record.status
        expected = requested is not None or killed_for is not None
        self.log.note(f"pid {child.pid} exited: {status.describe(not expected)}")
        self._command = None
        if self.desired is Desired.STOPPED:
            self._set_state(EngineState.STOPPED)
            log.info("[stop] %s pid %d stopped (%s)", self.name, child.pid,
                     status.describe(unexpected=False))
        elif requested is Command.GANG_STOP and self.gang is not None:
            self._record_exit(record, Reason.GROUP, unexpected=False)
            self.gang.member_down(self, Reason.GROUP, None, record.at_monotonic)
        elif requested is not None:  # a restart, or a stop overtaken by a start
            self._spawn_due = time.monotonic()
        elif self.gang is not None:
            reason = exit_reason(status, killed_for)
            own = self.gang.member_down(self, reason, status, record.at_monotonic)
            self._record_exit(record, own, killed_for is None)
        else:
            self._on_unexpected_exit(child, record, killed_for)

    def _on_unexpected_exit(self, child: Child, record: ExitRecord,
                            killed_for: Reason | None) -> None:
        status = record.status
        reason = exit_reason(status, killed_for)
        self._record_exit(record, reason, killed_for is None)
        decision, self.history = decide(
            record.at_monotonic, self.spec.restart, status, reason, self.history,
            self.ready_since, self.spec.backoff, self.spec.start_limit,
            self.deps.rng.uniform(-1.0, 1.0))
        self._apply(decision, reason)
        log.warning("[exit] %s pid %d %s (reason %s): %s", self.name, child.pid,
                    status.describe(killed_for is None), reason.value,
                    self._decision_text(decision))

    def _record_exit(self, record: ExitRecord, reason: Reason, unexpected: bool) -> None:
        status = record.status
        self.last_exit = LastExit(status.code, status.signal_name, reason.value, record.at_wall,
                                  status.describe(unexpected),
                                  self.log.tail_since(self._log_mark, EXIT_TAIL_LINES))

    # --- data-parallel gang (driven by supervisor.gang.GangGroup) ------------------------------
    def gang_stop(self) -> None:
        """A peer failed: stop this rank (SIGTERM, stop_timeout, SIGKILL) and wait for the gang."""
        if self.child is not None and self.child.alive and self.desired is Desired.RUN:
            self._command = Command.GANG_STOP
            self._wake.set()

    def await_gang(self, reason: Reason) -> None:
        """Down, waiting for the gang's decision; `reason` is counted if it restarts."""
        self._spawn_due, self._pending_reason = None, reason
        self._set_state(EngineState.BACKOFF)

    def gang_apply(self, decision: Decision) -> None:
        if self.desired is Desired.RUN:
            self._apply(decision, self._pending_reason or Reason.GROUP)

    def _apply(self, decision: Decision, reason: Reason) -> None:
        self._wake.set()
        if decision.action is Action.RESTART:
            self._pending_reason = reason
            self._spawn_due = time.monotonic() + decision.delay_s
            if decision.delay_s > 0:
                self.restart_at = self._spawn_due
                self._set_state(EngineState.BACKOFF)
        elif decision.action is Action.FAIL:
            self.fail_reason = decision.why
            self._set_state(EngineState.FAILED)
        else:
            self.desired = Desired.STOPPED
            self._set_state(EngineState.STOPPED)

    @staticmethod
    def _decision_text(decision: Decision) -> str:
        if decision.action is Action.RESTART:
            return ("restarting now" if decision.delay_s == 0
                    else f"restarting in {decision.delay_s:.2f}s") + f" ({decision.why})"
        return f"{decision.action.value}: {decision.why}"

    # --- operator commands (called on the loop) ----------------------------------------------
    def stop(self, deadline: float | None = None) -> None:
        self.desired = Desired.STOPPED
        # A pending backoff restart is cancelled: status must not keep announcing it.
        self._spawn_due, self._pending_reason, self.restart_at = None, None, None
        if deadline is not None:
            self._term_deadline = deadline
        if self.child is not None and self.child.alive:
            self._command = Command.STOP
        elif self.state is not EngineState.STOPPED:
            self._set_state(EngineState.STOPPED)
        self._wake.set()

    def start(self) -> None:
        self.desired = Desired.RUN
        if self.child is not None and self.child.alive:
            return  # running, or being stopped: `desired` brings it back after the exit
        self._reset_failures()
        self._spawn_due = time.monotonic()
        self._wake.set()

    def restart(self, reason: Reason = Reason.MANUAL) -> None:
        self.desired = Desired.RUN
        self._reset_failures()
        self._pending_reason = reason
        if self.child is not None and self.child.alive:
            self._command = Command.RESTART
        else:
            self._spawn_due = time.monotonic()
        self._wake.set()

    def kill_now(self) -> None:
        """Second shutdown signal: no more waiting."""
        if self.child is not None and self.child.alive:
            self.child.signal_group(signal.SIGKILL)

    def _reset_failures(self) -> None:
        self.history = FailureHistory()
        self.fail_reason = ""

    async def wait_for(self, predicate: Callable[[EngineHandle], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not predicate(self):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return predicate(self)
        return True

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.log.close()

    # --- messages from the child -------------------------------------------------------------
    def on_control(self, msg: proto.ControlMessage) -> bool:
        """Apply a control message; False (and counted) if it is from another incarnation."""
        if isinstance(msg, proto.Goodbye) and 0 < msg.incarnation <= self.incarnation:
            # A cleanup report may arrive after an immediate restart already began: it changes
            # no state, so keep it (with its incarnation) rather than drop it as stale.
            self.cleanup = {**msg.cleanup, "incarnation": float(msg.incarnation)}
            return True
        if msg.incarnation != self.incarnation or self.child is None:
            self.stale_messages += 1
            return False
        now = time.monotonic()
        if isinstance(msg, proto.Heartbeat):
            was_busy = _busy(self.heartbeat)
            self.last_heartbeat_at, self.heartbeat = now, msg
            if _busy(msg) and not was_busy:
                self._wake.set()  # the stall deadline may now come before the one it sleeps to
            # Otherwise a heartbeat only moves deadlines later: the watcher re-checks at the old
            # deadline with fresh data, and a fleet of idle engines costs no wake-ups.
        elif isinstance(msg, proto.Ready):
            self._on_ready(msg, now)
        elif isinstance(msg, proto.Progress):
            self.phase = msg.phase
            if msg.phase == proto.PHASE_CLEANUP and self.cleanup_at is None:
                self.cleanup_at = now  # only moves the hang deadline later: no wake-up needed
        return True

    def _on_ready(self, msg: proto.Ready, now: float) -> None:
        if self.state is not EngineState.STARTING or self.child is None:
            return
        self.ready_info = msg
        self.startup_s = now - self.child.spawned_at
        self.ready_since = self.last_heartbeat_at = now
        self.phase = "serving"
        self._set_state(EngineState.READY)
        log.info("[ready] %s pid %d incarnation %d in %.3fs (device %s)", self.name,
                 self.child.pid, self.incarnation, self.startup_s, msg.device)
        self._wake.set()

    # --- state -------------------------------------------------------------------------------
    def _set_state(self, new: EngineState) -> None:
        old = self.state
        if new is old and new is not EngineState.STARTING:
            return
        self.state = check_transition(old, new)
        self.since = time.time()
        self.deps.on_state(self, old, new)
        self._changed.set()
        self._changed = asyncio.Event()

    def _child_config(self) -> proto.EngineConfig:
        spec = self.spec
        return proto.EngineConfig(
            name=spec.name, group=spec.group, rank=spec.rank, replicas=spec.replicas,
            incarnation=self.incarnation, model=spec.model.source, dtype=spec.model.dtype,
            gpus=list(spec.gpus), data_parallel=spec.data_parallel,
            max_batch_size=spec.max_batch_size, threads=spec.threads,
            control_endpoint=self.deps.control_endpoint,
            request_endpoint=self.deps.request_endpoint,
            heartbeat_interval_s=self.deps.heartbeat_interval_s,
            rendezvous=self.gang.rendezvous if self.gang is not None else None)


def _busy(hb: proto.Heartbeat | None) -> bool:
    """Work queued or running, or blocked on DP peers: what makes a frozen loop a stall."""
    return bool(hb and (hb.waiting or hb.running or hb.in_collective))
