"""The TCP endpoint (loopback by default): /metrics, /health, /livez, /readyz, served by aiohttp.

Semantics are for load balancers and Kubernetes probes:
* /health: 200 only when every engine that should run is READY, else 503 (JSON body).
* /livez: 200 while the event loop is responsive (the loop monitor's ticker is checked, not just
  this handler).
* /readyz: 200 when every group that should run has at least one READY replica, else 503 (also
  when nothing should run at all: a fleet stopped on purpose serves nothing).
An engine stopped on purpose (`enginectl stop`) is not expected to run and never fails a check.
"""

from __future__ import annotations

from typing import Any, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from engined.supervisor.cluster import Nodes
from engined.supervisor.gateway.app import Gateway
from engined.supervisor.ipc import EngineChannels
from engined.supervisor.lifecycle.fleet import Fleet
from engined.supervisor.lifecycle.loopmonitor import LoopMonitor
from engined.supervisor.observe.metrics import FleetCollector, make_registry, render
from engined.supervisor.observe.sampler import Sampler


class MonitoringEndpoint:
    def __init__(self, fleet: Fleet, channels: EngineChannels, sampler: Sampler,
                 monitor: LoopMonitor, gateway: Gateway | None = None,
                 handover: Callable[[], dict[str, Any]] = dict,
                 clients: Callable[[], dict[str, Any]] = dict,
                 replica_ports: Callable[[], dict[int, str]] = dict,
                 nodes: Nodes | None = None) -> None:
        self.fleet, self.channels, self.sampler, self.monitor = fleet, channels, sampler, monitor
        self.gateway, self.handover, self.clients = gateway, handover, clients
        self.replica_ports, self.nodes = replica_ports, nodes
        self.collector = FleetCollector()
        self.registry = make_registry(self.collector)

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=4096)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        app.router.add_get("/livez", self.livez)
        app.router.add_get("/readyz", self.readyz)
        return app

    async def metrics(self, request: web.Request) -> web.Response:
        views = self.fleet.view().engines
        sample = await self.sampler.sample([v.pid for v in views if v.pid is not None])
        gateway = self.gateway
        self.collector.update(views, sample, self.channels.dropped, self.monitor,
                              gateway.stats if gateway else None, self.handover(),
                              self.clients())
        self.collector.replica_ports = self.replica_ports()
        if self.nodes is not None:
            self.collector.nodes = [(n.name, n.routable())
                                    for n in sorted(self.nodes.nodes.values(),
                                                    key=lambda n: n.name)]
        body = render(self.registry)  # on the loop: the handles are the loop's, not a thread's
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        code, body = self.fleet.view().health()
        return web.json_response(body, status=code)

    async def readyz(self, request: web.Request) -> web.Response:
        if self.nodes is not None and not self.fleet.stopping:  # a cluster gateway: ready
            return self._nodes_ready(self.nodes)  # while a node takes requests
        code, body = self.fleet.view().readiness()
        return web.json_response(body, status=code)

    @staticmethod
    def _nodes_ready(nodes: Nodes) -> web.Response:
        listed = {n.name: "up" if n.routable() else n.why or "down"
                  for n in nodes.nodes.values()}
        up = sum(1 for state in listed.values() if state == "up")
        return web.json_response({"status": "ready" if up else "not ready", "nodes": listed,
                                  "unresolved": nodes.resolve_errors},
                                 status=200 if up else 503)

    async def livez(self, request: web.Request) -> web.Response:
        lag = self.monitor.lag_s()
        ok = self.monitor.healthy()
        return web.json_response({"status": "ok" if ok else "stalled", "loop_lag_s": lag},
                                 status=200 if ok else 503)
