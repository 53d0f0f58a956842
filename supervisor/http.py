"""The TCP endpoint (loopback by default): /metrics, /health, /livez, /readyz, served by aiohttp.

Semantics are for load balancers and Kubernetes probes:
* /health: 200 only when every engine that should run is READY, else 503 (JSON body).
* /livez: 200 while the event loop is responsive (a loop ticker is checked, not just this handler).
* /readyz: 200 when every group that should run has at least one READY replica, else 503.
An engine stopped on purpose (`enginectl stop`) is not expected to run and never fails a check.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from supervisor.fleet import Fleet
from supervisor.handle import Desired
from supervisor.ipc import EngineChannels
from supervisor.metrics import FleetCollector, make_registry, render
from supervisor.sampler import Sampler
from supervisor.state import EngineState

LOOP_TICK_S = 0.5
LOOP_STALE_S = 5.0


class LoopTicker:
    """Stamps the time every tick; a stale stamp means the loop was blocked."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-ticker")

    async def _run(self) -> None:
        while True:
            self.last = time.monotonic()
            await asyncio.sleep(LOOP_TICK_S)

    def lag_s(self) -> float:
        return max(0.0, time.monotonic() - self.last - LOOP_TICK_S)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


def health(fleet: Fleet) -> tuple[int, dict]:
    wanted = [h for h in fleet.handles.values() if h.desired is Desired.RUN]
    ready = [h for h in wanted if h.state is EngineState.READY]
    if len(ready) == len(wanted):
        status = "ok"
    else:
        status = "down" if not ready else "degraded"
    body = {"status": status, "engines": {h.name: h.state.value for h in fleet.handles.values()},
            "ready": len(ready), "expected": len(wanted)}
    return (200 if status == "ok" else 503), body


def readiness(fleet: Fleet) -> tuple[int, dict]:
    groups: dict[str, bool] = {}
    for group, members in fleet.groups().items():
        wanted = [h for h in members if h.desired is Desired.RUN]
        if wanted:
            groups[group] = any(h.state is EngineState.READY for h in wanted)
    ok = all(groups.values())
    return (200 if ok else 503), {"status": "ready" if ok else "not ready", "groups": groups}


class MetricsEndpoint:
    def __init__(self, fleet: Fleet, channels: EngineChannels, sampler: Sampler,
                 ticker: LoopTicker) -> None:
        self.fleet, self.channels, self.sampler, self.ticker = fleet, channels, sampler, ticker
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
        handles = list(self.fleet.handles.values())
        sample = await self.sampler.sample([h.pid for h in handles if h.pid is not None])
        self.collector.update(handles, sample, self.channels.dropped)
        body = render(self.registry)  # on the loop: the handles are the loop's, not a thread's
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        code, body = health(self.fleet)
        return web.json_response(body, status=code)

    async def readyz(self, request: web.Request) -> web.Response:
        code, body = readiness(self.fleet)
        return web.json_response(body, status=code)

    async def livez(self, request: web.Request) -> web.Response:
        lag = self.ticker.lag_s()
        ok = lag < LOOP_STALE_S
        return web.json_response({"status": "ok" if ok else "stalled", "loop_lag_s": lag},
                                 status=200 if ok else 503)
