"""What the lifecycle publishes, one way: a replica says what happened; whoever cares subscribes.

Two topics, wired in one place (the daemon's `Services.build`):

* `state`: a replica changed lifecycle state (the event log, the router's waiting requests and
  systemd's STATUS= line subscribe);
* `lost`: an incarnation is gone (it exited, was killed as hung or stalled, or stopped): the
  requests still on it fail now, not at their timeout (the engine channels and the gateway's
  upstream client subscribe).

A subscriber runs on the event loop, synchronously, in subscription order; it must not raise
(an exception is logged and the next subscriber still runs: one broken reader never takes the
lifecycle down with it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from engined.supervisor.lifecycle.state import EngineState
from engined.supervisor.lifecycle.view import EngineView

log = logging.getLogger("engined.notices")

T = TypeVar("T")


@dataclass(frozen=True)
class StateChange:
    view: EngineView  # the replica right after the change
    old: EngineState


@dataclass(frozen=True)
class Lost:
    address: tuple[str, int]  # the incarnation's routing identity: (its name, its number)
    why: str  # for its requests' error text: "exited", "hung (no heartbeat)", ...


class Topic(Generic[T]):
    def __init__(self, name: str) -> None:
        self.name = name
        self._subscribers: list[Callable[[T], object]] = []

    def subscribe(self, subscriber: Callable[[T], object]) -> None:
        self._subscribers.append(subscriber)

    def publish(self, item: T) -> None:
        for subscriber in self._subscribers:
            try:
                subscriber(item)
            except Exception:  # noqa: BLE001 - a subscriber's bug must not stop the lifecycle
                log.exception("[bug] a subscriber of %s failed on %r", self.name, item)


class Notices:
    def __init__(self) -> None:
        self.state: Topic[StateChange] = Topic("state")
        self.lost: Topic[Lost] = Topic("lost")
