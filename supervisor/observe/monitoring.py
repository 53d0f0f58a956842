"""The TCP endpoint (loopback by default): /metrics, /health, /livez, /readyz, served by aiohttp.

Semantics are for load balancers and Kubernetes probes:
* /health: 200 only when every engine that should run is READY, else 503 (JSON body).
* /livez: 200 while the event loop is responsive (the loop monitor's ticker is checked, not just
  this handler).
* /readyz: 200 when every group that should run has at least one READY replica, else 503 (also
  when nothing should run at all: a fleet stopped on purpose serves nothing); a cluster
  gateway's while one of its nodes takes requests (supervisor.cluster.services).
An engine stopped on purpose (`enginectl stop`) is not expected to run and never fails a check.
"""

from __future__ import annotations

from typing import Any, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from engined.supervisor.gateway.stats import GatewayStats
from engined.supervisor.ipc import EngineChannels
from engined.supervisor.lifecycle.fleet import Fleet
from engined.supervisor.lifecycle.loopmonitor import LoopMonitor
from engined.supervisor.observe.metrics import FleetCollector, make_registry, render
from engined.supervisor.observe.ondemand import OnDemandCollector, OnDemandStats
from engined.supervisor.observe.sampler import Sampler

Readiness = Callable[[], tuple[int, dict[str, Any]]]


class MonitoringEndpoint:
    def __init__(self, fleet: Fleet, channels: EngineChannels, sampler: Sampler,
                 monitor: LoopMonitor, gateway: GatewayStats | None = None,
                 handover: Callable[[], dict[str, Any]] = dict,
                 clients: Callable[[], dict[str, Any]] = dict,
                 replica_ports: Callable[[], dict[int, str]] = dict,
                 readiness: Readiness | None = None,
                 nodes: Callable[[], list[tuple[str, bool]]] = list,
                 ondemand: OnDemandStats | None = None) -> None:
        """`gateway`: its counts (None: no gateway); `readiness`: /readyz's answer, the fleet's
        by default; `nodes`: a cluster gateway's, (node, whether it takes requests)."""
        self.fleet, self.channels, self.sampler, self.monitor = fleet, channels, sampler, monitor
        self.gateway, self.handover, self.clients = gateway, handover, clients
        self.replica_ports, self.nodes = replica_ports, nodes
        self.readiness: Readiness = readiness or (lambda: self.fleet.view().readiness())
        self.collector = FleetCollector()
        self.registry = make_registry(self.collector)
        if ondemand is not None:
            self.registry.register(OnDemandCollector(ondemand))

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
        self.collector.update(views, sample, self.channels.dropped, self.monitor,
                              self.gateway, self.handover(), self.clients())
        self.collector.replica_ports = self.replica_ports()
        self.collector.nodes = self.nodes()
        body = render(self.registry)  # on the loop: the handles are the loop's, not a thread's
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        code, body = self.fleet.view().health()
        return web.json_response(body, status=code)

    async def readyz(self, request: web.Request) -> web.Response:
        code, body = self.readiness()
        return web.json_response(body, status=code)

    async def livez(self, request: web.Request) -> web.Response:
        lag = self.monitor.lag_s()
        ok = self.monitor.healthy()
        return web.json_response({"status": "ok" if ok else "stalled", "loop_lag_s": lag},
                                 status=200 if ok else 503)
