"""Rolling restarts: replace a group's replicas a few at a time, so the group keeps serving.

`rollout: {max_unavailable: 1, max_surge: 0}` (Kubernetes' names). For each batch of at most
max_unavailable replicas: take them out of routing (draining), let their in-flight requests
finish (at most stop_timeout), restart them, wait until they are READY again, then the next
batch. With max_surge > 0 (engines without GPUs only) that many extra replicas of the group are
started first and retired at the end, so even a one-replica group never stops serving. A
replica that does not come back (FAILED, or not READY within startup_timeout) stops the rollout:
the replicas not yet replaced keep running as they are.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from engined.supervisor.policy import Reason
from engined.supervisor.replica import Replica
from engined.supervisor.state import EngineState
from engined.supervisor.view import EngineView

if TYPE_CHECKING:
    from engined.supervisor.fleet import Fleet

log = logging.getLogger("engined.rollout")

DRAIN_POLL_S = 0.05
READY_MARGIN_S = 10.0


class RolloutFailed(Exception):
    pass


async def roll(fleet: Fleet, group: str, members: list[Replica], reason: Reason,
               in_flight: Callable[[str], int]) -> None:
    """Restart `members` of `group` under its rollout settings."""
    spec = members[0].spec
    batch_size, surge = spec.rollout.max_unavailable, spec.rollout.max_surge
    log.info("[rollout] %s: restarting %d replica(s), %d at a time%s (reason %s)", group,
             len(members), batch_size, f", {surge} surge replica(s) first" if surge else "",
             reason.value)
    extra = [fleet.add_surge(group, k) for k in range(surge)]
    try:
        for replica in extra:
            await _ready_after(replica, 0, "the surge replica")
        for start in range(0, len(members), batch_size):
            batch = [r for r in members[start:start + batch_size] if r.wanted]
            await asyncio.gather(*(_replace(r, reason, in_flight) for r in batch))
        log.info("[rollout] %s: done", group)
    except RolloutFailed as exc:
        log.error("[rollout] %s: stopped: %s (the replicas not yet replaced keep running)",
                  group, exc)
    finally:
        for replica in members:
            replica.draining = False
        for replica in extra:
            fleet.retire_surge(replica)


async def _replace(replica: Replica, reason: Reason, in_flight: Callable[[str], int]) -> None:
    replica.draining = True  # out of routing: no new requests from now on
    budget = replica.spec.stop_timeout_s
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget
    while in_flight(replica.address[0]) and loop.time() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    if left := in_flight(replica.address[0]):
        log.warning("[rollout] %s: %d request(s) still running after %.0fs (stop_timeout): "
                    "they move when it stops", replica.name, left, budget)
    incarnation = replica.incarnation
    replica.restart(reason)
    await _ready_after(replica, incarnation, replica.name)
    replica.draining = False


async def _ready_after(replica: Replica, incarnation: int, what: str) -> None:
    def settled(v: EngineView) -> bool:
        return v.incarnation > incarnation and v.state in (EngineState.READY,
                                                           EngineState.FAILED)
    timeout_s = replica.spec.startup_timeout_s + READY_MARGIN_S
    if not await replica.wait_for(settled, timeout_s) or not replica.view().is_ready:
        raise RolloutFailed(f"{what} is {replica.view().state.value}, not READY")
