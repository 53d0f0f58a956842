"""The daemon watching itself: how late its event loop runs, and when it did not run at all.

A ticker wakes every TICK_S; every timed wait in the lifecycle reports how late it woke, too
(`note`). A wake-up later than STALLED_S means engined itself did not run for that long (a
SIGSTOP, a VM pause, a swap storm, a debugger, a blocking call on the loop): heartbeats that
arrived meanwhile are still unread in the kernel, so nothing may be judged on that time. The gap
becomes a pause that every liveness deadline (hang, stall, startup) moves back by, and no verdict
is given until one heartbeat interval of normal running has passed, so the queued heartbeats are
read first (DESIGN: "the daemon never blames engines for its own stalls"). Engines that really
froze are still caught one timeout after.
"""

from __future__ import annotations

import asyncio
import logging
import math

from engined.supervisor.histogram import Histogram
from engined.supervisor.lifecycle.clock import Clock
from engined.supervisor.lifecycle.pauses import NO_PAUSES, Pauses

log = logging.getLogger("engined.loop")

TICK_S = 0.25
STALLED_S = 1.0  # a wake-up this late means the daemon did not run: a pause, not lag
STALE_S = 5.0  # /livez and the systemd watchdog: the loop is wedged
LAG_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                 60.0)


class LoopMonitor:
    def __init__(self, clock: Clock, grace_s: float, stalled_s: float = STALLED_S,
                 tick_s: float = TICK_S) -> None:
        self.clock = clock
        self.grace_s = grace_s  # one heartbeat interval: what may be queued is read by then
        self.stalled_s = stalled_s
        self.tick_s = tick_s
        self.pauses: Pauses = NO_PAUSES
        self.judge_after = -math.inf
        self.stalled_seconds_total = 0.0
        self.lag = Histogram(LAG_BUCKETS_S)
        self.last_tick = clock.monotonic()
        self._task: asyncio.Task[None] | None = None

    def note(self, expected: float, now: float) -> None:
        """A timed wait due at `expected` woke at `now`."""
        late = now - expected
        if late < self.stalled_s:
            return
        spans = self.pauses.spans
        if spans and spans[-1][1] >= expected:  # the same pause, seen by another waiter
            (s0, e0), (s1, e1) = spans[-1], (min(spans[-1][0], expected), max(spans[-1][1], now))
            self.pauses = Pauses((*spans[:-1], (s1, e1)))
            self.stalled_seconds_total += (e1 - s1) - (e0 - s0)
        else:
            self.pauses = self.pauses.add(expected, now)
            self.stalled_seconds_total += late
            log.warning("[loop] engined did not run for %.1fs: liveness deadlines extended",
                        late)
        self.judge_after = max(self.judge_after, now + self.grace_s)

    # --- the ticker --------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-monitor")

    async def _run(self) -> None:
        while True:
            expected = self.clock.monotonic() + self.tick_s
            await asyncio.sleep(self.tick_s)
            now = self.clock.monotonic()
            self.lag.observe(max(0.0, now - expected))
            self.note(expected, now)
            self.last_tick = now

    def lag_s(self) -> float:
        """How overdue the ticker is now (0 while the loop runs normally)."""
        return max(0.0, self.clock.monotonic() - self.last_tick - self.tick_s)

    def healthy(self) -> bool:
        return self.lag_s() < STALE_S

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
