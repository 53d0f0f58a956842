"""An asyncio event loop whose clock jumps: when nothing is ready to run, time advances straight to
the next timer. A 30-second SIGTERM -> SIGKILL escalation runs in microseconds, and deadlines are
exact (trio's autojump_clock, for asyncio).

Real file descriptors (the fake children's output pipes) are still polled before every jump, so
whatever is ready is seen first. A loop with no timer left and nothing ready is deadlocked: it
waits a little real time (for a worker thread), then raises.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

START = 1000.0  # virtual monotonic time at loop start
WALL_OFFSET = 1_700_000_000.0  # virtual unix time = WALL_OFFSET + monotonic
_REAL_IDLE_S = 5.0


class Deadlock(RuntimeError):
    pass


class _JumpingSelector(selectors.DefaultSelector):  # type: ignore[misc, valid-type]
    def __init__(self) -> None:
        super().__init__()
        self.loop: AutojumpLoop | None = None

    def select(self, timeout: float | None = None) -> list[Any]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            ready = super().select(_REAL_IDLE_S)
            if not ready:
                raise Deadlock("no timer pending and nothing ready: the test waits forever")
            return ready
        assert self.loop is not None
        self.loop.now += timeout
        return []


class AutojumpLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = START

    def time(self) -> float:
        return self.now

    def _run_once(self) -> None:
        # asyncio runs a timer up to its clock resolution (1 ns) early. A real clock has moved
        # on by the time the callback looks at it; a virtual one has not, so a wait for a
        # deadline that lands a hair short of it (0.1 s steps add up to 29.99999999999 s)
        # would time out, find the deadline not yet reached, and wait again forever. Time
        # reaches a timer that fires early.
        if self._scheduled:
            when = self._scheduled[0].when()
            if self.now < when < self.now + self._clock_resolution:  # type: ignore[attr-defined]
                self.now = when
        super()._run_once()  # type: ignore[misc]


class VirtualClock:
    """The lifecycle's Clock on an AutojumpLoop (or any loop: it reads loop.time())."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def monotonic(self) -> float:
        return self.loop.time()

    def wall(self) -> float:
        return WALL_OFFSET + self.loop.time()


def run(main: Callable[[], Awaitable[T]]) -> T:
    """Run `main()` to completion on a fresh AutojumpLoop."""
    loop = AutojumpLoop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
