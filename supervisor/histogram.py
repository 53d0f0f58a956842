"""A histogram's cumulative-bucket counts, as Prometheus wants them: the event loop's lag
(lifecycle.loopmonitor) and the gateway's latencies (gateway.stats)."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field


@dataclass
class Histogram:
    bounds: tuple[float, ...]  # each bucket's upper bound, ascending (+Inf is implied)
    counts: list[int] = field(default_factory=list)  # per bucket, +Inf last (not cumulative)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def buckets(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs, +Inf last, as Prometheus wants them."""
        out, running = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            running += count
            out.append(("+Inf" if bound == math.inf else f"{bound:g}", running))
        return out
