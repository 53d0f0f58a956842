"""What the gateway routes through, whatever stands behind it: the `Routes` protocol, which the
engine router (routing.replicas: the fleet's replicas) and the node router (cluster.router: a
cluster gateway's node gateways) both implement, and `BaseRouter`, what they share: the queue
per group, the load per leased life, the choice among equals and the one pick-and-wait loop.

The gateway sees a model's group, its `Route` (limits, and how its servers are spoken to) and
leases. A lease is one request's claim on one life of a server (a replica's incarnation; a
node's life, from the probe that found it up to the one that found it down), counted as its
load until released. A request lost on a life is not sent back to it while the server may be
dead (LostOn).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
import contextvars
import itertools
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

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
    """No routable server (now, or before the request's deadline)."""


@dataclass
class Waking:
    """A request's wait for its model to wake (routing.ondemand): until `deadline`, then
    NoReplica with `why()`."""

    deadline: float  # monotonic
    why: Callable[[], str]
    hopeless: str | None = None  # it can never wake (the budget): said at once
    retry: Callable[[], None] = lambda: None  # try the wake again (memory may have come free)


class Target(Protocol):
    """One life of a server, which a lease is on."""

    @property
    def address(self) -> tuple[str, int]:
        """(name, life number): what the gateway's calls and the Lost notices name it by."""

    @property
    def avoid_after_loss_s(self) -> float:
        """A request lost on it is not sent back for this long (it may be dead)."""


@dataclass(frozen=True, eq=False)
class Lease:
    """One request's claim on one life of a server, counted as its load until released."""

    name: str  # the replica's or the node's, for log lines and errors
    target: Target  # the life it is on
    endpoint: tuple[str, int]  # where its HTTP server listens (a command engine's, a node's)
    served_as: str | None  # the model's name on that server, when the router knows it

    @property
    def address(self) -> tuple[str, int]:
        return self.target.address


@dataclass(frozen=True)
class Route:
    """What the gateway needs to know of a group it serves."""

    queue_limit: int  # requests admitted, in flight or waiting
    request_timeout_s: float  # a request's whole life in the gateway
    migration_limit: int  # times a request may move to another server
    proxied: bool  # its servers speak HTTP (a command engine's, a node gateway): bodies go as sent
    vllm: bool  # they are vLLM's OpenAI servers: token ids come back, a stream can move mid-way
    backend: str = ""  # engined's own engines: which backend reads the request
    config: str = ""  # the model and backend configuration (system_fingerprint)


@dataclass(frozen=True)
class GroupLoad:
    """What the model server protocol says of one group (gateway.serverstats)."""

    running: int
    waiting: int  # in the servers, plus what the gateway admitted and has not placed
    kv_usage: float  # 0..1
    cache: dict[str, float] = field(default_factory=dict)  # the KV cache's configuration


class Routes(Protocol):
    """What the gateway routes through."""

    closing: bool  # shutdown: nothing new is admitted

    def models(self) -> dict[str, str]:
        """model name -> group, for every group served."""

    def group_of(self, model: str) -> str:
        """The model's group; UnknownModel when none serves it."""

    def route_of(self, group: str) -> Route: ...

    def admit(self, group: str) -> None:
        """Count a request in the group's queue; QueueFull or Closing when it cannot be."""

    def leave(self, group: str) -> None: ...

    async def acquire(self, group: str, deadline: float,
                      avoid: Container[object] = ()) -> Lease:
        """A lease on a server of `group`, not on a life of `avoid`, waiting for one if need
        be; NoReplica past the deadline."""

    def release(self, lease: Lease) -> None: ...

    def peers(self, lease: Lease) -> list[tuple[str, int]]:
        """The addresses of the lease's data-parallel peers (they join its lockstep step)."""

    def load_of(self, group: str) -> GroupLoad: ...


class LostOn:
    """The lives one request was lost on, and when. The request is not sent back to one while
    its server may be dead (its `avoid_after_loss_s` after the loss: an engine that cannot be
    reached stays READY until its exit is handled or it is declared hung, and would be the least
    loaded). One still routable after that was judged alive (the loss was its connection's: a
    connect timeout on a loaded host, say): the request may go back to it, within its
    migration_limit, rather than wait for another until its request_timeout."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._at: dict[object, tuple[float, float]] = {}  # life -> (lost at, stays away for)
        self.last = ""  # how the last attempt was lost, for the client's error

    def add(self, target: Target, how: str = "") -> None:
        self._at[target] = (self.clock(), target.avoid_after_loss_s)
        self.last = f"{target.address[0]}: {how}" if how else self.last

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, target: object) -> bool:
        at, avoid_s = self._at.get(target, (None, 0.0))
        return at is not None and self.clock() - at < avoid_s


L = TypeVar("L", bound=Lease)
C = TypeVar("C")


class BaseRouter(abc.ABC):
    """What both routers share: admission (a queue per group, closed at shutdown), the load per
    leased life, the choice among equals and the wait for a server."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.closing = False  # shutdown: the gateway accepts nothing new
        self.queued: collections.Counter[str] = collections.Counter()  # group -> admitted
        self._load: collections.Counter[object] = collections.Counter()  # life -> leases
        self._changed = asyncio.Event()  # what a waiting request waits for may have happened
        self._turn = itertools.count()

    @abc.abstractmethod
    def models(self) -> dict[str, str]:
        """model name -> group, for every group served."""

    @abc.abstractmethod
    def route_of(self, group: str) -> Route: ...

    def group_of(self, model: str) -> str:
        models = self.models()
        if model not in models:
            raise UnknownModel(model, sorted(models))
        return models[model]

    # --- admission (the gateway's queue per group) ---------------------------------------------
    def admit(self, group: str) -> None:
        if self.closing:
            raise Closing()
        limit = self.route_of(group).queue_limit
        if self.queued[group] >= limit:
            raise QueueFull(limit)
        self.queued[group] += 1

    def leave(self, group: str) -> None:
        self.queued[group] -= 1

    # --- load ----------------------------------------------------------------------------------
    def in_flight(self, target: object) -> int:
        return self._load[target]

    def release(self, lease: Lease) -> None:
        target = lease.target
        self._load[target] -= 1
        if self._load[target] <= 0:
            del self._load[target]

    def changed(self) -> None:
        """A server came, went or changed: waiting requests look again."""
        self._changed.set()

    # --- picking -------------------------------------------------------------------------------
    def least(self, candidates: Sequence[C], key: Callable[[C], Any]) -> C:
        """The least of `candidates` by `key`, round-robin among equals."""
        least = min(key(c) for c in candidates)
        ties = [c for c in candidates if key(c) == least]
        return ties[next(self._turn) % len(ties)]

    async def wait_for(self, pick: Callable[[], L | None], deadline: float, too_late: str,
                       recheck_s: float = RECHECK_S,
                       hopeless: Callable[[], str | None] = lambda: None) -> L:
        """What `pick()` leases, looking again at every change (and every `recheck_s`) until
        `deadline`; NoReplica then with `too_late`, or at once with what `hopeless()` says
        when it says something (after a pick found nothing)."""
        while True:
            lease = pick()
            if lease is not None:
                return lease
            if (why := hopeless()) is not None:
                raise NoReplica(why)
            left = deadline - self.clock()
            if left <= 0:
                raise NoReplica(too_late)
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, recheck_s))


__all__ = ["BaseRouter", "Closing", "GroupLoad", "Lease", "LostOn", "NoReplica", "NoRoute",
           "PINNED", "QueueFull", "Route", "Routes", "Target", "UnknownModel", "Waking"]
