"""Gang restart for data-parallel groups.

The ranks of a DP group block in each other's collectives: restarting only a dead rank leaves the
survivors wedged. When any rank exits unexpectedly (crash, signal, hang, stall, startup timeout)
the gang stops every other rank (SIGTERM, stop_timeout, SIGKILL), and once all are down it takes
ONE policy decision for the group: backoff and the start limit apply to the group as a unit. The
rank that failed first keeps its own reason; its peers restart with reason `group`. Every gang
(re)start gets a fresh rendezvous address, so no rank can join a stale group.
"""

from __future__ import annotations

import logging
import random
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from supervisor.policy import Action, Decision, ExitStatus, FailureHistory, Reason, decide

if TYPE_CHECKING:
    from supervisor.handle import EngineHandle

log = logging.getLogger("engined.gang")


def new_rendezvous(host: str = "127.0.0.1") -> str:
    """A free TCP port for the group's store (rank 0 listens on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return f"{host}:{sock.getsockname()[1]}"


@dataclass(frozen=True)
class _Failure:
    reason: Reason
    status: ExitStatus
    at: float
    ready_since: float | None  # when the whole group was last READY, for reset_after


class GangGroup:
    def __init__(self, name: str, rng: random.Random | None = None) -> None:
        self.name = name
        self.members: list[EngineHandle] = []
        self.history = FailureHistory()
        self.rendezvous = new_rendezvous()
        self.failure: _Failure | None = None
        self.rng = rng or random.Random()

    def add(self, handle: EngineHandle) -> None:
        self.members.append(handle)
        handle.gang = self

    # --- operator actions: the whole gang, with a fresh rendezvous ---------------------------
    def restart(self, reason: Reason = Reason.MANUAL) -> None:
        self.history, self.failure = FailureHistory(), None
        self.rendezvous = new_rendezvous()
        for member in self.members:
            member.restart(reason)

    def start(self) -> None:
        if not any(m.pid for m in self.members):
            self.history, self.failure = FailureHistory(), None
            self.rendezvous = new_rendezvous()
        for member in self.members:
            member.start()

    # --- failures ----------------------------------------------------------------------------
    def member_down(self, handle: EngineHandle, reason: Reason,
                    status: ExitStatus | None, at: float) -> Reason:
        """A member exited unexpectedly, or after a gang stop; returns the reason it records."""
        if self.failure is None and status is not None:
            self.failure = _Failure(reason, status, at, self._group_ready_since())
            log.warning("[group] %s: %s failed (%s): stopping the other ranks", self.name,
                        handle.name, reason.value)
            for peer in self.members:
                if peer is not handle:
                    peer.gang_stop()
            own = reason
        else:
            own = Reason.GROUP
        handle.await_gang(own)
        self._maybe_respawn()
        return own

    def _group_ready_since(self) -> float | None:
        stamps = [m.ready_since for m in self.members]
        return None if any(s is None for s in stamps) else max(stamps)  # type: ignore[type-var]

    def _maybe_respawn(self) -> None:
        if self.failure is None or any(m.pid is not None for m in self.members):
            return  # some rank is still stopping
        failure, self.failure = self.failure, None
        spec = self.members[0].spec
        decision, self.history = decide(
            time.monotonic(), spec.restart, failure.status, failure.reason, self.history,
            failure.ready_since, spec.backoff, spec.start_limit, self.rng.uniform(-1.0, 1.0))
        if decision.action is Action.RESTART:
            self.rendezvous = new_rendezvous()
        log.warning("[group] %s: all %d ranks down: %s", self.name, len(self.members),
                    _describe(decision))
        for member in self.members:
            member.gang_apply(decision)


def _describe(decision: Decision) -> str:
    if decision.action is Action.RESTART:
        return f"restarting the group in {decision.delay_s:.2f}s ({decision.why})"
    return f"{decision.action.value}: {decision.why}"
