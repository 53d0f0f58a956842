"""Time as a dependency: everything that waits, times out or backs off reads this clock.

`monotonic()` must be the event loop's own clock (`loop.time()`), because deadlines are slept on
with asyncio timeouts: the system clock uses time.monotonic, which is what asyncio's loop uses,
and the lifecycle tests run on a loop whose time jumps (tests/lifecycle/autojump.py) with a clock
that reads it.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on the event loop's clock (CLOCK_MONOTONIC in production)."""

    def wall(self) -> float:
        """Unix time, for what status and metrics show."""


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


def to_wall(clock: Clock, monotonic: float) -> float:
    """The unix time of a moment on the monotonic clock."""
    return clock.wall() - (clock.monotonic() - monotonic)
