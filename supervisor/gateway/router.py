"""Which replica serves a request: the least-loaded READY replica of the model's group.

A replica leaves routing once its heartbeat is older than two heartbeat intervals (a frozen
engine stops getting requests at once, long before it is declared hung), or while it is stopping
or draining (a rolling restart, a shutdown). Requests already on it stay until it is declared
hung or stalled, or exits: the relay then moves them. A request that finds no routable replica
waits for one (until its request_timeout), and a group holds at most queue_limit requests.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
from collections.abc import Callable

from engined.supervisor.fleet import Fleet
from engined.supervisor.gateway.openai import ApiError
from engined.supervisor.replica import Replica
from engined.supervisor.spec import EngineSpec

RECHECK_S = 0.1  # a waiting request looks again this often (heartbeats refresh without events)


class Router:
    def __init__(self, fleet: Fleet, heartbeat_interval_s: float,
                 clock: Callable[[], float]) -> None:
        self.fleet = fleet
        self.stale_after_s = 2.0 * heartbeat_interval_s
        self.clock = clock
        self.load: collections.Counter[str] = collections.Counter()  # replica -> requests on it
        self.queued: collections.Counter[str] = collections.Counter()  # group -> admitted
        self.closing = False  # shutdown: nothing new is accepted
        self._changed = asyncio.Event()
        self._turn = itertools.count()

    # --- names -------------------------------------------------------------------------------
    def models(self) -> dict[str, str]:
        """model name -> group, for every group that should serve."""
        out: dict[str, str] = {}
        for replica in self.fleet.replicas.values():
            spec = replica.spec
            if spec.is_command and not spec.openai:
                continue  # a server whose API the gateway does not speak
            if spec.served_model_name not in out and not replica.standby:
                out[spec.served_model_name or spec.group] = spec.group
        return out

    def group_of(self, model: str) -> str:
        group = self.models().get(model)
        if group is None:
            known = ", ".join(sorted(self.models())) or "none"
            raise ApiError(404, f"The model '{model}' does not exist (served here: {known})",
                           param="model", code="model_not_found")
        return group

    # --- admission ---------------------------------------------------------------------------
    def admit(self, group: str) -> None:
        if self.closing:
            raise ApiError(503, "engined is shutting down", kind="server_error",
                           headers={"Retry-After": "5"})
        limit = self.spec_of(group).queue_limit
        if self.queued[group] >= limit:
            raise ApiError(429, f"too many requests for this model ({limit} in flight or "
                                f"waiting): retry later", kind="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"})
        self.queued[group] += 1

    def leave(self, group: str) -> None:
        self.queued[group] -= 1

    def spec_of(self, group: str) -> EngineSpec:
        return next(r.spec for r in self.fleet.replicas.values() if r.spec.group == group)

    # --- picking -----------------------------------------------------------------------------
    def routable(self, replica: Replica) -> bool:
        """READY, alive, serving (not in its cleanup), not draining, heard from lately."""
        if replica.draining or replica.standby:
            return False
        age = replica.serving_heartbeat_age()
        return age is not None and age <= self.stale_after(replica.spec)

    def stale_after(self, spec: EngineSpec) -> float:
        """A heartbeat older than this takes a replica out of routing. A command engine's
        heartbeats are its passing probes; one without probes is never stale."""
        if not spec.is_command:
            return self.stale_after_s
        probe = spec.probe
        return math.inf if probe is None else 2.0 * probe.interval_s + probe.timeout_s

    def pick(self, group: str) -> Replica | None:
        candidates = [r for r in self.fleet.replicas.values()
                      if r.spec.group == group and self.routable(r)]
        if not candidates:
            return None
        least = min(self.load[r.name] for r in candidates)
        ties = [r for r in candidates if self.load[r.name] == least]
        return ties[next(self._turn) % len(ties)]

    async def acquire(self, group: str, deadline: float) -> Replica:
        """A routable replica (counted as loaded until `release`), waiting for one if need be;
        ApiError 503 at the deadline."""
        while True:
            replica = self.pick(group)
            if replica is not None:
                self.load[replica.name] += 1
                return replica
            left = deadline - self.clock()
            if left <= 0:
                raise ApiError(503, f"no replica of '{group}' could serve the request in time",
                               kind="server_error", code="no_replica",
                               headers={"Retry-After": "5"})
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, RECHECK_S))
            except asyncio.TimeoutError:
                pass

    def release(self, replica: Replica) -> None:
        self.load[replica.name] -= 1
        if self.load[replica.name] <= 0:
            del self.load[replica.name]

    def changed(self) -> None:
        """Something an acquire may be waiting for happened (a replica's state changed)."""
        self._changed.set()

    def in_flight(self, name: str) -> int:
        return self.load[name]
