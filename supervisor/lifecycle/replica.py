"""One supervised engine replica: a slot that outlives its processes.

The slot holds what belongs to the replica whatever process fills it: its spec, desired state
(run or stopped), lifecycle state, the record of its exits and restarts (`History`) and a
pending backoff. Each process it starts is an `Incarnation` (supervisor.incarnation), created
when the spawn starts and handed over whole when a warm standby is promoted.

No policy lives here. An exit that nobody asked for is reported to the replica's owner (its
group, supervisor.groups), which takes the decision and tells the replica what to do (`apply`,
`hold`, `promote`). Operator commands reach a replica through its owner, too. Everything runs on
the daemon's event loop: commands, child messages and the child's exit only change fields and
wake the replica's coroutine (`run`). What happened is published (supervisor.notices); readers
get an immutable `EngineView`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from engined.engine import protocol as proto
from engined.supervisor.host.gpus import Nvml
from engined.supervisor.host.launcher import Launcher
from engined.supervisor.host.oom import OomWitness
from engined.supervisor.host.reaper import Reaper
from engined.supervisor.lifecycle import messages
from engined.supervisor.lifecycle.clock import Clock, to_wall
from engined.supervisor.lifecycle.history import Down, History, SpawnFailure
from engined.supervisor.lifecycle.incarnation import Incarnation, LivenessStrategy
from engined.supervisor.lifecycle.liveness import HeartbeatLiveness, ProbeLiveness
from engined.supervisor.lifecycle.loopmonitor import LoopMonitor
from engined.supervisor.lifecycle.notices import Notices, StateChange
from engined.supervisor.lifecycle.policy import Action, Decision, FailureHistory
from engined.supervisor.lifecycle.probe import ProbeClient
from engined.supervisor.lifecycle.state import EngineState, Reason, check_transition
from engined.supervisor.lifecycle.view import EngineView
from engined.supervisor.logs import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES, LogSink, StdoutLines
from engined.supervisor.spec.model import EngineSpec

log = logging.getLogger("engined.engine")

Address = tuple[str, int]


class Desired(enum.Enum):
    RUN = "run"
    STOPPED = "stopped"
    ASLEEP = "asleep"  # stopped until a request or an operator wakes it (routing.ondemand)


class Command(enum.Enum):
    STOP = "stop"
    RESTART = "restart"
    PEER_STOP = "peer_stop"  # the owner stops it because a data-parallel peer failed
    SLEEP = "sleep"  # vLLM's sleep mode: drained, then asleep with its process kept
    WAKE = "wake"  # out of vLLM's sleep mode


class SleepInPlace(Protocol):
    """vLLM's sleep mode for one incarnation (supervisor.routing.sleepmode): each returns the
    error, or None once done."""

    async def sleep(self, spec: EngineSpec, inc: Incarnation) -> str | None: ...

    async def wake(self, spec: EngineSpec, inc: Incarnation) -> str | None: ...


@dataclass
class Intent:
    """What commands ask of the replica's worker (supervisor.worker), which carries it out."""

    spawn_due: float | None = None  # monotonic: spawn then (a backoff, a start)
    reason: Reason | None = None  # what the next spawn is counted as
    command: Command | None = None  # for the live incarnation: stop or restart it
    stop_by: float | None = None  # a shared shutdown deadline for that stop
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)


class Owner(Protocol):
    """The group a replica belongs to; it decides what follows an exit."""

    @property
    def rendezvous(self) -> str | None: ...

    def on_down(self, replica: Replica, down: Down) -> None: ...

    def on_spawn_failed(self, replica: Replica, failure: SpawnFailure) -> None: ...

    def failures(self, replica: Replica) -> FailureHistory: ...

    def resume_failures(self, replica: Replica, history: FailureHistory) -> None: ...


class AddressBook:
    """Which replica a child's messages belong to, by the address they carry: bound when a spawn
    starts (a forked child may speak before its spawn returns) and when a standby's incarnation
    is promoted (it keeps speaking under the standby's name); a replica keeps its last two bound,
    so a cleanup report that comes after the exit still finds it."""

    KEPT = 2

    def __init__(self) -> None:
        self._owners: dict[Address, Replica] = {}

    def bind(self, address: Address, replica: Replica) -> None:
        self._owners[address] = replica

    def unbind(self, address: Address, replica: Replica) -> None:
        if self._owners.get(address) is replica:
            del self._owners[address]

    def owner(self, address: Address) -> Replica | None:
        return self._owners.get(address)


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
    monitor: LoopMonitor  # the daemon's own pauses move every liveness deadline back
    notices: Notices = field(default_factory=Notices)
    addresses: AddressBook = field(default_factory=AddressBook)
    reaper: Reaper | None = None  # clears what an exited incarnation left behind
    nvml: Nvml | None = None  # with a driver: wait for the GPU memory of the dead to be freed
    oom: OomWitness | None = None  # says whether the OOM killer sent an unexpected SIGKILL
    log_max_bytes: int = DEFAULT_MAX_BYTES  # supervisor.log_max_bytes
    log_backups: int = DEFAULT_BACKUPS  # supervisor.log_backups
    stdout: StdoutLines | None = None  # supervisor.engine_logs: stdout
    rng: random.Random = field(default_factory=random.Random)
    probes: ProbeClient = field(default_factory=ProbeClient)  # command engines' HTTP probes
    # requests routed to an incarnation now (supervisor.routing counts them)
    in_flight: Callable[[Incarnation], int] = lambda incarnation: 0
    counted: Callable[[], None] = lambda: None  # a request counted (the state snapshot is due)
    # a group's LoRA adapters, the spec's and those loaded at run time (routing.adapters)
    adapters: Callable[[str], dict[str, str]] = lambda group: {}
    in_place: SleepInPlace | None = None  # sleep_mode level1/level2 (None: they sleep by a stop)

    def liveness_for(self, spec: EngineSpec, incarnation: Callable[[], Incarnation]
                     ) -> LivenessStrategy:
        """The one place that tells an engine child from a server of its own."""
        if spec.is_command:
            return ProbeLiveness(spec, self.probes, self.clock, self.monitor,
                                 lambda: self.in_flight(incarnation()),
                                 lambda: incarnation().asleep)
        return HeartbeatLiveness(self.heartbeat_interval_s, self.heartbeat_timeout_s)


class Slot:
    """What a replica is now, derived from its fields: the read side (Replica writes them)."""

    spec: EngineSpec
    state: EngineState
    desired: Desired
    current: Incarnation | None
    previous: Incarnation | None
    intent: Intent
    task: asyncio.Task[None] | None
    clock: Clock
    _bound: list[Address]
    _changed: asyncio.Event  # replaced at each state change (`wait_for` waits on it)

    def view(self) -> EngineView:
        raise NotImplementedError

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

    async def wait_stopped(self, timeout_s: float) -> bool:
        """Until it is stopped and no process of it is left or coming. A spawn in flight (a
        fork server's round trip) has no pid yet but brings a child: its stop waits for it."""
        return await self.wait_for(lambda view: self.current is None and not view.wanted,
                                   timeout_s)

    def kill_now(self) -> None:
        """Second shutdown signal: no more waiting."""
        if self.current is not None and self.current.alive:
            self.current.kill(self.clock.monotonic())

    def knows(self, address: Address) -> bool:
        """Whether `address` is one of its last incarnations' (a late cleanup report's)."""
        return address in self._bound

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def standby(self) -> bool:
        """A warm spare: built and heartbeating, not routed; promoted when a replica dies."""
        return self.spec.standby

    @property
    def wakeup(self) -> asyncio.Event:
        """Set to have its worker look again (supervisor.lifecycle.worker)."""
        return self.intent.wakeup

    @property
    def wanted(self) -> bool:
        return self.desired is Desired.RUN

    @property
    def asleep_in_place(self) -> bool:
        """ASLEEP with its process kept (vLLM's sleep mode)."""
        return self.state is EngineState.ASLEEP and self.current is not None

    @property
    def at_rest(self) -> EngineState:
        """The state it settles in without a process when not wanted: ASLEEP or STOPPED."""
        return EngineState.ASLEEP if self.desired is Desired.ASLEEP else EngineState.STOPPED

    @property
    def pid(self) -> int | None:
        return self.current.pid if self.current is not None else None

    @property
    def active(self) -> bool:
        """It has a process whose exit is not handled yet (spawning, running, or exited a moment
        ago and about to be reported). Commands and owners go by this, not by the process alone:
        acting on "no process" before the exit is handled would race that handling."""
        return self.current is not None

    @property
    def settled(self) -> bool:
        """Down and accounted for: no process, and its exit (if any) already handled."""
        return self.current is None and self.state in (
            EngineState.STOPPED, EngineState.BACKOFF, EngineState.FAILED, EngineState.ASLEEP)

    @property
    def down(self) -> bool:
        """Stopped or failed, and no process left."""
        return self.current is None and self.state in (EngineState.STOPPED, EngineState.FAILED)

    @property
    def supervising(self) -> bool:
        return self.task is not None and not self.task.done()

    @property
    def ready_since(self) -> float | None:
        """Monotonic start of the current (or just ended) incarnation's READY run."""
        inc = self.current or self.previous
        return inc.vitals.ready_at if inc is not None and inc.vitals is not None else None

    def serving(self) -> Incarnation | None:
        """The incarnation requests may go to: READY, wanted, alive (routing asks this)."""
        inc = self.current
        if self.state is not EngineState.READY or not self.wanted or inc is None or not inc.alive:
            return None
        return inc

    @property
    def promotable(self) -> bool:
        """A READY standby whose process serves (not one already in its cleanup)."""
        inc = self.serving()
        return (self.standby and inc is not None and inc.vitals is not None
                and inc.vitals.phase == "serving")


class Replica(Slot):
    def __init__(self, spec: EngineSpec, deps: ReplicaDeps, owner: Owner) -> None:
        self.spec, self.deps, self.owner, self.clock = spec, deps, owner, deps.clock
        self.log = LogSink(deps.log_dir / f"{spec.name}.log", deps.log_max_bytes,
                           deps.log_backups, deps.stdout, spec.name)
        # on demand (routing.ondemand): the replicas past min_replicas start asleep
        self.desired = Desired.ASLEEP if spec.starts_asleep else Desired.RUN
        self.state = self.at_rest
        self.incarnation = 0  # how many incarnations this replica has had (promotions count)
        self.current: Incarnation | None = None  # spawned (or spawning), exit not yet handled
        self.previous: Incarnation | None = None  # the last one, for status after its exit
        self.history = History(self.log)
        self.since = self.clock.wall()
        self.restart_at: float | None = None  # monotonic, while a backoff waits
        self.fail_reason = ""
        self.intent = Intent()
        self.task: asyncio.Task[None] | None = None  # its worker (supervisor.worker.supervise)
        self._changed = asyncio.Event()
        self._bound: list[Address] = []

    def count_request(self, outcome: str) -> None:
        self.history.requests[outcome] += 1
        self.deps.counted()

    def view(self) -> EngineView:
        return view_of(self)

    # --- what the owner tells it -------------------------------------------------------------
    def apply(self, decision: Decision, reason: Reason) -> None:
        """Carry out the owner's decision after an exit; `reason` is counted if it restarts."""
        if not self.wanted:
            return
        self.intent.wakeup.set()
        if decision.action is Action.RESTART:
            self.intent.reason = reason
            self.intent.spawn_due = self.clock.monotonic() + decision.delay_s
            # BACKOFF even for an immediate restart: until the respawn (its leftovers are
            # cleared first) nothing may take the dead incarnation for a live READY one
            self.restart_at = self.intent.spawn_due if decision.delay_s > 0 else None
            self.set_state(EngineState.BACKOFF)
        elif decision.action is Action.FAIL:
            self.fail_reason = decision.why
            self.set_state(EngineState.FAILED)
        else:
            self.desired = Desired.STOPPED
            self.set_state(EngineState.STOPPED)

    def promote(self, spare: Replica, reason: Reason) -> None:
        """Take over a READY standby's incarnation at once (this replica's own has just died,
        its exit handled): routable under this name from now on, a new incarnation counted
        with `reason`. The standby starts building a new spare; GPUs swap with the process."""
        assert self.current is None and spare.current is not None
        inc = spare.current
        if self.spec.gpus != spare.spec.gpus:  # the process keeps its GPUs; the spare takes ours
            self.spec, spare.spec = (dataclasses.replace(self.spec, gpus=spare.spec.gpus),
                                     dataclasses.replace(spare.spec, gpus=self.spec.gpus))
        spare.hand_over()
        self.history.restarts[reason] += 1
        self.incarnation += 1
        self.current = inc
        self.bind(inc.address)
        if inc.pipe is not None:
            inc.pipe.sink = self.log
        inc.log_mark = self.log.lines_total
        inc.adopted(self.clock.monotonic())
        self.history.startup_s = 0.0
        self.intent.spawn_due, self.intent.reason, self.restart_at = None, None, None
        self.log.note(f"promoted standby {spare.name}'s pid {inc.pid} (its incarnation "
                      f"{inc.address[1]}) as incarnation {self.incarnation}")
        log.warning("[standby] %s: promoted %s's pid %s as incarnation %d; %s builds a new "
                    "standby", self.name, spare.name, inc.pid, self.incarnation, spare.name)
        self.set_state(EngineState.STARTING)
        self.set_state(EngineState.READY)
        self.intent.wakeup.set()

    def hand_over(self) -> None:
        """A standby's incarnation goes to the replica it replaces; a new standby is built."""
        self.current = None
        self.intent.spawn_due = self.clock.monotonic()
        self.log.note("handed over to the replica it replaces; building a new standby")
        self.set_state(EngineState.STARTING)
        self.intent.wakeup.set()

    def hold(self, reason: Reason) -> None:
        """Down, waiting for the owner's decision (a gang whose other ranks are stopping);
        `reason` is what its exit counts as (a rank that failed after a peer: `group`)."""
        self.intent.spawn_due, self.intent.reason = None, reason
        self.history.relabel(reason)
        self.set_state(EngineState.BACKOFF)

    def stop_for_peer(self) -> None:
        """A data-parallel peer failed: stop (SIGTERM, stop_timeout, SIGKILL), then report."""
        if self.current is not None and self.wanted:
            self.intent.command = Command.PEER_STOP
            self.intent.wakeup.set()

    # --- operator commands (through the owner, on the loop) ----------------------------------
    def stop(self, deadline: float | None = None, desired: Desired = Desired.STOPPED) -> None:
        """SIGTERM, stop_timeout, SIGKILL; then STOPPED (or ASLEEP: a sleep is such a stop)."""
        self.desired = desired
        # A pending backoff restart is cancelled: status must not keep announcing it.
        self.intent.spawn_due, self.intent.reason, self.restart_at = None, None, None
        inc = self.current
        if deadline is not None:
            self.intent.stop_by = deadline
            if inc is not None and inc.term_deadline is not None:  # already stopping: sooner
                inc.term_deadline = min(inc.term_deadline, deadline)
        if inc is not None:
            self.intent.command = Command.STOP
        elif self.state is not self.at_rest:
            self.set_state(self.at_rest)
        self.intent.wakeup.set()

    def sleep(self) -> None:
        """To sleep (routing.ondemand): in place where its sleep_mode is vLLM's and it serves
        (drained, then vLLM's sleep; its process kept), else by a stop."""
        if self.asleep_in_place:  # being woken: it sleeps in place again once awake (worker)
            self.desired = Desired.ASLEEP
            self.intent.command = None if self.intent.command is Command.WAKE else \
                self.intent.command
            return None
        if not (self.spec.sleep_level and self.deps.in_place and self.serving()):
            return self.stop(desired=Desired.ASLEEP)
        self.desired, self.intent.command = Desired.ASLEEP, Command.SLEEP  # routed nothing more
        self.intent.wakeup.set()

    def start(self) -> None:
        self.desired, self.fail_reason = Desired.RUN, ""
        if self.asleep_in_place:
            self.intent.command = Command.WAKE
            self.intent.wakeup.set()
        if self.current is not None:  # running, stopping (`desired` brings it back after the
            return  # exit), or going to sleep in place (woken as the sleep ends)
        self.intent.spawn_due = self.clock.monotonic()
        self.intent.wakeup.set()

    def restart(self, reason: Reason = Reason.MANUAL) -> None:
        self.desired, self.fail_reason = Desired.RUN, ""
        self.intent.reason = reason
        if self.current is not None:
            self.intent.command = Command.RESTART
        else:
            self.intent.spawn_due = self.clock.monotonic()
        self.intent.wakeup.set()

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        for address in self._bound:
            self.deps.addresses.unbind(address, self)
        self.log.close()

    # --- messages from its processes (supervisor.lifecycle.messages) -----------------------
    def on_message(self, msg: proto.ChildMessage) -> bool:
        """Apply a message from the child; False if it is from another incarnation."""
        return messages.deliver(self, msg)

    # --- what its worker tells it (supervisor.lifecycle.worker) -----------------------------
    def watched(self, task: asyncio.Task[None]) -> None:
        self.task = task

    def spawning(self, inc: Incarnation) -> None:
        """A spawn began: a fork server's round trip follows, and meanwhile the replica counts
        as running (not settled; a stop, restart or a peer's stop is held for the new child)."""
        self.current = inc
        self.bind(inc.address)

    def spawn_failed(self) -> None:
        self.current = None

    def spawned(self, number: int) -> None:
        """The spawn of incarnation `number` returned a process: STARTING."""
        self.incarnation, self.restart_at = number, None
        self.set_state(EngineState.STARTING)

    def exited(self, inc: Incarnation) -> None:
        """Its process's exit is being handled: kept as `previous` for status."""
        self.current, self.previous = None, inc

    # --- what the fleet tells it (supervisor.lifecycle.fleet) ------------------------------
    def respec(self, spec: EngineSpec) -> None:
        """A reload's spec for it: equivalent (a new group size) or changed (it restarts)."""
        self.spec = spec

    def join(self, owner: Owner) -> None:
        self.owner = owner

    # --- what a hand-over restores (supervisor.upgrade): a record, not a transition ---------
    def restore(self, incarnation: int, desired: Desired, state: EngineState,
                fail_reason: str = "", spawn_due: float | None = None,
                reason: Reason | None = None, restart_at: float | None = None) -> None:
        """As the engined it replaces (or that crashed) left it: set, not entered (no state
        change published, no transition checked); a spawn due is scheduled for its worker."""
        self.incarnation, self.desired, self.state = incarnation, desired, state
        self.fail_reason, self.restart_at = fail_reason, restart_at
        if spawn_due is not None:
            self.intent.spawn_due, self.intent.reason = spawn_due, reason

    def adopt(self, inc: Incarnation) -> None:
        """A live process of its own (handed over, or a crashed engined's): STARTING until
        reachable (`reattached`) or, if it was still loading, its READY."""
        self.current = inc
        self.bind(inc.address)
        self.state = EngineState.STARTING

    def reattached(self) -> None:
        """Its adopted incarnation is reachable again: READY as it was (its startup time and
        its READY run are the ones it had)."""
        inc = self.current
        assert inc is not None and inc.vitals is not None
        inc.reattaching = False
        inc.vitals.phase = "serving"
        inc.vitals.heartbeat_at = self.clock.monotonic()
        log.info("[upgrade] %s pid %s incarnation %d re-attached", self.name, inc.pid,
                 self.incarnation)
        inc.asleep = self.desired is Desired.ASLEEP and bool(self.spec.sleep_level)  # in place
        self.set_state(EngineState.ASLEEP if inc.asleep else EngineState.READY)
        if inc.resumed_since is not None:
            self.since = inc.resumed_since  # in READY since before the hand-over
        self.intent.wakeup.set()

    # --- state -------------------------------------------------------------------------------
    def set_state(self, new: EngineState) -> None:
        old = self.state
        if new is old and new is not EngineState.STARTING:
            return
        self.state = check_transition(old, new)
        self.since = self.clock.wall()
        self.deps.notices.state.publish(StateChange(self.view(), old))
        self._changed.set()
        self._changed = asyncio.Event()

    def bind(self, address: Address) -> None:
        self.deps.addresses.bind(address, self)
        self._bound = [a for a in self._bound if a != address] + [address]
        while len(self._bound) > AddressBook.KEPT:
            self.deps.addresses.unbind(self._bound.pop(0), self)

    def child_config(self, number: int) -> proto.EngineConfig:
        return child_config(self, number)


def view_of(replica: Replica) -> EngineView:
    """The immutable snapshot status, metrics and health read (supervisor.lifecycle.view)."""
    inc = replica.current or replica.previous
    vitals = inc.vitals if inc is not None else None
    live = vitals if replica.pid is not None else None
    seen_at = vitals.heartbeat_at if vitals else None
    child = inc.child if inc is not None else None
    spec, clock = replica.spec, replica.clock
    now = clock.monotonic()
    return EngineView(
        name=spec.name, group=spec.group, rank=spec.rank, model=spec.model.source,
        gpus=spec.gpus, state=replica.state, wanted=replica.wanted, pid=replica.pid,
        incarnation=replica.incarnation, since=replica.since,
        spawned_at=to_wall(clock, vitals.spawned_at) if vitals else None,
        heartbeat_at=to_wall(clock, seen_at) if seen_at is not None else None,
        heartbeat_age_s=(round(now - seen_at, 3)
                         if live is not None and seen_at is not None else None),
        heartbeat=live.heartbeat if live else None, ready=vitals.ready if vitals else None,
        phase=vitals.phase if vitals else "",
        restart_at=to_wall(clock, replica.restart_at) if replica.restart_at else None,
        fail_reason=replica.fail_reason, data_parallel=spec.data_parallel,
        port=child.port if child is not None else None, command=spec.is_command,
        standby=spec.standby, launcher=child.launcher if child is not None else "",
        adopted_at=inc.adopted_at if inc is not None else None, desired=replica.desired.value,
        **replica.history.view_fields())


def child_config(replica: Replica, number: int) -> proto.EngineConfig:
    """What incarnation `number` of `replica` is started with (the engine child's config)."""
    spec, deps = replica.spec, replica.deps
    return proto.EngineConfig(
        # a standby is not a rank of the group (no data-parallel group has standbys)
        name=spec.name, group=spec.group, rank=0 if spec.standby else spec.rank,
        replicas=spec.replicas, incarnation=number, model=spec.model.source,
        dtype=spec.model.dtype, gpus=list(spec.gpus), data_parallel=spec.data_parallel,
        max_batch_size=spec.max_batch_size, threads=spec.threads,
        memory_limit=spec.memory_limit, sleep_level=spec.sleep_level,
        control_endpoint=deps.control_endpoint, request_endpoint=deps.request_endpoint,
        heartbeat_interval_s=deps.heartbeat_interval_s, rendezvous=replica.owner.rendezvous,
        python=spec.python, backend=spec.backend,
        engine_args={key: json.loads(value) for key, value in spec.engine_args},
        frontend_args={key: json.loads(value) for key, value in spec.frontend_args},
        adapters={} if spec.is_command else {**dict(spec.adapters),
                                             **deps.adapters(spec.group)})
