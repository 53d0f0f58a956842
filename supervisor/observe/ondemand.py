"""The metrics of on-demand engines (routing.ondemand): sleeps and wakes by reason, how long a
wake took, and the memory budget against what the engines hold."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from engined.supervisor.histogram import Histogram


class OnDemandStats(Protocol):
    wakes: collections.Counter[tuple[str, str]]  # (engine, reason) -> wakes
    sleeps: collections.Counter[tuple[str, str]]
    wake_seconds: dict[str, Histogram]  # engine -> asked to wake -> READY

    def budget_report(self) -> list[tuple[str, int | None, int]]:
        """(pool, its budget or None, what the engines hold in it)."""


class OnDemandCollector:
    """A prometheus_client custom collector beside the fleet's (observe.metrics)."""

    def __init__(self, stats: OnDemandStats) -> None:
        self.stats = stats

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        wakes = CounterMetricFamily("engined_engine_wakes", "Sleeping engines woken, by why "
                                    "(request, load, operator)", labels=["engine", "reason"])
        for (engine, reason), n in sorted(s.wakes.items()):
            wakes.add_metric([engine, reason], n)
        yield wakes
        sleeps = CounterMetricFamily("engined_engine_sleeps", "Engines put to sleep, by why "
                                     "(idle, budget, operator)", labels=["engine", "reason"])
        for (engine, reason), n in sorted(s.sleeps.items()):
            sleeps.add_metric([engine, reason], n)
        yield sleeps
        took = HistogramMetricFamily("engined_engine_wake_seconds", "From a wake's start to "
                                     "the engine's READY", labels=["engine"])
        for engine, hist in sorted(s.wake_seconds.items()):
            took.add_metric([engine], hist.buckets(), hist.total)
        yield took
        budget = GaugeMetricFamily("engined_memory_budget_bytes", "supervisor.memory_budget, "
                                   "per pool (host, gpu:N)", labels=["pool"])
        held = GaugeMetricFamily("engined_memory_budget_held_bytes", "What the engines hold "
                                 "(or will, waking) against the budget, per pool",
                                 labels=["pool"])
        for pool, room, used in s.budget_report():
            if room is not None:
                budget.add_metric([pool], room)
                held.add_metric([pool], used)
        yield budget
        yield held
