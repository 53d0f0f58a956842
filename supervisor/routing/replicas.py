"""The engine router: which of the fleet's replicas serves a request, and how many requests each
incarnation has: one authority for the gateway (as its Routes, routing.routes), the control
socket's `POST /v1/generate`, rolling restarts and command engines' progress checks, whether or
not the gateway is on.

A replica is routable while it serves: READY, wanted, alive, not in its cleanup, heard from
lately (its liveness strategy says how lately: a frozen engine stops getting requests at once,
long before it is declared hung), and neither a standby nor draining (a rolling restart takes
it out of routing while its requests finish). Among the routable, the least loaded wins,
round-robin among equals. Load is counted per incarnation from the moment a request is leased
until it is released, so a promoted standby brings its own count, and the next standby starts at
zero. A gateway request that finds no routable replica waits for one (until its deadline), and a
group holds at most queue_limit gateway requests (admitted, in flight or waiting).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass

from engined.engine import protocol as proto
from engined.supervisor.lifecycle.incarnation import Incarnation
from engined.supervisor.lifecycle.notices import StateChange
from engined.supervisor.lifecycle.replica import Replica
from engined.supervisor.routing.adapters import ADAPTER, AdapterBook
from engined.supervisor.routing.routes import (
    PINNED,
    BaseRouter,
    GroupLoad,
    Lease,
    NoReplica,
    Route,
    Waking,
)
from engined.supervisor.spec.model import EngineSpec


@dataclass(frozen=True, eq=False)
class ReplicaLease(Lease):
    """A lease on a replica's incarnation (the control socket and rollouts see the replica)."""

    replica: Replica
    incarnation: Incarnation


class Router(BaseRouter):
    """The fleet's replicas: a group is an engine group, a lease is on an incarnation."""

    def __init__(self, replicas: Callable[[], Iterable[Replica]],
                 clock: Callable[[], float]) -> None:
        super().__init__(clock)
        self._replicas = replicas  # the fleet's, in spec order
        self._draining: set[Replica] = set()
        self._released = asyncio.Event()  # a lease ended: a drain looks again
        self._routes: dict[str, tuple[EngineSpec, Route]] = {}  # group -> (its spec, its route)
        self.used: dict[str, float] = {}  # group -> when a request last came or ended (clock)
        # on-demand engines (routing.ondemand): wakes a group a request found nothing of
        self.waker: Callable[[str], Waking | None] | None = None
        self.adapters: AdapterBook | None = None  # LoRA adapters (routing.adapters)

    def replicas(self) -> Iterable[Replica]:
        """The fleet's, in spec order."""
        return self._replicas()

    # --- names and routes (the gateway's models) -----------------------------------------------
    def models(self) -> dict[str, str]:
        """model name -> group, for every group the gateway serves."""
        out: dict[str, str] = {}
        pinned = PINNED.get()
        for replica in self._replicas():
            spec = replica.spec
            if pinned is not None and spec.name != pinned:
                continue  # a replica's own port serves its model alone
            if spec.is_command and not spec.openai:
                continue  # a server whose API the gateway does not speak
            if not replica.standby:
                out.setdefault(spec.served_model_name or spec.group, spec.group)
        if self.adapters is not None:
            groups = set(out.values())
            for name, group in self.adapters.models().items():
                if group in groups:
                    out.setdefault(name, group)
        return out

    def lives(self, group: str) -> list[tuple[tuple[str, int], tuple[str, int], bool]]:
        """The group's serving incarnations: (address, HTTP endpoint, a command engine)."""
        return [(inc.address, ("127.0.0.1", inc.port or 0), r.spec.is_command)
                for r in self._replicas()
                if r.spec.group == group and (inc := r.serving()) is not None]

    def route_of(self, group: str) -> Route:
        """From the spec of the group's first replica (made again when a reload changed it)."""
        spec = next(r.spec for r in self._replicas() if r.spec.group == group)
        known = self._routes.get(group)
        if known is None or known[0] is not spec:
            known = self._routes[group] = (spec, route(spec))
        return known[1]

    # --- picking -------------------------------------------------------------------------------
    def routable(self, replica: Replica, named: bool = False) -> Incarnation | None:
        """Its serving incarnation, if requests may go to it now. `named`: the client asked
        for this replica by name (a standby, or one draining, serves it then)."""
        if not named and (replica.standby or replica in self._draining):
            return None
        inc = replica.serving()
        return inc if inc is not None and inc.fresh(self.clock()) else None

    def pick(self, replicas: Iterable[Replica], named: bool = False,
             avoid: Container[object] = ()) -> ReplicaLease | None:
        """The least loaded routable replica of `replicas` (round-robin among equals), leased;
        one with memory to spare before one without (`memory_pressed`).
        `avoid`: incarnations this request was lost on, while liveness may still be deciding
        about them (routes.LostOn)."""
        adapter, book = ADAPTER.get(), self.adapters
        candidates = [(r, inc) for r in replicas
                      if (inc := self.routable(r, named)) is not None and inc not in avoid
                      and (adapter is None or book is None or book.holds(inc.address, adapter))]
        if not candidates:
            return None
        replica, inc = self.least(candidates, lambda pair: (
            memory_pressed(pair[1], pair[0].spec.max_batch_size), self._load[pair[1]]))
        return self._lease(replica, inc)

    def _lease(self, replica: Replica, inc: Incarnation) -> ReplicaLease:
        self._load[inc] += 1
        return ReplicaLease(replica.name, inc, ("127.0.0.1", inc.port or 0), None, replica, inc)

    async def lease_for(self, replicas: list[Replica], name: str | None, explicit: bool,
                        deadline: float) -> ReplicaLease:
        """A replica for the control socket's `POST /v1/generate`, which speaks the engine
        protocol: one of `replicas` (what `name` names, or every replica); `explicit`: `name`
        is one replica's (it may be a standby, or draining). A READY replica that is not
        routable this instant (not heard from lately: a frozen engine, or a daemon too busy to
        read its heartbeats yet) is waited for until `deadline`, as a gateway request would;
        with none READY, NoReplica at once."""
        serving = [r for r in replicas if not r.standby]
        pool = [r for r in serving or replicas if not r.spec.is_command]
        if replicas and not pool:
            raise NoReplica(f"{name!r} is a command engine (a server of its own): send its "
                            f"requests to its port, or through the gateway (openai: true)")
        where = f" in {name!r}" if name else ""
        named = explicit or not serving
        return await self.wait_for(
            lambda: self.pick(pool, named), deadline,
            f"no engine{where} could take the request in time",
            hopeless=lambda: None if any(r.serving() for r in pool)
            else f"no READY engine{where}")

    def peers(self, lease: Lease) -> list[tuple[str, int]]:
        """The serving peers of a data-parallel rank (they must join its lockstep step: the
        engine channels wake them), by address. `lease`: one of this router's."""
        assert isinstance(lease, ReplicaLease), lease
        spec = lease.replica.spec
        if not spec.data_parallel:
            return []
        return [inc.address for r in self._replicas()
                if r.spec.group == spec.group and r is not lease.replica
                and (inc := r.serving()) is not None]

    async def acquire(self, group: str, deadline: float,
                      avoid: Container[object] = ()) -> ReplicaLease:
        """A routable replica of `group`, not on an incarnation of `avoid`, waiting for one if
        need be (its replacement, when every replica is down); NoReplica past the deadline.
        On a replica's own port (PINNED) that replica, or NoReplica at once when it cannot
        serve (the endpoint picker asks another); a request it lost goes on on its siblings."""
        pinned = PINNED.get()
        if pinned is not None and not avoid:
            for replica in self._replicas():
                if replica.spec.name == pinned and (inc := self.routable(replica)) is not None:
                    return self._lease(replica, inc)
            raise NoReplica(f"replica {pinned} is not serving now (draining, restarting or "
                            f"stopped): send the request to another endpoint")
        def pick() -> ReplicaLease | None:
            return self.pick([r for r in self._replicas() if r.spec.group == group], False, avoid)

        too_late = f"no replica of '{group}' could serve the request in time"
        lease = pick()
        waking = self.waker(group) if lease is None and self.waker is not None else None
        if lease is not None or waking is None:
            return lease or await self.wait_for(pick, deadline, too_late)

        def pick_or_wake() -> ReplicaLease | None:
            got = pick()
            if got is None:
                waking.retry()
            return got
        try:
            return await self.wait_for(pick_or_wake, min(deadline, waking.deadline), too_late,
                                       hopeless=lambda: waking.hopeless)
        except NoReplica as exc:
            if waking.hopeless or self.clock() < waking.deadline:
                raise
            raise NoReplica(waking.why()) from exc

    def admit(self, group: str) -> None:
        super().admit(group)
        self.used[group] = self.clock()

    def release(self, lease: Lease) -> None:
        super().release(lease)
        if isinstance(lease, ReplicaLease):
            self.used[lease.replica.spec.group] = self.clock()
        self._released.set()

    def load(self, replica: Replica) -> int:
        """Requests on the replica's live incarnation."""
        inc = replica.current
        return self._load[inc] if inc is not None else 0

    def load_of(self, group: str) -> GroupLoad:
        return group_load(self, group)

    def on_state(self, change: StateChange) -> None:
        """A replica changed state: what a waiting request waits for may have happened."""
        self._changed.set()

    # --- draining (rolling restarts) -----------------------------------------------------------
    def drain(self, replica: Replica) -> None:
        """Out of routing from now on; requests already on it stay."""
        self._draining.add(replica)

    def undrain(self, replica: Replica) -> None:
        self._draining.discard(replica)

    async def drained(self, replica: Replica, timeout_s: float) -> int:
        """Until the replica's live incarnation has no request left, at most `timeout_s`;
        returns how many are left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.load(replica) and (wait := deadline - loop.time()) > 0:
            self._released.clear()
            try:
                await asyncio.wait_for(self._released.wait(), wait)
            except asyncio.TimeoutError:
                pass
        return self.load(replica)


def route(spec: EngineSpec) -> Route:
    """What the gateway needs of an engine group, from one of its replicas' spec."""
    return Route(
        queue_limit=spec.queue_limit, request_timeout_s=spec.request_timeout_s,
        migration_limit=spec.migration_limit, proxied=spec.is_command,
        vllm=spec.openai == "vllm",
        backend="builtin:echo" if spec.model.source == "builtin:echo" else spec.backend,
        config=repr((spec.model.source, spec.model.dtype, spec.backend, spec.engine_args,
                     spec.python)))


def memory_pressed(inc: Incarnation, max_batch_size: int) -> bool:
    """Its last heartbeat says it is short of memory (engine.memory): an out-of-memory step
    lowered its batch limit, or it holds all its memory_limit. Its siblings go first."""
    hb = inc.vitals.heartbeat if inc.vitals is not None else None
    if hb is None:
        return False
    lowered = hb.batch_limit is not None and hb.batch_limit < max_batch_size
    return lowered or (hb.memory_headroom is not None and hb.memory_headroom <= 0)


# --- the model server protocol's figures (gateway.serverstats) ---------------------------------
def _beat(inc: Incarnation) -> proto.Heartbeat | None:
    return inc.vitals.heartbeat if inc.vitals is not None else None


def _fill(replica: Replica, inc: Incarnation) -> float:
    hb = _beat(inc)
    if hb is None:
        return 0.0
    if hb.kv_cache_usage is not None:
        return min(1.0, max(0.0, hb.kv_cache_usage))
    limit = hb.batch_limit or replica.spec.max_batch_size
    return min(1.0, hb.running / limit) if limit > 0 else 0.0


def group_load(router: Router, group: str) -> GroupLoad:
    """running, waiting, KV usage (0..1) and KV cache info of one group's serving replicas,
    from their heartbeats (on a replica's own port, PINNED: that replica's alone)."""
    pinned = PINNED.get()
    members = [r for r in router.replicas()
               if r.spec.group == group and pinned in (None, r.spec.name)]
    serving = [(r, inc) for r in members if not r.standby and (inc := r.serving()) is not None]
    beats = [hb for _, inc in serving if (hb := _beat(inc)) is not None]
    running = sum(hb.running for hb in beats)
    leased = sum(router.load(r) for r in members)
    waiting = sum(hb.waiting for hb in beats)
    if pinned is None:  # what the gateway admitted and has not placed yet
        waiting += max(0, router.queued[group] - leased)
    usage = sum(_fill(r, inc) for r, inc in serving) / len(serving) if serving else 0.0
    info: dict[str, float] = {}
    for _, inc in serving:
        ready = inc.vitals.ready if inc.vitals is not None else None
        if ready is not None and ready.cache:
            info = dict(ready.cache)
            break
    return GroupLoad(running, waiting, usage, info)


__all__ = ["ReplicaLease", "Router", "group_load", "memory_pressed", "route"]
