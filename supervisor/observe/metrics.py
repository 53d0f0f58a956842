"""Prometheus metrics: one collector that reads the supervisor's state at scrape time.

Nothing else in the daemon touches metric objects: counters come from state the replicas keep
anyway (restart counts by reason, request outcomes, CPU of exited incarnations), read through
their immutable views, so they cannot drift from what `enginectl status` shows, and they never go
backwards within a daemon lifetime.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from engined.supervisor import __version__
from engined.supervisor.gateway.stats import OUTCOMES as GATEWAY_OUTCOMES
from engined.supervisor.gateway.stats import GatewayStats
from engined.supervisor.lifecycle.loopmonitor import LoopMonitor
from engined.supervisor.lifecycle.state import EngineState, Reason
from engined.supervisor.lifecycle.view import EngineView
from engined.supervisor.observe.sampler import Sample

REQUEST_OUTCOMES = ("ok", "error", "timeout")


class FleetCollector:
    """A prometheus_client custom collector over the fleet's views and the latest sample."""

    def __init__(self, views: Iterable[EngineView] | None = None) -> None:
        self._views: list[EngineView] = list(views or [])
        self._sample = Sample(at=0.0)
        self._ipc_dropped: dict[str, int] = {}
        self._cpu_reported: dict[str, float] = {}
        self._monitor: LoopMonitor | None = None
        self._gateway: GatewayStats | None = None
        self._handover: dict[str, Any] = {}
        self._clients: dict[str, Any] = {}
        self.replica_ports: dict[int, str] = {}  # supervisor.replica_ports: port -> replica
        self.nodes: list[tuple[str, bool]] = []  # a cluster gateway's: (node, routable)

    def update(self, views: Iterable[EngineView], sample: Sample,
               ipc_dropped: dict[str, int], monitor: LoopMonitor | None = None,
               gateway: GatewayStats | None = None,
               handover: dict[str, Any] | None = None,
               clients: dict[str, Any] | None = None) -> None:
        self._views, self._sample, self._ipc_dropped = list(views), sample, dict(ipc_dropped)
        self._monitor, self._gateway = monitor, gateway
        self._handover, self._clients = handover or {}, clients or {}

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: families vary with the fleet

    def collect(self) -> Iterator[Metric]:
        build = GaugeMetricFamily("engined_build_info", "engined build", labels=["version"])
        build.add_metric([__version__], 1)
        yield build
        yield from self._engine_metrics()
        yield from self._gpu_device_metrics()
        dropped = CounterMetricFamily("engined_ipc_dropped_messages",
                                      "Engine-channel messages dropped (malformed, stale, unknown)",
                                      labels=["kind"])
        for kind, count in sorted(self._ipc_dropped.items()):
            dropped.add_metric([kind], count)
        yield dropped
        yield from self._loop_metrics()
        yield from self._gateway_metrics()
        yield from self._handover_metrics()
        yield from self._client_metrics()
        yield from self._replica_metrics()
        yield from self._node_metrics()

    def _replica_metrics(self) -> Iterator[Metric]:
        """supervisor.replica_ports: whether each replica's own port has a READY engine behind
        it (0: requests there get a 503 at once)."""
        if not self.replica_ports:
            return
        up = GaugeMetricFamily("engined_replica_up", "A replica's own port (replica_ports) "
                               "serves: 1, its replica is READY", labels=["port"])
        ready = {v.name: v.is_ready for v in self._views}
        for port, name in sorted(self.replica_ports.items()):
            up.add_metric([str(port)], 1.0 if ready.get(name) else 0.0)
        yield up

    def _node_metrics(self) -> Iterator[Metric]:
        """A cluster gateway's nodes (upstreams:): 1 while one takes requests."""
        if not self.nodes:
            return
        up = GaugeMetricFamily("engined_cluster_node_up", "A cluster gateway's node gateway "
                               "answers its probes and takes requests: 1", labels=["node"])
        for name, routable in self.nodes:
            up.add_metric([name], 1.0 if routable else 0.0)
        yield up

    def _client_metrics(self) -> Iterator[Metric]:
        """What the HTTP servers did to their clients (supervisor.webserver), by server:
        connections shed for a new one, new ones closed, deadlines that cut a client off."""
        shed = CounterMetricFamily("engined_http_connections_shed",
                                   "Connections closed to make room for a new one, by why they "
                                   "were chosen", labels=["server", "reason"])
        refused = CounterMetricFamily("engined_http_connections_refused",
                                      "New connections closed at once: every one serving a "
                                      "request (full) or past the per-address cap",
                                      labels=["server", "reason"])
        timeouts = CounterMetricFamily("engined_http_client_timeouts",
                                       "Clients cut off by a deadline: a request body too slow, "
                                       "an answer not read", labels=["server", "what"])
        for server, counts in sorted(self._clients.items()):
            for reason in ("idle", "slow"):
                shed.add_metric([server, reason], counts[f"shed_{reason}"])
            for reason in ("full", "per_address"):
                refused.add_metric([server, reason], counts[f"refused_{reason}"])
            for what in ("body", "write"):
                timeouts.add_metric([server, what], counts[f"timeout_{what}"])
        yield shed
        yield refused
        yield timeouts

    def _handover_metrics(self) -> Iterator[Metric]:
        """Upgrades in place (supervisor.upgrade): how many, the last one's gap, what was cut,
        and when each engine's process was adopted."""
        h = self._handover
        handovers = CounterMetricFamily("engined_handovers",
                                        "Upgrades of engined in place so far (its generation)")
        handovers.add_metric([], h.get("handovers", 0))
        yield handovers
        cut = CounterMetricFamily("engined_handover_cut_requests",
                                  "Requests an upgrade's drain bound cut")
        cut.add_metric([], h.get("handover_cut", 0))
        yield cut
        if h.get("handover_s") is not None:
            gap = GaugeMetricFamily("engined_handover_seconds", "The last upgrade's gap: from "
                                    "the old code's last accept to the new code's first")
            gap.add_metric([], h["handover_s"])
            yield gap
        adopted = GaugeMetricFamily("engined_engine_adopted_timestamp_seconds",
                                    "When the engine's process was adopted by an upgraded "
                                    "engined (unix time)", labels=["engine"])
        for v in self._views:
            if v.adopted_at is not None:
                adopted.add_metric([v.name], v.adopted_at)
        yield adopted

    def _gateway_metrics(self) -> Iterator[Metric]:
        stats = self._gateway
        if stats is None:
            return  # the gateway is off
        requests = CounterMetricFamily("engined_gateway_requests",
                                       "OpenAI API requests by model and outcome",
                                       labels=["model", "outcome"])
        models = sorted({m for m, _ in stats.requests} | set(stats.migrations))
        for model in models:
            for outcome in GATEWAY_OUTCOMES:
                requests.add_metric([model, outcome], stats.requests[(model, outcome)])
        yield requests
        moves = CounterMetricFamily("engined_gateway_migrations",
                                    "Requests moved to another replica after theirs went away",
                                    labels=["model"])
        for model in models:
            moves.add_metric([model], stats.migrations[model])
        yield moves
        for name, doc, hists in (
                ("engined_gateway_time_to_first_token_seconds",
                 "From a request's arrival to its first token", stats.ttft),
                ("engined_gateway_request_duration_seconds",
                 "A request's whole life in the gateway", stats.latency)):
            family = HistogramMetricFamily(name, doc, labels=["model"])
            for model, hist in sorted(hists.items()):
                family.add_metric([model], hist.buckets(), hist.total)
            yield family

    def _loop_metrics(self) -> Iterator[Metric]:
        monitor = self._monitor
        if monitor is None:
            return
        lag = HistogramMetricFamily("engined_event_loop_lag_seconds",
                                    "How late the daemon's event loop ran its ticker")
        lag.add_metric([], monitor.lag.buckets(), monitor.lag.total)
        yield lag
        stalled = CounterMetricFamily("engined_event_loop_stalled_seconds",
                                      "Time the daemon itself did not run (liveness deadlines "
                                      "were extended by it)")
        stalled.add_metric([], monitor.stalled_seconds_total)
        yield stalled

    def _engine_metrics(self) -> Iterator[Metric]:
        f = _Families()
        for v in self._views:
            name = v.name
            f.info.add_metric([name, v.group, v.model], 1)
            for state in EngineState:
                f.state.add_metric([name, state.value], 1 if v.state is state else 0)
            f.up.add_metric([name], 1 if v.is_ready else 0)
            for reason in Reason:
                f.restarts.add_metric([name, reason.value], v.restarts_of(reason.value))
            for outcome in REQUEST_OUTCOMES:
                f.requests.add_metric([name, outcome], v.requests_of(outcome))
            if v.spawned_at is not None:
                f.start_time.add_metric([name], v.spawned_at)
            if v.startup_s is not None:
                f.startup.add_metric([name], v.startup_s)
            if v.heartbeat_at is not None:
                f.heartbeat.add_metric([name], v.heartbeat_at)
            self._process_metrics(f, v)
            self._heartbeat_metrics(f, v)
        yield from f.all()

    def _process_metrics(self, f: _Families, h: EngineView) -> None:
        tree = self._sample.trees.get(h.pid) if h.pid is not None else None
        if tree is not None:
            f.rss.add_metric([h.name], tree.rss_bytes)
        # Exited incarnations' CPU plus the live tree; clamped so a tree member that exits
        # unreaped by the engine cannot make the counter step back.
        cpu = h.cpu_seconds_exited + (tree.cpu_seconds if tree else 0.0)
        cpu = max(cpu, self._cpu_reported.get(h.name, 0.0))
        self._cpu_reported[h.name] = cpu
        f.cpu.add_metric([h.name], cpu)
        for device in self._sample.gpus:
            used = tree.gpu_bytes(device) if tree is not None else None
            if used is not None:
                f.gpu_used.add_metric([h.name, str(device.index)], used)

    @staticmethod
    def _heartbeat_metrics(f: _Families, h: EngineView) -> None:
        hb = h.heartbeat
        if hb is None:
            return
        f.running.add_metric([h.name], hb.running)
        f.waiting.add_metric([h.name], hb.waiting)
        if hb.batch_limit is not None:
            f.batch_limit.add_metric([h.name], hb.batch_limit)
            f.oom.add_metric([h.name], h.oom_total)
        if hb.memory_headroom is not None:
            f.headroom.add_metric([h.name], hb.memory_headroom)
        for mem in hb.gpu_memory:
            labels = [h.name, str(mem.gpu)]
            f.gpu_allocated.add_metric(labels, mem.allocated_bytes)
            f.gpu_reserved.add_metric(labels, mem.reserved_bytes)
            f.gpu_peak.add_metric(labels, mem.peak_bytes)

    def _gpu_device_metrics(self) -> Iterator[Metric]:
        if not self._sample.gpus:
            return  # no NVML: device metrics are absent, not zero
        used = GaugeMetricFamily("engined_gpu_memory_used_bytes", "GPU memory used (NVML)",
                                 labels=["gpu", "uuid"])
        total = GaugeMetricFamily("engined_gpu_memory_total_bytes", "GPU memory total (NVML)",
                                  labels=["gpu", "uuid"])
        for device in self._sample.gpus:
            used.add_metric([str(device.index), device.uuid], device.used_bytes)
            total.add_metric([str(device.index), device.uuid], device.total_bytes)
        yield used
        yield total


class _Families:
    """The per-engine metric families of one scrape."""

    def __init__(self) -> None:
        e, eg = ["engine"], ["engine", "gpu"]
        self.info = GaugeMetricFamily("engined_engine_info", "Engine identity",
                                      labels=["engine", "group", "model"])
        self.state = GaugeMetricFamily("engined_engine_state",
                                       "1 for the engine's current state, 0 for the others",
                                       labels=["engine", "state"])
        self.up = GaugeMetricFamily("engined_engine_up", "1 when the engine is READY", labels=e)
        self.restarts = CounterMetricFamily("engined_engine_restarts",
                                            "Engine restarts by reason",
                                            labels=["engine", "reason"])
        self.start_time = GaugeMetricFamily("engined_engine_start_time_seconds",
                                            "Unix time of the current spawn", labels=e)
        self.startup = GaugeMetricFamily("engined_engine_startup_duration_seconds",
                                         "Last spawn-to-READY duration", labels=e)
        self.heartbeat = GaugeMetricFamily("engined_engine_heartbeat_timestamp_seconds",
                                           "Unix time of the last heartbeat received", labels=e)
        self.rss = GaugeMetricFamily("engined_engine_resident_memory_bytes",
                                     "Resident memory of the engine's process tree", labels=e)
        self.cpu = CounterMetricFamily("engined_engine_cpu_seconds",
                                       "CPU time of the engine's process tree, all incarnations",
                                       labels=e)
        self.gpu_allocated = GaugeMetricFamily("engined_engine_gpu_memory_allocated_bytes",
                                               "torch allocated GPU memory", labels=eg)
        self.gpu_reserved = GaugeMetricFamily("engined_engine_gpu_memory_reserved_bytes",
                                              "torch reserved GPU memory", labels=eg)
        self.gpu_peak = GaugeMetricFamily("engined_engine_gpu_memory_peak_bytes",
                                          "torch peak allocated GPU memory", labels=eg)
        self.gpu_used = GaugeMetricFamily("engined_engine_gpu_memory_used_bytes",
                                          "GPU memory used by the engine process (NVML)",
                                          labels=eg)
        self.requests = CounterMetricFamily("engined_engine_requests",
                                            "Generate requests by outcome",
                                            labels=["engine", "outcome"])
        self.running = GaugeMetricFamily("engined_engine_requests_running",
                                         "Requests in the batch being computed", labels=e)
        self.waiting = GaugeMetricFamily("engined_engine_requests_waiting",
                                         "Requests queued in the engine", labels=e)
        self.batch_limit = GaugeMetricFamily(
            "engined_engine_batch_limit", "Sequences one step may take now (lowered by an "
            "out-of-memory step, grown back as steps succeed)", labels=e)
        self.oom = CounterMetricFamily(
            "engined_engine_oom", "Steps that ran out of memory and were continued with a "
            "smaller batch (the current incarnation's)", labels=e)
        self.headroom = GaugeMetricFamily(
            "engined_engine_memory_headroom_bytes", "Memory the engine may still take under "
            "its memory_limit", labels=e)

    def all(self) -> Iterator[Metric]:
        return iter(vars(self).values())


def make_registry(collector: FleetCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)  # the daemon's own process_* metrics
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
