"""The fleet: every replica and its group, name resolution (replica, group, `all`), operator
commands, rolling restarts, reload, shutdown, the messages of every child (by the address they
carry), and the read-only view everything else reports from."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from typing import Callable

from engined.engine import protocol as proto
from engined.supervisor.lifecycle.clock import Clock
from engined.supervisor.lifecycle.groups import Gang, Group, ReplicaGroup
from engined.supervisor.lifecycle.replica import AddressBook, Owner, Replica
from engined.supervisor.lifecycle.rollout import Drains, Rollout
from engined.supervisor.lifecycle.state import EngineState, Reason
from engined.supervisor.lifecycle.view import FleetView
from engined.supervisor.lifecycle.worker import supervise
from engined.supervisor.spec.model import EngineSpec, FleetSpec
from engined.supervisor.spec.reload import ReloadPlan

log = logging.getLogger("engined.fleet")

ACTIONS = ("start", "stop", "restart")
_RETIRE_MARGIN_S = 10.0  # past stop_timeout: SIGKILL and the reaping take a moment

MakeReplica = Callable[[EngineSpec, Owner], Replica]


class UnknownEngine(KeyError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"unknown engine {self.name!r}"


class Fleet:
    def __init__(self, spec: FleetSpec, make_replica: MakeReplica, clock: Clock,
                 router: Drains, addresses: AddressBook,
                 rng: random.Random | None = None) -> None:
        self.spec = spec
        self.router = router  # a rollout drains through it
        self.addresses = addresses  # the replicas bind their children's addresses in it
        self.stopping = False  # engined is shutting down (/readyz answers 503)
        self._rollouts: dict[str, asyncio.Task[None]] = {}
        self.make_replica = make_replica
        self.clock = clock
        self.rng = rng or random.Random()
        self.groups: dict[str, Group] = {}
        self.replicas: dict[str, Replica] = {}
        for engine in spec.engines:
            self.replicas[engine.name] = make_replica(engine, self._group_for(engine))
        self._regroup()
        self._rr = 0
        self.retiring: dict[str, Replica] = {}  # removed by a reload, still stopping
        self._retire_tasks: set[asyncio.Task[None]] = set()

    # --- views -------------------------------------------------------------------------------
    def view(self) -> FleetView:
        return FleetView(tuple(r.view() for r in self.replicas.values()), self.stopping)

    def counts(self) -> tuple[int, int]:
        return self.view().counts()

    def starting(self) -> int:
        """Replicas STARTING: children that still have their ZeroMQ connections to open."""
        return sum(1 for r in self.replicas.values() if r.state is EngineState.STARTING)

    # --- lookup ------------------------------------------------------------------------------
    def resolve(self, name: str) -> list[Replica]:
        """A replica name, a group name, or `all`; raises UnknownEngine."""
        if name == "all":
            return list(self.replicas.values())
        if name in self.replicas:
            return [self.replicas[name]]
        members = [r for r in self.replicas.values() if r.spec.group == name]
        if not members:
            raise UnknownEngine(name)
        return members

    def affected(self, name: str) -> list[Replica]:
        """What a command on `name` acts on: a data-parallel rank brings its whole gang."""
        out: dict[str, Replica] = {}
        for replica in self.resolve(name):
            owner = self.groups[replica.spec.group]
            for member in (owner.members if isinstance(owner, Gang) else [replica]):
                out[member.name] = member
        return list(out.values())

    def command(self, action: str, name: str, all_at_once: bool = False) -> list[Replica]:
        """start/stop/restart a replica, a group or `all`; returns every replica affected.

        A restart of a plain group's replicas rolls (rollout: max_unavailable, max_surge) unless
        `all_at_once`; a data-parallel gang always restarts as a whole."""
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}")
        replicas = self.affected(name)
        by_group: dict[str, list[Replica]] = {}
        for replica in replicas:
            by_group.setdefault(replica.spec.group, []).append(replica)
        for group, members in by_group.items():
            owner = self.groups[group]
            if action != "restart" or all_at_once or isinstance(owner, Gang):
                self._cancel_rollout(group)
                getattr(owner, action)(members)
            else:
                self.roll(group, members, Reason.MANUAL)
        return replicas

    # --- rolling restarts --------------------------------------------------------------------
    def roll(self, group: str, members: list[Replica], reason: Reason) -> None:
        """Replace `members` a few at a time (supervisor.rollout) in the background; the
        failure histories reset as for any operator restart."""
        self._cancel_rollout(group)
        owner = self.groups[group]
        if isinstance(owner, ReplicaGroup):
            for member in members:
                owner.forget(member)
        rollout = Rollout(self.router, group, members, reason,
                          lambda k: self.add_surge(group, k), self.retire_surge)
        task = asyncio.get_running_loop().create_task(rollout.run(), name=f"rollout:{group}")
        self._rollouts[group] = task
        task.add_done_callback(lambda t: self._rollouts.get(group) is t
                               and self._rollouts.pop(group))

    def _cancel_rollout(self, group: str) -> None:
        task = self._rollouts.pop(group, None)
        if task is not None and not task.done():
            log.warning("[rollout] %s: cancelled by a newer command", group)
            task.cancel()

    def add_surge(self, group: str, index: int) -> Replica:
        """A temporary extra replica of `group` for a rollout (named GROUP+K: no spec name
        can take that form)."""
        template = next(r.spec for r in self.replicas.values() if r.spec.group == group)
        engine = dataclasses.replace(template, name=f"{group}+{index}", rank=0)
        replica = self.make_replica(engine, self.groups[group])
        self.replicas[engine.name] = replica
        supervise(replica)
        return replica

    def retire_surge(self, replica: Replica) -> None:
        if self.replicas.get(replica.name) is replica:
            del self.replicas[replica.name]
            self._retire(replica)

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        for replica in self.replicas.values():
            supervise(replica)

    async def shutdown(self, deadline_s: float | None = None) -> None:
        """Stop every engine in parallel under one shared deadline."""
        for group in list(self._rollouts):
            self._cancel_rollout(group)  # a rollout must not restart anything now
        replicas = list(self.replicas.values())
        budget = deadline_s if deadline_s is not None else max(
            (r.spec.stop_timeout_s for r in replicas), default=0.0)
        deadline = self.clock.monotonic() + budget
        for replica in replicas:
            replica.stop(deadline=deadline)
        await asyncio.gather(
            *(r.wait_stopped(budget + _RETIRE_MARGIN_S) for r in replicas),
            *self._retire_tasks, return_exceptions=True)
        await asyncio.gather(*(r.close() for r in replicas))

    def apply(self, spec: FleetSpec, plan: ReloadPlan) -> None:
        """Carry out a reload plan: only added, removed and changed replicas are touched."""
        self.spec = spec
        for engine in plan.unchanged:
            self.replicas[engine.name].respec(engine)  # equivalent (e.g. new group size)
        for engine in plan.changed:
            self.replicas[engine.name].respec(engine)
        for name in plan.removed:
            self._retire(self.replicas.pop(name))
        added = []
        for engine in plan.added:
            replica = self.make_replica(engine, self._group_for(engine))
            self.replicas[engine.name] = replica
            added.append(replica)
        order = {e.name: i for i, e in enumerate(spec.engines)}
        self.replicas = dict(sorted(self.replicas.items(),
                                    key=lambda kv: order.get(kv[0], len(order))))
        self._regroup()
        changed = {e.name for e in plan.changed}
        # A changed data-parallel group restarts as a gang (fresh rendezvous), together with any
        # ranks it gained; a changed plain replica restarts on its own.
        for owner in self.groups.values():
            members = [m for m in owner.members if m.name in changed and m.wanted]
            if isinstance(owner, Gang):
                if members or any(m in added for m in owner.members):
                    owner.restart([m for m in owner.members if m not in added and m.wanted],
                                  Reason.RELOAD)
            elif members:
                self.roll(owner.name, members, Reason.RELOAD)
        for replica in added:
            supervise(replica)

    def _group_for(self, engine: EngineSpec) -> Group:
        owner = self.groups.get(engine.group)
        kind = Gang if engine.data_parallel else ReplicaGroup
        if not isinstance(owner, kind):
            owner = kind(engine.group, self.rng)
            self.groups[engine.group] = owner
        return owner

    def _regroup(self) -> None:
        """One owner per group, over its current replicas (after a start or a reload)."""
        old, self.groups = self.groups, {}
        for replica in self.replicas.values():
            engine = replica.spec
            kind = Gang if engine.data_parallel else ReplicaGroup
            owner = self.groups.get(engine.group)
            if owner is None:
                previous = old.get(engine.group)
                owner = previous if isinstance(previous, kind) else kind(engine.group, self.rng)
                owner.members = []
                self.groups[engine.group] = owner
            owner.members.append(replica)
            replica.join(owner)

    def _retire(self, replica: Replica) -> None:
        """Stop a removed replica in the background and drop it once it is down."""
        async def retire() -> None:
            replica.stop()
            await replica.wait_stopped(replica.spec.stop_timeout_s + _RETIRE_MARGIN_S)
            await replica.close()
            if self.retiring.get(replica.name) is replica:
                del self.retiring[replica.name]
        self.retiring[replica.name] = replica
        task = asyncio.get_running_loop().create_task(retire(), name=f"retire:{replica.name}")
        self._retire_tasks.add(task)
        task.add_done_callback(self._retire_tasks.discard)

    def kill_all_now(self) -> None:
        for replica in [*self.replicas.values(), *self.retiring.values()]:
            replica.kill_now()

    # --- messages ----------------------------------------------------------------------------
    def on_message(self, msg: proto.ChildMessage) -> str | None:
        """Route a child's message to its replica; a drop reason if it has none."""
        replica = (self.addresses.owner((msg.engine, msg.incarnation))
                   or self.replicas.get(msg.engine) or self.retiring.get(msg.engine))
        if replica is None:
            return "unknown_engine"
        return None if replica.on_message(msg) else "stale"


__all__ = ["Fleet", "UnknownEngine"]
