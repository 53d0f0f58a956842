"""The fleet: every engine handle, name resolution (replica, group, `all`), commands, shutdown."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from engine import protocol as proto
from supervisor.gang import GangGroup, new_rendezvous
from supervisor.handle import Desired, EngineHandle, HandleDeps
from supervisor.ipc import EngineChannels, RequestFailed, RequestTimeout
from supervisor.policy import Reason
from supervisor.reload import ReloadPlan
from supervisor.spec import EngineSpec, FleetSpec
from supervisor.state import EngineState

log = logging.getLogger("engined.fleet")


class UnknownEngine(KeyError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"unknown engine {self.name!r}"


class NoEngineReady(Exception):
    pass


class Fleet:
    def __init__(self, spec: FleetSpec,
                 make_handle: Callable[[EngineSpec], EngineHandle]) -> None:
        self.spec = spec
        self.make_handle = make_handle
        self.handles: dict[str, EngineHandle] = {e.name: make_handle(e) for e in spec.engines}
        self.gangs: dict[str, GangGroup] = {}
        self._rebuild_gangs()
        self._rr = 0
        self.retiring: dict[str, EngineHandle] = {}  # removed by a reload, still stopping
        self._retire_tasks: set[asyncio.Task[None]] = set()

    # --- lookup ------------------------------------------------------------------------------
    def groups(self) -> dict[str, list[EngineHandle]]:
        groups: dict[str, list[EngineHandle]] = {}
        for handle in self.handles.values():
            groups.setdefault(handle.spec.group, []).append(handle)
        return groups

    def resolve(self, name: str) -> list[EngineHandle]:
        """A replica name, a group name, or `all`; raises UnknownEngine."""
        if name == "all":
            return list(self.handles.values())
        if name in self.handles:
            return [self.handles[name]]
        members = self.groups().get(name)
        if not members:
            raise UnknownEngine(name)
        return members

    def command(self, action: str, name: str) -> list[EngineHandle]:
        """start/stop/restart a replica, a group or `all`; data-parallel ranks act as a gang
        (one rank cannot rejoin its group alone). Returns every handle affected."""
        handles = self.resolve(name)
        gangs = {h.gang.name: h.gang for h in handles if h.gang is not None}
        handles = [h for h in handles if h.gang is None]
        for gang in gangs.values():
            handles.extend(gang.members)
            if action == "restart":
                gang.restart()
            elif action == "start":
                gang.start()
        for handle in handles:
            if handle.gang is None or action == "stop":
                getattr(handle, action)()
        return handles

    def _rebuild_gangs(self) -> None:
        """One GangGroup per data-parallel group, over its current replicas."""
        old, self.gangs = self.gangs, {}
        for handle in self.handles.values():
            if not handle.spec.data_parallel:
                handle.gang = None
                continue
            group = handle.spec.group
            if group not in self.gangs:
                self.gangs[group] = old.get(group) or GangGroup(group)
                self.gangs[group].members = []
            self.gangs[group].add(handle)

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        for handle in self.handles.values():
            handle.start_supervising()

    async def shutdown(self, deadline_s: float | None = None) -> None:
        """Stop every engine in parallel under one shared deadline."""
        handles = list(self.handles.values())
        budget = deadline_s if deadline_s is not None else max(
            (h.spec.stop_timeout_s for h in handles), default=0.0)
        deadline = time.monotonic() + budget
        for handle in handles:
            handle.stop(deadline=deadline)
        await asyncio.gather(*(h.wait_for(_is_down, budget + 10.0) for h in handles),
                             *self._retire_tasks, return_exceptions=True)
        await asyncio.gather(*(h.close() for h in handles))

    def apply(self, spec: FleetSpec, plan: ReloadPlan) -> None:
        """Carry out a reload plan: only added, removed and changed replicas are touched."""
        self.spec = spec
        for engine in plan.unchanged:
            self.handles[engine.name].spec = engine  # equivalent spec (e.g. new group size)
        for engine in plan.changed:
            handle = self.handles[engine.name]
            handle.spec = engine
            if handle.desired is Desired.RUN and not engine.data_parallel:
                handle.restart(Reason.RELOAD)
        for name in plan.removed:
            self._retire(self.handles.pop(name))
        added = []
        for engine in plan.added:
            handle = self.make_handle(engine)
            self.handles[engine.name] = handle
            added.append(handle)
        order = {e.name: i for i, e in enumerate(spec.engines)}
        self.handles = dict(sorted(self.handles.items(), key=lambda kv: order[kv[0]]))
        self._rebuild_gangs()
        # A changed data-parallel group restarts as a gang, with a fresh rendezvous, together
        # with any ranks it gained.
        touched = {e.group for e in (*plan.changed, *plan.added) if e.data_parallel}
        for group in touched & set(self.gangs):
            gang = self.gangs[group]
            gang.rendezvous = new_rendezvous()
            for member in gang.members:
                if member not in added and member.desired is Desired.RUN:
                    member.restart(Reason.RELOAD)
        for handle in added:
            handle.start_supervising()

    def _retire(self, handle: EngineHandle) -> None:
        """Stop a removed replica in the background and drop it once it is down."""
        async def retire() -> None:
            handle.stop()
            await handle.wait_for(_is_down, handle.spec.stop_timeout_s + 10.0)
            await handle.close()
            if self.retiring.get(handle.name) is handle:
                del self.retiring[handle.name]
        self.retiring[handle.name] = handle
        task = asyncio.get_running_loop().create_task(retire(), name=f"retire:{handle.name}")
        self._retire_tasks.add(task)
        task.add_done_callback(self._retire_tasks.discard)

    def kill_all_now(self) -> None:
        for handle in [*self.handles.values(), *self.retiring.values()]:
            handle.kill_now()

    # --- messages ----------------------------------------------------------------------------
    def on_control(self, msg: proto.ControlMessage) -> str | None:
        handle = self.handles.get(msg.engine) or self.retiring.get(msg.engine)
        if handle is None:
            return "unknown_engine"
        return None if handle.on_control(msg) else "stale"

    def pick_engine(self, name: str | None, channels: EngineChannels) -> EngineHandle:
        """A READY replica, the least loaded first, round-robin among equals."""
        candidates = self.resolve(name) if name else list(self.handles.values())
        ready = [h for h in candidates if h.state is EngineState.READY]
        if not ready:
            raise NoEngineReady(f"no READY engine{' in ' + repr(name) if name else ''}")
        self._rr += 1
        ready.sort(key=lambda h: channels.in_flight(h.name))
        least = [h for h in ready if channels.in_flight(h.name) == channels.in_flight(ready[0].name)]
        return least[self._rr % len(least)]

    async def generate(self, channels: EngineChannels, prompt: str, max_tokens: int,
                       engine: str | None, timeout_s: float) -> proto.GenerateResult:
        handle = self.pick_engine(engine, channels)
        if handle.gang is not None:  # its peers must join the lockstep step: wake them now
            for peer in handle.gang.members:
                if peer is not handle and peer.state is EngineState.READY:
                    channels.wake(peer.name, peer.incarnation)
        try:
            result = await channels.generate(handle.name, handle.incarnation, prompt, max_tokens,
                                             timeout_s)
        except RequestTimeout:
            handle.requests["timeout"] += 1
            raise
        except RequestFailed:
            handle.requests["error"] += 1
            raise
        handle.requests["ok"] += 1
        return result

    # --- views -------------------------------------------------------------------------------
    def counts(self) -> tuple[int, int]:
        """(READY engines, engines that should run)."""
        wanted = [h for h in self.handles.values() if h.desired is Desired.RUN]
        return sum(1 for h in wanted if h.state is EngineState.READY), len(wanted)


def _is_down(handle: EngineHandle) -> bool:
    return handle.state in (EngineState.STOPPED, EngineState.FAILED) and (
        handle.child is None or not handle.child.alive)


__all__ = ["Fleet", "UnknownEngine", "NoEngineReady", "RequestFailed", "HandleDeps"]
