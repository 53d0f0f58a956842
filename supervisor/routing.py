"""Which replica serves a request, and how many requests each incarnation has: one authority for
the gateway, the control socket's `POST /v1/generate`, rolling restarts and command engines'
progress checks, whether or not the gateway is on.

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
import collections
import contextvars
import itertools
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass

from engined.supervisor.lifecycle.incarnation import Incarnation
from engined.supervisor.lifecycle.notices import StateChange
from engined.supervisor.lifecycle.replica import Replica
from engined.supervisor.spec.model import EngineSpec

RECHECK_S = 0.1  # a waiting request looks again this often (heartbeats refresh without events)
# supervisor.replica_ports: the replica a request came in for (its own port), while it is handled
PINNED: contextvars.ContextVar[str | None] = contextvars.ContextVar("pinned", default=None)


class NoRoute(Exception):
    """Nothing can take the request: why, in words for the client."""


class UnknownModel(NoRoute):
    def __init__(self, model: str, known: list[str]) -> None:
        super().__init__(f"The model '{model}' does not exist (served here: "
                         f"{', '.join(known) or 'none'})")


class QueueFull(NoRoute):
    def __init__(self, limit: int) -> None:
        super().__init__(f"too many requests for this model ({limit} in flight or waiting): "
                         f"retry later")


class Closing(NoRoute):
    def __init__(self) -> None:
        super().__init__("engined is shutting down")


class NoReplica(NoRoute):
    """No routable replica (now, or before the request's deadline)."""


@dataclass(frozen=True, eq=False)
class Lease:
    """One request's claim on one incarnation, counted as its load until released."""

    replica: Replica
    incarnation: Incarnation


class LostOn:
    """The incarnations one request was lost on, and when. The request is not sent back to one
    while liveness may still be deciding about it (its heartbeat_timeout after the loss: an
    engine that cannot be reached stays READY until its exit is handled or it is declared hung,
    and would be the least loaded). One still routable after that was judged alive (the loss was
    its connection's: a connect timeout on a loaded host, say): the request may go back to it,
    within its migration_limit, rather than wait for another until its request_timeout."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._at: dict[object, float] = {}
        self.last = ""  # how the last attempt was lost, for the client's error

    def add(self, incarnation: Incarnation, how: str = "") -> None:
        self._at[incarnation] = self.clock()
        self.last = f"{incarnation.address[0]}: {how}" if how else self.last

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, incarnation: object) -> bool:
        at = self._at.get(incarnation)
        if at is None:
            return False
        avoid_s = getattr(incarnation, "avoid_after_loss_s", 0.0)
        return self.clock() - at < avoid_s


class Router:
    def __init__(self, replicas: Callable[[], Iterable[Replica]],
                 clock: Callable[[], float]) -> None:
        self._replicas = replicas  # the fleet's, in spec order
        self.clock = clock
        self.closing = False  # shutdown: the gateway accepts nothing new
        self.queued: collections.Counter[str] = collections.Counter()  # group -> admitted
        self._load: collections.Counter[object] = collections.Counter()  # incarnation -> leases
        self._draining: set[Replica] = set()
        self._changed = asyncio.Event()  # a state change: a waiting request looks again
        self._released = asyncio.Event()  # a lease ended: a drain looks again
        self._turn = itertools.count()

    def replicas(self) -> Iterable[Replica]:
        """The fleet's, in spec order."""
        return self._replicas()

    # --- names (the gateway's models) ----------------------------------------------------------
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
        return out

    def group_of(self, model: str) -> str:
        models = self.models()
        if model not in models:
            raise UnknownModel(model, sorted(models))
        return models[model]

    def spec_of(self, group: str) -> EngineSpec:
        return next(r.spec for r in self._replicas() if r.spec.group == group)

    # --- admission (the gateway's queue per group) ---------------------------------------------
    def admit(self, group: str) -> None:
        if self.closing:
            raise Closing()
        limit = self.spec_of(group).queue_limit
        if self.queued[group] >= limit:
            raise QueueFull(limit)
        self.queued[group] += 1

    def leave(self, group: str) -> None:
        self.queued[group] -= 1

    # --- picking -------------------------------------------------------------------------------
    def routable(self, replica: Replica, named: bool = False) -> Incarnation | None:
        """Its serving incarnation, if requests may go to it now. `named`: the client asked
        for this replica by name (a standby, or one draining, serves it then)."""
        if not named and (replica.standby or replica in self._draining):
            return None
        inc = replica.serving()
        return inc if inc is not None and inc.fresh(self.clock()) else None

    def pick(self, replicas: Iterable[Replica], named: bool = False,
             avoid: Container[Incarnation] = ()) -> Lease | None:
        """The least loaded routable replica of `replicas` (round-robin among equals), leased;
        one with memory to spare before one without (`memory_pressed`).
        `avoid`: incarnations this request was lost on, while liveness may still be deciding
        about them (LostOn)."""
        candidates = [(r, inc) for r in replicas
                      if (inc := self.routable(r, named)) is not None and inc not in avoid]
        if not candidates:
            return None

        def key(pair: tuple[Replica, Incarnation]) -> tuple[bool, int]:
            return memory_pressed(pair[1], pair[0].spec.max_batch_size), self._load[pair[1]]
        least = min(key(pair) for pair in candidates)
        ties = [pair for pair in candidates if key(pair) == least]
        replica, inc = ties[next(self._turn) % len(ties)]
        self._load[inc] += 1
        return Lease(replica, inc)

    async def lease_for(self, replicas: list[Replica], name: str | None, explicit: bool,
                        deadline: float) -> Lease:
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
        return await self._wait_for(lambda: pool, deadline, explicit or not serving,
                                    f"no READY engine{where}",
                                    f"no engine{where} could take the request in time")

    def peers(self, lease: Lease) -> list[tuple[str, int]]:
        """The serving peers of a data-parallel rank (they must join its lockstep step: the
        engine channels wake them), by address."""
        spec = lease.replica.spec
        if not spec.data_parallel:
            return []
        return [inc.address for r in self._replicas()
                if r.spec.group == spec.group and r is not lease.replica
                and (inc := r.serving()) is not None]

    async def acquire(self, group: str, deadline: float,
                      avoid: Container[Incarnation] = ()) -> Lease:
        """A routable replica of `group`, not on an incarnation of `avoid`, waiting for one if
        need be (its replacement, when every replica is down); NoReplica past the deadline.
        On a replica's own port (PINNED) that replica, or NoReplica at once when it cannot
        serve (the endpoint picker asks another); a request it lost goes on on its siblings."""
        pinned = PINNED.get()
        if pinned is not None and not avoid:
            for replica in self._replicas():
                if replica.spec.name == pinned and (inc := self.routable(replica)) is not None:
                    self._load[inc] += 1
                    return Lease(replica, inc)
            raise NoReplica(f"replica {pinned} is not serving now (draining, restarting or "
                            f"stopped): send the request to another endpoint")
        return await self._wait_for(
            lambda: [r for r in self._replicas() if r.spec.group == group], deadline, False,
            None, f"no replica of '{group}' could serve the request in time", avoid)

    async def _wait_for(self, pool: Callable[[], list[Replica]], deadline: float, named: bool,
                        none_ready: str | None, too_late: str,
                        avoid: Container[Incarnation] = ()) -> Lease:
        """Lease a routable replica of `pool()`, looking again at every state change (and every
        RECHECK_S: heartbeats refresh without one) until `deadline`. `none_ready`: give up at
        once, with those words, when no replica of the pool is READY at all."""
        while True:
            replicas = pool()
            lease = self.pick(replicas, named, avoid)
            if lease is not None:
                return lease
            if none_ready is not None and not any(r.serving() for r in replicas):
                raise NoReplica(none_ready)
            left = deadline - self.clock()
            if left <= 0:
                raise NoReplica(too_late)
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, RECHECK_S))
            except asyncio.TimeoutError:
                pass

    def address(self, lease: Lease) -> tuple[str, int]:
        """Where the lease's server listens: a command engine's, on loopback."""
        return "127.0.0.1", lease.incarnation.port or 0

    def stats_of(self, group: str) -> tuple[int, int, float] | None:
        """running, waiting and KV usage of the group when the router knows them from its
        upstreams (None: the gateway's own figures, from the replicas' heartbeats)."""
        return None

    def own_name(self, lease: Lease, model: str) -> str | None:
        """The model's name on the lease's server, when the router knows it (None: ask the
        server)."""
        return None

    def release(self, lease: Lease) -> None:
        inc = lease.incarnation
        self._load[inc] -= 1
        if self._load[inc] <= 0:
            del self._load[inc]
        self._released.set()

    def in_flight(self, incarnation: Incarnation) -> int:
        return self._load[incarnation]

    def load(self, replica: Replica) -> int:
        """Requests on the replica's live incarnation."""
        inc = replica.current
        return self._load[inc] if inc is not None else 0

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


def memory_pressed(inc: Incarnation, max_batch_size: int) -> bool:
    """Its last heartbeat says it is short of memory (engine.memory): an out-of-memory step
    lowered its batch limit, or it holds all its memory_limit. Its siblings go first."""
    hb = inc.vitals.heartbeat if inc.vitals is not None else None
    if hb is None:
        return False
    lowered = hb.batch_limit is not None and hb.batch_limit < max_batch_size
    return lowered or (hb.memory_headroom is not None and hb.memory_headroom <= 0)
