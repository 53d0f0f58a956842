"""Every request's way into and out of the gateway, whatever answers it: admitted to its group's
queue (429 past queue_limit, 503 once engined is shutting down), counted in flight (a shutdown
or an upgrade drains them), its outcome, latency, time to first token and moves counted
(gateway.stats), and one log line when it ends."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from engined.engine.memory import trim
from engined.supervisor.gateway.openai import ApiError
from engined.supervisor.gateway.openai import outcome as outcome_of
from engined.supervisor.gateway.stats import GatewayStats
from engined.supervisor.routing.routes import Closing, QueueFull, Routes

log = logging.getLogger("engined.gateway")

TRIM_EVERY_S = 10.0  # the daemon trims its heap when the gateway goes idle, at most this often
# answers a request: run(deadline, migration_limit) -> (outcome, response)
Run = Callable[[float, int], Awaitable[tuple[str, web.StreamResponse]]]


class Admission:
    def __init__(self, router: Routes, clock: Callable[[], float],
                 on_counted: Callable[[], None] = lambda: None) -> None:
        self.router, self.clock = router, clock
        self.on_counted = on_counted  # a request was counted: the state snapshot is due
        self.stats = GatewayStats()
        self.active = 0  # requests in flight (shutdown drains them)
        self._idle = asyncio.Event()
        self._idle.set()
        self._trimmed_at = float("-inf")

    def moved(self, model: str) -> None:
        self.stats.migrations[model] += 1

    def first(self, model: str, seconds: float) -> None:
        """The request's first token (or byte) reached its client after `seconds`."""
        self.stats.observe(self.stats.ttft, model, seconds)

    async def drained(self, timeout_s: float) -> bool:
        """Until no request is in flight (shutdown: finish what runs), at most `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    async def serve(self, request: web.Request, model: str | None, group: str,
                    run: Run) -> web.StreamResponse:
        """Admission, accounting and the log line of one request; `run` answers it."""
        rid, label = request["request_id"], model or group
        started = self.clock()
        self._admit(group, label)
        self.active += 1
        self._idle.clear()
        route = self.router.route_of(group)
        outcome = "error"
        try:
            outcome, response = await run(started + route.request_timeout_s,
                                          route.migration_limit)
            return response
        except ApiError as exc:
            outcome = outcome_of(exc)
            raise
        except asyncio.CancelledError:
            outcome = "client_gone"  # the client hung up (its handler was cancelled)
            raise
        finally:
            self.router.leave(group)
            self._ended()
            self.stats.requests[(label, outcome)] += 1
            self.on_counted()
            self.stats.observe(self.stats.latency, label, self.clock() - started)
            log.info("[gateway] %s %s %s %s in %.3fs", rid, request.path, label, outcome,
                     self.clock() - started)

    def _admit(self, group: str, label: str) -> None:
        try:
            self.router.admit(group)
        except QueueFull as exc:
            self.stats.requests[(label, "rejected")] += 1
            raise ApiError(429, str(exc), kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except Closing as exc:
            self.stats.requests[(label, "rejected")] += 1
            raise ApiError(503, str(exc), kind="server_error",
                           headers={"Retry-After": "5"}) from None

    def _ended(self) -> None:
        self.active -= 1
        if not self.active:
            self._idle.set()
            if self.clock() - self._trimmed_at >= TRIM_EVERY_S:  # a burst ended: give the
                self._trimmed_at = self.clock()  # heap it grew back (glibc malloc_trim)
                trim()
