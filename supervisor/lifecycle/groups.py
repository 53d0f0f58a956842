"""Who decides after an exit: one owner per engine group, holding the only failure history.

* `ReplicaGroup` (Erlang's one_for_one): each replica fails and restarts on its own, with its own
  backoff and start limit.
* `Gang` (one_for_all), a data-parallel group: the ranks block in each other's collectives, so
  restarting only a dead rank leaves the survivors wedged. When any rank exits unexpectedly
  (crash, signal, hang, stall, startup timeout) the gang stops every other rank (SIGTERM,
  stop_timeout, SIGKILL), and once all are down it takes ONE policy decision for the group:
  backoff and the start limit apply to the group as a unit. The rank that failed first keeps its
  own reason; its peers restart with reason `group`. Every gang (re)start gets a fresh
  rendezvous address, so no rank can join a stale group.

Replicas report exits here (`on_down`); decisions and operator commands flow back down.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import socket
from dataclasses import dataclass

from engined.supervisor.lifecycle.history import Down, SpawnFailure
from engined.supervisor.lifecycle.policy import (
    Action,
    Decision,
    ExitStatus,
    FailureHistory,
    decide,
    decide_spawn_failure,
)
from engined.supervisor.lifecycle.replica import Replica
from engined.supervisor.lifecycle.state import Reason

log = logging.getLogger("engined.group")


def new_rendezvous(host: str = "127.0.0.1") -> str:
    """A free TCP port for a data-parallel group's store (rank 0 listens on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return f"{host}:{sock.getsockname()[1]}"


def describe(decision: Decision) -> str:
    if decision.action is Action.RESTART:
        return ("restarting now" if decision.delay_s == 0
                else f"restarting in {decision.delay_s:.2f}s") + f" ({decision.why})"
    return f"{decision.action.value}: {decision.why}"


class ReplicaGroup:
    """A plain group: one_for_one, a failure history per replica."""

    rendezvous: str | None = None

    def __init__(self, name: str, rng: random.Random) -> None:
        self.name = name
        self.rng = rng
        self.members: list[Replica] = []
        self._history: dict[str, FailureHistory] = {}

    def on_down(self, replica: Replica, down: Down) -> None:
        spec = replica.spec
        history = self._history.get(replica.name, FailureHistory())
        decision, self._history[replica.name] = decide(
            down.at, spec.restart, down.status, down.reason, history, down.ready_since,
            spec.backoff, spec.start_limit, self.rng.uniform(-1.0, 1.0))
        if down.config_error and decision.action is Action.FAIL:
            decision = dataclasses.replace(decision, why=f"exit 78: {down.config_error}")
        spare = self._spare_for(replica) if decision.action is Action.RESTART else None
        log.warning("[exit] %s pid %d %s (reason %s): %s", replica.name, down.pid,
                    down.headline, down.reason.value,
                    f"promoting standby {spare.name}" if spare else describe(decision))
        if spare is not None:
            replica.promote(spare, down.reason)
        else:
            replica.apply(decision, down.reason)

    def _spare_for(self, replica: Replica) -> Replica | None:
        """A READY standby to take over a serving replica that died (restarts as usual when
        none is ready: the standby is still building, in its cleanup, or there is none)."""
        if replica.standby or not replica.wanted:
            return None
        return next((m for m in self.members if m.promotable), None)

    def on_spawn_failed(self, replica: Replica, failure: SpawnFailure) -> None:
        spec = replica.spec
        history = self._history.get(replica.name, FailureHistory())
        decision, self._history[replica.name] = decide_spawn_failure(
            failure.at, failure.errno, failure.description, history, spec.backoff,
            spec.start_limit, self.rng.uniform(-1.0, 1.0))
        log.warning("[spawn_error] %s: %s", replica.name, describe(decision))
        replica.apply(decision, Reason.SPAWN_ERROR)

    # --- operator commands -------------------------------------------------------------------
    def start(self, members: list[Replica]) -> None:
        for replica in members:
            if not replica.active:
                self._history.pop(replica.name, None)  # a fresh start limit
            replica.start()

    def stop(self, members: list[Replica]) -> None:
        for replica in members:
            replica.stop()

    def restart(self, members: list[Replica], reason: Reason = Reason.MANUAL) -> None:
        for replica in members:
            self._history.pop(replica.name, None)
            replica.restart(reason)

    def forget(self, replica: Replica) -> None:
        self._history.pop(replica.name, None)

    def failures(self, replica: Replica) -> FailureHistory:
        """The replica's failure record (backoff streak, start-limit window): an upgrade
        hands it over."""
        return self._history.get(replica.name, FailureHistory())

    def resume_failures(self, replica: Replica, history: FailureHistory) -> None:
        self._history[replica.name] = history


@dataclass(frozen=True)
class _Failure:
    reason: Reason
    status: ExitStatus | None  # None: a rank could not be spawned (`spawn`)
    at: float
    ready_since: float | None  # when the whole group was last READY, for reset_after
    spawn: SpawnFailure | None = None
    config_error: str | None = None


class Gang:
    """A data-parallel group: one_for_all, one failure history for the whole gang."""

    def __init__(self, name: str, rng: random.Random) -> None:
        self.name = name
        self.rng = rng
        self.members: list[Replica] = []
        self.history = FailureHistory()
        self.rendezvous: str | None = new_rendezvous()
        self._failure: _Failure | None = None
        self._held: dict[str, Reason] = {}  # rank -> the reason counted when the gang restarts

    def on_down(self, replica: Replica, down: Down) -> None:
        if self._failure is None and not down.peer_stop:
            self._failure = _Failure(down.reason, down.status, down.at, self._ready_since(),
                                     config_error=down.config_error)
            log.warning("[group] %s: %s failed (%s): stopping the other ranks", self.name,
                        replica.name, down.reason.value)
            for peer in self.members:
                if peer is not replica:
                    peer.stop_for_peer()
            own = down.reason
        else:
            own = Reason.GROUP
        log.warning("[exit] %s pid %d %s (reason %s): waiting for its group", replica.name,
                    down.pid, down.headline, own.value)
        self._held[replica.name] = own
        replica.hold(own)
        self._maybe_respawn()

    def on_spawn_failed(self, replica: Replica, failure: SpawnFailure) -> None:
        if self._failure is None:
            self._failure = _Failure(Reason.SPAWN_ERROR, None, failure.at, self._ready_since(),
                                     failure)
            log.warning("[group] %s: %s could not be started (%s): stopping the other ranks",
                        self.name, replica.name, failure.description)
            for peer in self.members:
                if peer is not replica:
                    peer.stop_for_peer()
            own = Reason.SPAWN_ERROR
        else:
            own = Reason.GROUP
        self._held[replica.name] = own
        replica.hold(own)
        self._maybe_respawn()

    def _ready_since(self) -> float | None:
        stamps = [m.ready_since for m in self.members]
        return None if any(s is None for s in stamps) else max(s for s in stamps if s is not None)

    def _maybe_respawn(self) -> None:
        # `settled`, not "no process": a rank whose exit is known but not yet reported here
        # would get the decision before its own report, then report into a decided gang.
        if self._failure is None or not all(m.settled for m in self.members):
            return  # some rank is still stopping
        failure, self._failure = self._failure, None
        spec, jitter = self.members[0].spec, self.rng.uniform(-1.0, 1.0)
        if failure.status is None:
            assert failure.spawn is not None
            decision, self.history = decide_spawn_failure(
                failure.at, failure.spawn.errno, failure.spawn.description, self.history,
                spec.backoff, spec.start_limit, jitter)
        else:
            decision, self.history = decide(
                failure.at, spec.restart, failure.status, failure.reason, self.history,
                failure.ready_since, spec.backoff, spec.start_limit, jitter)
        if decision.action is Action.RESTART:
            self.rendezvous = new_rendezvous()
        elif decision.action is Action.FAIL and failure.config_error:
            decision = dataclasses.replace(decision, why=f"exit 78: {failure.config_error}")
        log.warning("[group] %s: all %d ranks down: %s", self.name, len(self.members),
                    describe(decision).replace("restarting", "restarting the group", 1))
        for member in self.members:
            member.apply(decision, self._held.pop(member.name, Reason.GROUP))

    # --- operator commands: the fleet passes the whole gang (one rank cannot rejoin alone) ---
    def start(self, members: list[Replica]) -> None:
        if not any(m.active for m in self.members):
            self._fresh()
        for member in members:
            member.start()

    def stop(self, members: list[Replica]) -> None:
        for member in members:
            member.stop()

    def restart(self, members: list[Replica], reason: Reason = Reason.MANUAL) -> None:
        self._fresh()
        for member in members:
            member.restart(reason)

    def _fresh(self) -> None:
        self.history, self._failure, self._held = FailureHistory(), None, {}
        self.rendezvous = new_rendezvous()

    def forget(self, replica: Replica) -> None:
        self._held.pop(replica.name, None)

    def failures(self, replica: Replica) -> FailureHistory:
        """The gang's one failure record (each rank hands it over; any of them restores it)."""
        return self.history

    def resume_failures(self, replica: Replica, history: FailureHistory) -> None:
        self.history = history


Group = ReplicaGroup | Gang  # the owner of a group's replicas
