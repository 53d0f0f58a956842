"""One supervised engine replica: spawn, watch liveness, signal, await exit.

No policy lives here. An exit that nobody asked for is reported to the replica's owner (its group,
`supervisor.groups`), which takes the decision and tells the replica what to do (`apply`, `hold`).
Operator commands reach a replica through its owner, too. Everything runs on the daemon's event
loop: commands, child messages and the child's exit only change fields and wake the replica's
coroutine (`run`). Readers never see those fields: they get an immutable `EngineView`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import errno
import json
import logging
import math
import random
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from engined.engine import protocol as proto
from engined.engine.contract import CONFIG_LINE_PREFIX, EXIT_CONFIG
from engined.supervisor import scratch
from engined.supervisor.clock import Clock, to_wall
from engined.supervisor.launcher import Child, ExitRecord, Launcher, owner_token, pick_port
from engined.supervisor.logs import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES, LogSink, PipeReader
from engined.supervisor.loop import LoopMonitor
from engined.supervisor.oom import OomWitness
from engined.supervisor.policy import (
    Action,
    Decision,
    ExitStatus,
    Liveness,
    Reason,
    check_liveness,
    exit_reason,
    reached,
)
from engined.supervisor.probe import CommandWatch, ProbeClient
from engined.supervisor.reaper import Reaper
from engined.supervisor.sampler import Nvml, wait_gpu_released
from engined.supervisor.spec import EngineSpec
from engined.supervisor.state import EngineState, check_transition
from engined.supervisor.view import EngineView, LastExit

log = logging.getLogger("engined.engine")

EXIT_TAIL_LINES = 40  # a fault report with its stack (fork-served engines have 5 frames more)
KILL_WAIT_S = 5.0  # after SIGKILL a process is normally reaped in milliseconds


class Desired(enum.Enum):
    RUN = "run"
    STOPPED = "stopped"


class _Command(enum.Enum):
    STOP = "stop"
    RESTART = "restart"
    PEER_STOP = "peer_stop"  # the owner stops it because a data-parallel peer failed


@dataclass(frozen=True)
class Down:
    """An exit for the owner to decide about."""

    reason: Reason
    status: ExitStatus
    at: float  # monotonic
    ready_since: float | None  # monotonic start of the READY run that just ended
    peer_stop: bool  # the owner stopped it (a peer failed): not a failure of its own
    pid: int
    description: str  # "killed by SIGKILL", for the owner's log line
    config_error: str | None = None  # exit 78: the child's own words ("[config] ..." line)


@dataclass(frozen=True)
class SpawnFailure:
    """A child that could not be started at all (posix_spawn, pipe2 or pidfd_open failed, or
    engined held the spawn back to keep its file-descriptor reserve)."""

    errno: int | None
    description: str
    at: float  # monotonic


class Owner(Protocol):
    """The group a replica belongs to; it decides what follows an exit."""

    @property
    def rendezvous(self) -> str | None: ...

    def on_down(self, replica: Replica, down: Down) -> None: ...

    def on_spawn_failed(self, replica: Replica, failure: SpawnFailure) -> None: ...


@dataclass(frozen=True)
class ReplicaDeps:
    """What every replica shares; built once in the daemon's main."""

    loop: asyncio.AbstractEventLoop
    clock: Clock
    launcher: Launcher
    log_dir: Path
    control_endpoint: str
    request_endpoint: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    on_exit: Callable[[str, int, str], None]  # (name, incarnation, why): fail its requests
    on_state: Callable[[str, EngineState, EngineState], None]
    monitor: LoopMonitor  # the daemon's own pauses move every liveness deadline back
    reaper: Reaper | None = None  # clears what an exited incarnation left behind
    nvml: Nvml | None = None  # with a driver: wait for the GPU memory of the dead to be freed
    oom: OomWitness | None = None  # says whether the OOM killer sent an unexpected SIGKILL
    log_max_bytes: int = DEFAULT_MAX_BYTES  # supervisor.log_max_bytes
    log_backups: int = DEFAULT_BACKUPS  # supervisor.log_backups
    rng: random.Random = field(default_factory=random.Random)
    probes: ProbeClient = field(default_factory=ProbeClient)  # command engines' HTTP probes
    in_flight: Callable[[str], int] = lambda name: 0  # the gateway's requests on a replica


@dataclass
class _Vitals:
    """What the current incarnation has told us."""

    spawned_at: float  # monotonic
    heartbeat: proto.Heartbeat | None = None
    heartbeat_at: float | None = None  # monotonic receive time (or the READY's)
    ready: proto.Ready | None = None
    ready_at: float | None = None
    phase: str = "spawned"
    cleanup_at: float | None = None  # the child announced its cleanup: it is exiting

    @property
    def busy(self) -> bool:
        """Work queued or running, or blocked on DP peers: what makes a frozen loop a stall."""
        hb = self.heartbeat
        return bool(hb and (hb.waiting or hb.running or hb.in_collective))


@dataclass
class _Record:
    """What outlives incarnations: counters and the last exit."""

    restarts: collections.Counter[Reason] = field(default_factory=collections.Counter)
    requests: collections.Counter[str] = field(default_factory=collections.Counter)
    last_exit: LastExit | None = None
    startup_s: float | None = None
    cleanup: dict[str, float] = field(default_factory=dict)
    cpu_seconds_exited: float = 0.0


class Replica:
    def __init__(self, spec: EngineSpec, deps: ReplicaDeps, owner: Owner) -> None:
        self.spec = spec
        self.deps = deps
        self.owner = owner
        self.clock = deps.clock
        self.log = LogSink(deps.log_dir / f"{spec.name}.log", deps.log_max_bytes,
                           deps.log_backups)
        self.state = EngineState.STOPPED
        self.desired = Desired.RUN
        self.incarnation = 0
        self.child: Child | None = None
        self.vitals: _Vitals | None = None
        self.record = _Record()
        self.since = self.clock.wall()
        self.restart_at: float | None = None  # monotonic, while a backoff waits
        self.fail_reason = ""
        self._spawn_due: float | None = None
        self._pending_reason: Reason | None = None  # counted at the next spawn
        self._command: _Command | None = None
        self._term_deadline: float | None = None
        self._pipe: PipeReader | None = None
        self._log_mark = 0
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watching = False  # between a spawn and the handling of that child's exit
        self.port: int | None = None  # a command engine's port (this incarnation's)
        self._verdict: str | None = None  # a command engine's probes declared it hung
        self._probing: asyncio.Task[None] | None = None
        self.draining = False  # out of routing (a rolling restart, a shutdown); still serving
        # The live child's own name and incarnation (its routing identity, what its messages
        # carry) and its descendants' mark: this replica's, unless it was promoted from a standby
        self.address: tuple[str, int] = (spec.name, 0)
        self._token = ""
        self._release = False  # a standby handing its child over: stop watching it
        # A forked child runs before its spawn returns: what it says meanwhile (HELLO, even
        # READY) is kept and replayed once its pid and incarnation are ours
        self._spawning: tuple[str, int] | None = None
        self._early: list[proto.ChildMessage] = []

    @property
    def standby(self) -> bool:
        """A warm spare: built and heartbeating, not routed; promoted when a replica dies."""
        return self.spec.standby

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child is not None and self.child.alive else None

    @property
    def active(self) -> bool:
        """It has a child whose exit is not handled yet (running, or exited a moment ago and
        about to be reported). Commands and owners go by this, not by the process alone: acting
        on "no process" before the exit is handled would race that handling."""
        return self._watching

    @property
    def settled(self) -> bool:
        """Down and accounted for: no process, and its exit (if any) already handled. A child
        whose exit is known but not yet handled is not settled."""
        return not self._watching and self.state in (EngineState.STOPPED, EngineState.BACKOFF,
                                                     EngineState.FAILED)

    @property
    def supervising(self) -> bool:
        """Its coroutine runs (it ends only when the replica is closed)."""
        return self._task is not None and not self._task.done()

    @property
    def wanted(self) -> bool:
        return self.desired is Desired.RUN

    @property
    def ready_since(self) -> float | None:
        """Monotonic start of the current (or just ended) incarnation's READY run."""
        return self.vitals.ready_at if self.vitals is not None else None

    # --- the view ----------------------------------------------------------------------------
    def view(self) -> EngineView:
        spec, vitals, rec, now = self.spec, self.vitals, self.record, self.clock.monotonic()
        live = vitals if self.pid is not None else None
        heartbeat_at = vitals.heartbeat_at if vitals else None
        return EngineView(
            name=spec.name, group=spec.group, rank=spec.rank, model=spec.model.source,
            gpus=spec.gpus, state=self.state, wanted=self.desired is Desired.RUN, pid=self.pid,
            incarnation=self.incarnation,
            restarts_by_reason=tuple((r.value, n) for r, n in rec.restarts.items()),
            since=self.since,
            spawned_at=to_wall(self.clock, vitals.spawned_at) if vitals else None,
            startup_s=rec.startup_s,
            heartbeat_at=to_wall(self.clock, heartbeat_at) if heartbeat_at is not None else None,
            heartbeat_age_s=(round(now - heartbeat_at, 3)
                             if live is not None and heartbeat_at is not None else None),
            heartbeat=live.heartbeat if live else None,
            ready=vitals.ready if vitals else None,
            phase=vitals.phase if vitals else "",
            restart_at=to_wall(self.clock, self.restart_at) if self.restart_at else None,
            fail_reason=self.fail_reason, last_exit=rec.last_exit, last_cleanup=dict(rec.cleanup),
            cpu_seconds_exited=rec.cpu_seconds_exited,
            requests=tuple(rec.requests.items()), data_parallel=spec.data_parallel,
            port=self.port, command=spec.is_command, standby=spec.standby,
            launcher=self.child.launcher if self.child is not None else "")

    def serving_heartbeat_age(self) -> float | None:
        """Seconds since the last heartbeat of a READY, wanted incarnation that is serving (not
        in its cleanup); None if there is none. What routing asks on every request: the part of
        `view()` it needs, without building the whole view."""
        vitals = self.vitals
        if (self.state is not EngineState.READY or self.desired is not Desired.RUN
                or self.pid is None or vitals is None or vitals.phase != "serving"
                or vitals.heartbeat_at is None):
            return None
        return self.clock.monotonic() - vitals.heartbeat_at

    def count_request(self, outcome: str) -> None:
        self.record.requests[outcome] += 1

    # --- lifecycle coroutine -----------------------------------------------------------------
    def start_supervising(self) -> None:
        self._spawn_due = self.clock.monotonic() if self.desired is Desired.RUN else None
        self._task = self.deps.loop.create_task(self.run(), name=f"engine:{self.name}")

    async def run(self) -> None:
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - supervision of an engine must never end
                log.exception("[bug] %s: internal error in its supervision, resuming in 1s",
                              self.name)
                await asyncio.sleep(1.0)

    async def _step(self) -> None:
        if self._watching:  # a child adopted from a standby, or after an internal error, say
            ended = await self._watch()
            if ended is not None:
                await self._clear_leftovers(*ended)
            return
        due, now = self._spawn_due, self.clock.monotonic()
        if due is not None and reached(now, due) and self.desired is Desired.RUN:
            self._spawn_due = None
            if await self._spawn():
                ended = await self._watch()
                if ended is not None:
                    await self._clear_leftovers(*ended)
            return
        await self._sleep(due)

    async def _sleep(self, until: float | None) -> None:
        self._wake.clear()
        try:
            timeout_s = None if until is None else max(0.0, until - self.clock.monotonic())
            await asyncio.wait_for(self._wake.wait(), timeout_s)
        except asyncio.TimeoutError:
            self.deps.monitor.note(until or 0.0, self.clock.monotonic())

    async def _spawn(self) -> bool:
        """Start a child; False (and the owner told) if it could not be started at all."""
        if self._pending_reason is not None:  # counted per attempt, whether it spawns or not
            self.record.restarts[self._pending_reason] += 1
            self._pending_reason = None
        incarnation = self.incarnation + 1  # the one this attempt starts
        self._spawning, self._early = (self.name, incarnation), []
        # A fork-server spawn takes a round trip: meanwhile this replica counts as running (not
        # settled; a stop, restart or a peer's stop is held as a command for the new child)
        self._watching = True
        try:
            if self.spec.is_command:
                port = pick_port(self.spec)
                child = self.deps.launcher.spawn_command(self.spec, incarnation, port)
                self.port = port
            else:
                child = await self.deps.launcher.spawn(
                    self._child_config(incarnation), dict(self.spec.env), self.spec.launcher)
        except OSError as exc:
            self._early, self._watching, command = [], False, self._command
            self._command = None
            scratch.remove(owner_token(self.name, incarnation))  # made for it: unused
            self._spawn_failed(exc)
            if self.desired is Desired.STOPPED and command is not None:
                self._set_state(EngineState.STOPPED)  # asked to stop meanwhile: it is
            return False
        except BaseException:
            self._watching = False
            raise
        finally:
            self._spawning = None
        self.incarnation = incarnation
        self.child = child
        self.address = (self.name, self.incarnation)
        self._token = owner_token(self.name, self.incarnation)
        self._watching = True
        self._pipe = PipeReader(self.deps.loop, child.output_fd, self.log)
        self._log_mark = self.log.lines_total
        self.vitals = _Vitals(spawned_at=self.child.spawned_at)
        self.restart_at = None
        self._set_state(EngineState.STARTING)
        how = "" if self.spec.is_command else f" by {child.launcher}"
        self.log.note(f"spawned pid {child.pid} incarnation {self.incarnation}{how}")
        log.info("[spawn] %s pid %d incarnation %d%s", self.name, child.pid, self.incarnation,
                 how)
        self._verdict = None
        if self.spec.is_command:
            self._watch_command()
        early, self._early = self._early, []
        for msg in early:
            self.on_message(msg)
        return True

    def _watch_command(self) -> None:
        """Probes speak for a command engine (READY, heartbeats, hang); without a probe it is
        READY once started, as a systemd `Type=simple` service is."""
        spec, incarnation = self.spec, self.incarnation
        if spec.probe is None or self.port is None:
            self._on_ready(proto.Ready(spec.name, incarnation, 0.0, "", spec.model.source, ""),
                           self.clock.monotonic())
            return

        def condemn(why: str) -> None:
            if self.incarnation == incarnation and self._verdict is None:
                self._verdict = why
                self._wake.set()

        watch = CommandWatch(spec, incarnation, self.port, self.deps.probes, self.clock,
                             self.deps.monitor, self.on_message, condemn,
                             lambda: self.deps.in_flight(spec.name))
        self._probing = self.deps.loop.create_task(watch.run(), name=f"probe:{self.name}")

    def _spawn_failed(self, exc: OSError) -> None:
        code = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno else "?"
        text = f"cannot start: {exc.strerror or exc} ({code})"
        if exc.filename:
            text += f": {exc.filename}"
        self.record.last_exit = LastExit(None, None, Reason.SPAWN_ERROR.value, self.clock.wall(),
                                         text, ())
        self.log.note(text)
        self.owner.on_spawn_failed(self, SpawnFailure(exc.errno, text, self.clock.monotonic()))

    async def _clear_leftovers(self, pid: int, incarnation: int, token: str,
                               gpus: tuple[int, ...]) -> None:
        """Everything the exited incarnation started is gone before its replacement spawns
        (descendants that left its process group included), and so is their GPU memory."""
        dead = {pid}
        if self.deps.reaper is not None:
            dead |= set(await self.deps.reaper.clear(self.name, incarnation, token))
        if self.deps.nvml is not None:
            await wait_gpu_released(self.deps.nvml, self.name, dead, gpus)

    async def _watch(self) -> tuple[int, int, str, tuple[int, ...]] | None:
        """Until the child exits: enforce liveness and carry out stop/restart commands. Returns
        what its leftovers are found by (pid, incarnation, mark, GPUs), or None if it was
        handed over."""
        child = self.child
        assert child is not None
        ended = (child.pid, self.incarnation, self._token, self.spec.gpus)
        killed_for: Reason | None = None
        requested: _Command | None = None
        while child.alive:
            if self._release:  # promoted: another replica watches it from now on
                self._release = False
                return None
            now = self.clock.monotonic()
            if self._command is not None and requested is None:
                requested, self._command = self._command, None
                self._begin_stop(child, now)
            if requested is not None or killed_for is not None:
                next_at: float | None = self._escalate(child, now)
            elif self._verdict is not None:
                killed_for = Reason.HANG
                self._kill_for(child, killed_for)
                next_at = self._term_deadline
            else:
                killed_for, next_at = check_liveness(now, self._liveness())
                if killed_for is not None:
                    self._kill_for(child, killed_for)
                    next_at = self._term_deadline
            await self._wait_exit_or_wake(child, next_at)
        if self._release and self.child is not child:
            self._release = False  # handed over as it died: its new owner reports the exit
            return None
        self._on_exit(child, child.exited.result(), killed_for, requested)
        return ended

    async def _wait_exit_or_wake(self, child: Child, until: float | None) -> None:
        """Until the child exits, a wake-up, or monotonic time `until`. A timer that fires late
        tells the loop monitor: the daemon itself did not run meanwhile."""
        self._wake.clear()
        waker: asyncio.Future[Any] = asyncio.ensure_future(self._wake.wait())
        watched: set[asyncio.Future[Any]] = {child.exited, waker}
        timeout_s = None if until is None else max(0.0, until - self.clock.monotonic())
        try:
            await asyncio.wait(watched, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waker.cancel()
        if until is not None:
            self.deps.monitor.note(until, self.clock.monotonic())

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
        if reached(now, deadline):
            log.warning("[stop] %s pid %d did not exit in time: SIGKILL", self.name, child.pid)
            child.signal_group(signal.SIGKILL)
            self._term_deadline = now + KILL_WAIT_S
            return now + KILL_WAIT_S
        return deadline

    def _kill_for(self, child: Child, reason: Reason) -> None:
        vitals = self.vitals
        assert vitals is not None
        age = self.clock.monotonic() - (vitals.heartbeat_at or child.spawned_at)
        if self._verdict is not None:
            what = f"passing probe: {self._verdict}"
        elif reason is Reason.STALL and self.spec.is_command:
            what = "generation progress with requests in flight"
        elif reason is Reason.STALL:
            what = "loop progress"
        elif reason is Reason.STARTUP_TIMEOUT:
            what = "READY in time"
        elif vitals.cleanup_at is not None:
            what = "exit within stop_timeout of its cleanup"
        else:
            what = "heartbeat"
        log.warning("[%s] %s pid %d: no %s (last heartbeat %.1fs ago): SIGKILL to its group",
                    reason.value, self.name, child.pid, what, age)
        self._set_state(EngineState.STOPPING)
        self._term_deadline = self.clock.monotonic() + KILL_WAIT_S
        child.signal_group(signal.SIGKILL)

    def _liveness(self) -> Liveness:
        vitals = self.vitals
        assert vitals is not None
        last_seen = vitals.heartbeat_at or vitals.spawned_at
        hb, monitor = vitals.heartbeat, self.deps.monitor
        if vitals.cleanup_at is not None:
            # Exiting on its own (an exception, an external SIGTERM): its heartbeats stopped as
            # its cleanup began, and a cleanup (CUDA release, gc) may outlast heartbeat_timeout.
            # It gets stop_timeout from its announcement, as a requested stop would.
            return Liveness(starting=False, spawned_at=vitals.spawned_at,
                            startup_timeout_s=self.spec.startup_timeout_s,
                            last_heartbeat_at=vitals.cleanup_at,
                            heartbeat_timeout_s=self.spec.stop_timeout_s,
                            last_iteration_at=vitals.cleanup_at, work_queued=False,
                            stall_timeout_s=self.spec.stall_timeout_s,
                            pauses=monitor.pauses, judge_after=monitor.judge_after)
        return Liveness(starting=self.state is EngineState.STARTING,
                        spawned_at=vitals.spawned_at,
                        startup_timeout_s=self.spec.startup_timeout_s,
                        last_heartbeat_at=last_seen,
                        heartbeat_timeout_s=self._heartbeat_timeout_s(),
                        last_iteration_at=hb.last_iteration_at if hb else last_seen,
                        work_queued=vitals.busy, stall_timeout_s=self.spec.stall_timeout_s,
                        pauses=monitor.pauses, judge_after=monitor.judge_after)

    def _heartbeat_timeout_s(self) -> float:
        """A command engine's heartbeats are its passing probes, and its probes judge a hang
        (`failures` in a row); this is only the backstop, well after they would have."""
        if not self.spec.is_command:
            return self.deps.heartbeat_timeout_s
        probe = self.spec.probe
        if probe is None:
            return math.inf
        return (probe.failures + 2) * max(probe.interval_s, probe.timeout_s) + probe.timeout_s

    # --- exit --------------------------------------------------------------------------------
    def _on_exit(self, child: Child, record: ExitRecord, killed_for: Reason | None,
                 requested: _Command | None) -> None:
        self._watching = False
        if self._probing is not None:
            self._probing.cancel()
            self._probing = None
        if self._pipe is not None:
            self._pipe.drain()
        child.signal_group(signal.SIGKILL)  # stragglers in its group must not keep a GPU
        self._term_deadline = None
        status = record.status
        reason = exit_reason(status, killed_for)
        self.deps.on_exit(*self.address, _lost_because(reason, requested))
        self.record.cpu_seconds_exited += record.cpu_seconds
        expected = requested is not None or killed_for is not None
        oom = (not expected and status.signal == signal.SIGKILL and self.deps.oom is not None
               and self.deps.oom.killed(child.pid))
        self.log.note(f"pid {child.pid} exited: {status.describe(oom)}")
        self._command = None
        ready_since = self.vitals.ready_at if self.vitals else None
        if self.desired is Desired.STOPPED:
            self._set_state(EngineState.STOPPED)
            log.info("[stop] %s pid %d stopped (%s)", self.name, child.pid, status.describe())
        elif requested is _Command.PEER_STOP:
            self._record_exit(record, Reason.GROUP, status.describe())
            self.owner.on_down(self, Down(Reason.GROUP, status, record.at_monotonic, ready_since,
                                          True, child.pid, status.describe()))
        elif requested is not None:  # a restart, or a stop overtaken by a start
            self._spawn_due = self.clock.monotonic()
        else:
            config_error = self._config_error() if status.code == EXIT_CONFIG else None
            description = status.describe(oom)
            self._record_exit(record, reason, description)
            if config_error:
                description = f"exit 78: {config_error}"
            self.owner.on_down(self, Down(reason, status, record.at_monotonic, ready_since,
                                          False, child.pid, description, config_error))

    def _config_error(self) -> str | None:
        """The reason an exit-78 child printed (its last `[config] ...` line), if any."""
        for line in reversed(self.log.tail_since(self._log_mark, EXIT_TAIL_LINES * 5)):
            if line.startswith(CONFIG_LINE_PREFIX):
                return line[len(CONFIG_LINE_PREFIX):].strip()
        return None

    def _record_exit(self, record: ExitRecord, reason: Reason, description: str) -> None:
        status = record.status
        self.record.last_exit = LastExit(
            status.code, status.signal_name, reason.value, record.at_wall, description,
            tuple(self.log.tail_since(self._log_mark, EXIT_TAIL_LINES)))

    # --- what the owner tells it -------------------------------------------------------------
    def apply(self, decision: Decision, reason: Reason) -> None:
        """Carry out the owner's decision after an exit; `reason` is counted if it restarts."""
        if self.desired is not Desired.RUN:
            return
        self._wake.set()
        if decision.action is Action.RESTART:
            self._pending_reason = reason
            self._spawn_due = self.clock.monotonic() + decision.delay_s
            # BACKOFF even for an immediate restart: until the respawn (its leftovers are
            # cleared first) nothing may take the dead incarnation for a live READY one
            self.restart_at = self._spawn_due if decision.delay_s > 0 else None
            self._set_state(EngineState.BACKOFF)
        elif decision.action is Action.FAIL:
            self.fail_reason = decision.why
            self._set_state(EngineState.FAILED)
        else:
            self.desired = Desired.STOPPED
            self._set_state(EngineState.STOPPED)

    def promote(self, spare: Replica, reason: Reason) -> None:
        """Take over a READY standby's child at once (this replica's own child has just died,
        its exit handled): routable under this name from now on, a new incarnation counted
        with `reason`. The standby starts building a new spare; GPUs swap with the child."""
        assert spare.child is not None and spare.vitals is not None and not self._watching
        now = self.clock.monotonic()
        child, vitals, pipe = spare.child, spare.vitals, spare._pipe
        my_gpus, spare_gpus = self.spec.gpus, spare.spec.gpus
        spare.hand_over()
        if my_gpus != spare_gpus:  # the child keeps its GPUs; the new spare gets these
            self.spec = dataclasses.replace(self.spec, gpus=spare_gpus)
            spare.spec = dataclasses.replace(spare.spec, gpus=my_gpus)
        self.record.restarts[reason] += 1
        self.incarnation += 1
        self.child, self.vitals, self._pipe = child, vitals, pipe
        self.address, self._token = spare.address, spare._token
        if pipe is not None:
            pipe.sink = self.log
        self._log_mark = self.log.lines_total
        vitals.ready_at = vitals.heartbeat_at = now
        self.record.startup_s = 0.0
        self._watching, self._verdict, self._term_deadline = True, None, None
        self._spawn_due, self._pending_reason, self.restart_at = None, None, None
        self.log.note(f"promoted standby {spare.name}'s pid {child.pid} (its incarnation "
                      f"{spare.address[1]}) as incarnation {self.incarnation}")
        log.warning("[standby] %s: promoted %s's pid %d as incarnation %d; %s builds a new "
                    "standby", self.name, spare.name, child.pid, self.incarnation, spare.name)
        self._set_state(EngineState.STARTING)
        self._set_state(EngineState.READY)
        self._wake.set()

    def hand_over(self) -> None:
        """A standby's child goes to the replica it replaces; a new standby is built now."""
        self.child, self.vitals, self._pipe = None, None, None
        self._watching = False
        self._release = True
        self._spawn_due = self.clock.monotonic()
        self.log.note("handed over to the replica it replaces; building a new standby")
        self._set_state(EngineState.STARTING)
        self._wake.set()

    def hold(self, reason: Reason) -> None:
        """Down, waiting for the owner's decision (a gang whose other ranks are stopping);
        `reason` is what its exit counts as (a rank that failed after a peer: `group`)."""
        self._spawn_due, self._pending_reason = None, reason
        last = self.record.last_exit
        if last is not None and last.reason != reason.value:
            self.record.last_exit = dataclasses.replace(last, reason=reason.value)
        self._set_state(EngineState.BACKOFF)

    def stop_for_peer(self) -> None:
        """A data-parallel peer failed: stop (SIGTERM, stop_timeout, SIGKILL), then report."""
        if self._watching and self.desired is Desired.RUN:
            self._command = _Command.PEER_STOP
            self._wake.set()

    # --- operator commands (through the owner, on the loop) ----------------------------------
    def stop(self, deadline: float | None = None) -> None:
        self.desired = Desired.STOPPED
        # A pending backoff restart is cancelled: status must not keep announcing it.
        self._spawn_due, self._pending_reason, self.restart_at = None, None, None
        if deadline is not None:
            self._term_deadline = deadline
        if self._watching:
            self._command = _Command.STOP
        elif self.state is not EngineState.STOPPED:
            self._set_state(EngineState.STOPPED)
        self._wake.set()

    def start(self) -> None:
        self.desired = Desired.RUN
        self.fail_reason = ""
        if self._watching:
            return  # running, or being stopped: `desired` brings it back after the exit
        self._spawn_due = self.clock.monotonic()
        self._wake.set()

    def restart(self, reason: Reason = Reason.MANUAL) -> None:
        self.desired = Desired.RUN
        self.fail_reason = ""
        self._pending_reason = reason
        if self._watching:
            self._command = _Command.RESTART
        else:
            self._spawn_due = self.clock.monotonic()
        self._wake.set()

    def kill_now(self) -> None:
        """Second shutdown signal: no more waiting."""
        if self.child is not None and self.child.alive:
            self.child.signal_group(signal.SIGKILL)

    async def wait_for(self, predicate: Callable[[EngineView], bool], timeout_s: float) -> bool:
        """Until `predicate(view)` holds (True) or `timeout_s` passes (False)."""
        deadline = self.clock.monotonic() + timeout_s
        while not predicate(self.view()):
            left = deadline - self.clock.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return predicate(self.view())
        return True

    @property
    def down(self) -> bool:
        """Stopped or failed, and no process left."""
        return self.state in (EngineState.STOPPED, EngineState.FAILED) and not self._watching

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.log.close()

    # --- messages from the child -------------------------------------------------------------
    def on_message(self, msg: proto.ChildMessage) -> bool:
        """Apply a message from the child; False if it is from another incarnation."""
        if self._spawning is not None and (msg.engine, msg.incarnation) == self._spawning:
            self._early.append(msg)  # its spawn has not returned yet
            return True
        if isinstance(msg, proto.Goodbye) and 0 < msg.incarnation <= self.incarnation:
            # A cleanup report may arrive after an immediate restart already began: it changes
            # no state, so keep it (with its incarnation) rather than drop it as stale.
            self.record.cleanup = {**msg.cleanup, "incarnation": float(msg.incarnation)}
            return True
        vitals = self.vitals
        if (msg.engine, msg.incarnation) != self.address or vitals is None or self.pid is None:
            return False
        now = self.clock.monotonic()
        if isinstance(msg, proto.Heartbeat):
            was_busy = vitals.busy
            vitals.heartbeat_at, vitals.heartbeat = now, msg
            if vitals.busy and not was_busy:
                self._wake.set()  # the stall deadline may now come before the one it sleeps to
            # Otherwise a heartbeat only moves deadlines later: the watcher re-checks at the old
            # deadline with fresh data, and a fleet of idle engines costs no wake-ups.
        elif isinstance(msg, proto.Ready):
            self._on_ready(msg, now)
        elif isinstance(msg, proto.Progress):
            if msg.phase == proto.PHASE_CLEANUP:
                vitals.phase = msg.phase
                if vitals.cleanup_at is None:
                    vitals.cleanup_at = now  # only moves the hang deadline later: no wake-up
            elif self.state is EngineState.STARTING:
                # Loading phases; READY travels on another socket and may overtake the last.
                vitals.phase = msg.phase
        return True

    def _on_ready(self, msg: proto.Ready, now: float) -> None:
        vitals = self.vitals
        if self.state is not EngineState.STARTING or vitals is None or self.child is None:
            return
        vitals.ready, vitals.ready_at, vitals.heartbeat_at = msg, now, now
        vitals.phase = "serving"
        self.record.startup_s = now - vitals.spawned_at
        self._set_state(EngineState.READY)
        log.info("[ready] %s pid %d incarnation %d in %.3fs (device %s)", self.name,
                 self.child.pid, self.incarnation, self.record.startup_s, msg.device)
        self._wake.set()

    # --- state -------------------------------------------------------------------------------
    def _set_state(self, new: EngineState) -> None:
        old = self.state
        if new is old and new is not EngineState.STARTING:
            return
        self.state = check_transition(old, new)
        self.since = self.clock.wall()
        self.deps.on_state(self.name, old, new)
        self._changed.set()
        self._changed = asyncio.Event()

    def _child_config(self, incarnation: int) -> proto.EngineConfig:
        spec = self.spec
        return proto.EngineConfig(
            # a standby is not a rank of the group (no data-parallel group has standbys)
            name=spec.name, group=spec.group, rank=0 if spec.standby else spec.rank,
            replicas=spec.replicas,
            incarnation=incarnation, model=spec.model.source, dtype=spec.model.dtype,
            gpus=list(spec.gpus), data_parallel=spec.data_parallel,
            max_batch_size=spec.max_batch_size, threads=spec.threads,
            control_endpoint=self.deps.control_endpoint,
            request_endpoint=self.deps.request_endpoint,
            heartbeat_interval_s=self.deps.heartbeat_interval_s,
            rendezvous=self.owner.rendezvous, python=spec.python, backend=spec.backend,
            engine_args={key: json.loads(value) for key, value in spec.engine_args})


def _lost_because(reason: Reason, requested: _Command | None) -> str:
    """Why requests still on an incarnation failed, for their error text."""
    if requested is _Command.STOP:
        return "was stopped"
    if requested is _Command.RESTART:
        return "was restarted"
    if requested is _Command.PEER_STOP:
        return "was stopped with its data-parallel group"
    return {Reason.HANG: "hung (no heartbeat)", Reason.STALL: "stalled (no loop progress)",
            Reason.STARTUP_TIMEOUT: "did not become READY in time"}.get(reason, "exited")
