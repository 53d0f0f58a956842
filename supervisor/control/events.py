"""State transitions as events: the recent ones kept, new ones pushed to followers.

`GET /v1/events` serves them as JSON lines (`?follow=1`: then every new one as it happens);
`enginectl events [-f]` prints them and `enginectl status --watch` redraws on them.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Callable

from engined.supervisor.lifecycle.view import EngineView

KEPT = 1000  # recent events served to a new reader
FOLLOWER_BACKLOG = 10_000  # a stuck follower must not grow without bound


def transition(view: EngineView, old: str) -> dict[str, Any]:
    """One event: which engine went from what to what, and why when it went down."""
    event: dict[str, Any] = {
        "at": round(time.time(), 6), "engine": view.name, "group": view.group,
        "from": old, "to": view.state.value, "pid": view.pid, "incarnation": view.incarnation,
        "role": "standby" if view.standby else "serving"}
    if view.state.value in ("BACKOFF", "FAILED", "STOPPED") and view.last_exit is not None:
        event["reason"] = view.last_exit.reason
        event["exit"] = view.last_exit.description
    if view.fail_reason:
        event["fail_reason"] = view.fail_reason
    if view.restart_at is not None:
        event["restart_at"] = view.restart_at
    return event


class EventLog:
    def __init__(self, kept: int = KEPT) -> None:
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=kept)
        self.followers: set[asyncio.Queue[dict[str, Any]]] = set()
        self.total = 0
        self.on_publish: Callable[[], None] | None = None  # the state snapshot's keeper

    def publish(self, event: dict[str, Any]) -> None:
        self.recent.append(event)
        self.total += 1
        for queue in self.followers:
            if queue.qsize() < FOLLOWER_BACKLOG:
                queue.put_nowait(event)
        if self.on_publish is not None:
            self.on_publish()

    def restore(self, events: list[dict[str, Any]], total: int) -> None:
        """The history the engined this one replaced kept (an upgrade in place), before ours."""
        mine = list(self.recent)
        self.recent.clear()
        self.recent.extend([*events, *mine])
        self.total += total

    def follow(self) -> asyncio.Queue[dict[str, Any]]:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.followers.add(queue)
        return queue

    def unfollow(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        self.followers.discard(queue)
