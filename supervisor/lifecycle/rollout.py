"""Rolling restarts: replace a group's replicas a few at a time, so the group keeps serving.

`rollout: {max_unavailable: 1, max_surge: 0}` (Kubernetes' names). For each batch of at most
max_unavailable replicas: take them out of routing (draining), let their in-flight requests
finish (at most stop_timeout; the router counts every request on them: the gateway's, to
engines and command engines alike, and the control socket's), restart them, wait until they are
READY again, then the next batch. With max_surge > 0 (engines without GPUs only) that many extra
replicas of the group are started first and retired at the end, so even a one-replica group never
stops serving. A replica that does not come back (FAILED, or not READY within startup_timeout)
stops the rollout: the replicas not yet replaced keep running as they are.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from engined.supervisor.lifecycle.replica import Replica
from engined.supervisor.lifecycle.state import EngineState, Reason
from engined.supervisor.lifecycle.view import EngineView

log = logging.getLogger("engined.rollout")

READY_MARGIN_S = 10.0


class RolloutFailed(Exception):
    pass


class Drains(Protocol):
    """Takes a replica out of routing and says when its requests are done (supervisor.routing's
    Router: the lifecycle sits below routing and knows it only by this)."""

    def drain(self, replica: Replica) -> None: ...

    def undrain(self, replica: Replica) -> None: ...

    async def drained(self, replica: Replica, timeout_s: float) -> int: ...


class Rollout:
    """One rolling restart of `members` of `group`. `add_surge(k)` starts the k-th extra replica
    of the group; `retire(replica)` stops and removes it."""

    def __init__(self, router: Drains, group: str, members: list[Replica], reason: Reason,
                 add_surge: Callable[[int], Replica],
                 retire: Callable[[Replica], None]) -> None:
        self.router, self.group, self.members, self.reason = router, group, members, reason
        self.add_surge, self.retire = add_surge, retire

    async def run(self) -> None:
        spec = self.members[0].spec
        batch_size, surge = spec.rollout.max_unavailable, spec.rollout.max_surge
        log.info("[rollout] %s: restarting %d replica(s), %d at a time%s (reason %s)",
                 self.group, len(self.members), batch_size,
                 f", {surge} surge replica(s) first" if surge else "", self.reason.value)
        extra = [self.add_surge(k) for k in range(surge)]
        try:
            for replica in extra:
                await _ready_after(replica, 0, "the surge replica")
            for start in range(0, len(self.members), batch_size):
                batch = [r for r in self.members[start:start + batch_size] if r.wanted]
                await asyncio.gather(*(self._replace(r) for r in batch))
            log.info("[rollout] %s: done", self.group)
        except RolloutFailed as exc:
            log.error("[rollout] %s: stopped: %s (the replicas not yet replaced keep running)",
                      self.group, exc)
        finally:
            for replica in self.members:
                self.router.undrain(replica)
            for replica in extra:
                self.retire(replica)

    async def _replace(self, replica: Replica) -> None:
        self.router.drain(replica)  # out of routing: no new requests from now on
        budget = replica.spec.stop_timeout_s
        if left := await self.router.drained(replica, budget):
            log.warning("[rollout] %s: %d request(s) still running after %.0fs (stop_timeout): "
                        "they move when it stops", replica.name, left, budget)
        incarnation = replica.incarnation
        replica.restart(self.reason)
        await _ready_after(replica, incarnation, replica.name)
        self.router.undrain(replica)


async def _ready_after(replica: Replica, incarnation: int, what: str) -> None:
    def settled(v: EngineView) -> bool:
        return v.incarnation > incarnation and v.state in (EngineState.READY,
                                                           EngineState.FAILED)
    timeout_s = replica.spec.startup_timeout_s + READY_MARGIN_S
    if not await replica.wait_for(settled, timeout_s) or not replica.view().is_ready:
        raise RolloutFailed(f"{what} is {replica.view().state.value}, not READY")
