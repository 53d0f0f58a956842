"""What the gateway counts, for /metrics (observe.metrics) and an upgrade's hand-over: requests by
model and outcome, moves, time to first token and latency. Small on purpose: observability
imports it, never the gateway's app."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from engined.supervisor.histogram import Histogram

OUTCOMES = ("ok", "error", "timeout", "rejected", "client_gone")
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                     120.0, 300.0)


@dataclass
class GatewayStats:
    requests: collections.Counter[tuple[str, str]] = field(
        default_factory=collections.Counter)  # (model, outcome)
    migrations: collections.Counter[str] = field(default_factory=collections.Counter)
    ttft: dict[str, Histogram] = field(default_factory=dict)
    latency: dict[str, Histogram] = field(default_factory=dict)

    def observe(self, kind: dict[str, Histogram], model: str, seconds: float) -> None:
        if model not in kind:
            kind[model] = Histogram(LATENCY_BUCKETS_S)
        kind[model].observe(seconds)


__all__ = ["GatewayStats", "LATENCY_BUCKETS_S", "OUTCOMES"]
