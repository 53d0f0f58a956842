"""Watching a command engine (a server engined did not write) from outside: probes and progress.

engined's own engines tell it they are READY and heartbeat their busy loop's progress. A server
such as `vllm serve` does neither, so a `Prober` per incarnation asks instead, and speaks
for it in the same terms the lifecycle already understands:

- **probe** (`probe: {path, interval, timeout, failures}`): an HTTP GET on the replica's port,
  one in flight at a time (a slow server never gets a pile of them). The first 2xx makes the
  replica READY (a `Ready` message); every pass is a heartbeat; `failures` failures in a row
  declare it hung. A probe whose window overlapped a pause of engined itself is not counted
  (DESIGN: the daemon never blames engines for its own stalls).
- **progress** (`progress: vllm`, or `{metrics, busy, counter}`): each probe interval, the
  server's Prometheus text: work is in flight when its `busy` gauge is above 0, or when the
  gateway has requests on the replica (an engine core that froze while idle never reports
  running requests again); progress is its `counter` moving. The heartbeat carries both, so the
  replica's ordinary stall check applies: work in flight and no progress for stall_timeout.
- **canary** (`canary: {idle, timeout}`, on by default for a server with an OpenAI API): an
  engine core that froze while idle leaves /health at 200 and reports no work, so neither of the
  above sees it until a client's request stalls. After `idle` with no request in flight, the
  prober sends the server a one-token completion (for the first model its /v1/models lists),
  straight to its port: it never competes with clients (only while none is in flight, one at a
  time) and never counts in the gateway's metrics. No answer within `timeout` (or no
  connection): hung, killed and restarted with the reason `canary`. An HTTP error answer is a
  server that answered: logged, not judged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import aiohttp

from engined.engine import protocol as proto
from engined.supervisor.lifecycle.clock import Clock
from engined.supervisor.lifecycle.loopmonitor import LoopMonitor
from engined.supervisor.lifecycle.state import Reason
from engined.supervisor.spec.model import EngineSpec

log = logging.getLogger("engined.probe")

MAX_BODY_BYTES = 4 << 20  # a /metrics page; a larger one is not read to the end


class ProbeFailed(Exception):
    pass


T = TypeVar("T")


async def _within(request: Awaitable[T], what: str, timeout_s: float) -> T:
    """The request's result; ProbeFailed saying `what` failed and why otherwise."""
    try:
        return await asyncio.wait_for(request, timeout_s)
    except asyncio.TimeoutError:
        raise ProbeFailed(f"{what}: no answer within {timeout_s:g}s") from None
    except aiohttp.ClientError as exc:
        raise ProbeFailed(f"{what}: {type(exc).__name__}: {exc}") from None


class ProbeClient:
    """One HTTP client for every probe of the daemon (loopback, no keep-alive: a server that
    hung must not leave a stale pooled connection behind)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True, limit=0),
                auto_decompress=False)
        return self._session

    async def get(self, port: int, path: str, timeout_s: float,
                  read_body: bool = False) -> str:
        """The body (when asked for) of a 2xx answer; ProbeFailed with why otherwise."""
        return await _within(self._get(port, path, read_body), f"GET {path}", timeout_s)

    async def post(self, port: int, path: str, body: dict[str, object],
                   timeout_s: float) -> int:
        """POST a JSON body; the answer's status once it is whole. ProbeFailed: no answer
        within timeout_s, or no connection."""
        return await _within(self._post(port, path, body), f"POST {path}", timeout_s)

    async def _post(self, port: int, path: str, body: dict[str, object]) -> int:
        url = f"http://127.0.0.1:{port}{path}"
        async with self.session().post(url, json=body, allow_redirects=False) as response:
            await response.content.read(MAX_BODY_BYTES)
            return response.status

    async def _get(self, port: int, path: str, read_body: bool) -> str:
        url = f"http://127.0.0.1:{port}{path}"
        async with self.session().get(url, allow_redirects=False) as response:
            if not 200 <= response.status < 300:
                raise ProbeFailed(f"GET {path}: HTTP {response.status}")
            if not read_body:
                return ""
            body = await response.content.read(MAX_BODY_BYTES)
            return body.decode("utf-8", "replace")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


# what a vLLM-style server says of its queue and its KV cache (vLLM's older name second)
WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", re.M)


def metric_sum(text: str, name: str) -> float | None:
    """The sum of every sample of `name` (all label sets) in Prometheus text, or None when it
    is absent. A counter may be named with or without its `_total` suffix."""
    names = {name, name + "_total"} if not name.endswith("_total") else {name}
    total, found = 0.0, False
    for match in _SAMPLE_RE.finditer(text):
        if match.group(1) in names:
            try:
                value = float(match.group(3))
            except ValueError:
                continue
            if math.isfinite(value):
                total, found = total + value, True
    return total if found else None


@dataclass
class _Progress:
    counter: float | None = None
    moved_at: float = 0.0  # monotonic: the counter last moved, or work began
    busy: bool = False
    running: int = 0
    waiting: int = 0  # the server's own queue, where it says it (vllm:num_requests_waiting)
    kv_cache_usage: float | None = None  # 0..1, where it says it
    iteration: int = 0


class Prober:
    """Probes (and progress checks) of one incarnation of a command engine."""

    def __init__(self, spec: EngineSpec, incarnation: int, port: int, client: ProbeClient,
                 clock: Clock, monitor: LoopMonitor,
                 deliver: Callable[[proto.ChildMessage], object],
                 condemn: Callable[..., None],
                 in_flight: Callable[[], int],
                 asleep: Callable[[], bool] = lambda: False) -> None:
        assert spec.probe is not None
        self.spec, self.incarnation, self.port = spec, incarnation, port
        self.probe = spec.probe
        self.client, self.clock, self.monitor = client, clock, monitor
        self.deliver, self.condemn, self.in_flight = deliver, condemn, in_flight
        self.asleep = asleep  # in vLLM's sleep mode: a canary would find nothing to answer it
        self.failures = 0
        self.ready = False
        self.stopped = False
        self.last_error = ""
        self.progress = _Progress()
        self.quiet_since = clock.monotonic()  # no request in flight since (the canary's clock)
        self.served: str | None = None  # the model the server lists first (the canary's)
        self._canary_task: asyncio.Task[None] | None = None  # one at a time

    async def run(self) -> None:
        """Until `stop` (its incarnation is gone). The flag, not only the task's cancellation:
        Python 3.11's asyncio.wait_for can swallow a cancel that arrives as the wait it guards
        completes, and a prober of a dead incarnation must not probe its old port forever."""
        probe = self.probe
        spawned = self.clock.monotonic()
        while not self.stopped:
            began = self.clock.monotonic()
            try:
                await self.client.get(self.port, probe.path, probe.timeout_s)
            except ProbeFailed as exc:
                if not self.stopped:
                    self._failed(str(exc), began)
            else:
                if self.spec.progress is not None and self.ready and not self.stopped:
                    try:
                        await self._read_progress()
                    except ProbeFailed as exc:  # progress unknown this round: not a hang
                        log.debug("[probe] %s: progress: %s", self.spec.name, exc)
                if not self.stopped:
                    self._passed(spawned)
                if self._canary_due():  # beside the probes, which go on meanwhile
                    self._canary_task = asyncio.get_running_loop().create_task(
                        self._canary(), name=f"canary:{self.spec.name}")
            await self._sleep_until(began + probe.interval_s)

    def stop(self) -> None:
        self.stopped = True
        if self._canary_task is not None:
            self._canary_task.cancel()

    def _canary_due(self) -> bool:
        canary, now = self.spec.canary, self.clock.monotonic()
        if canary is None or not self.ready or self.stopped or not self.spec.openai:
            return False
        if self._canary_task is not None and not self._canary_task.done():
            return False
        # busy: the gateway's requests, or the server's own gauge read before any canary went
        # (a client may talk to the server's port directly, as a benchmark's direct run does)
        if self.in_flight() > 0 or self.progress.busy or self.asleep():
            self.quiet_since = now
            return False
        return now - self.quiet_since >= canary.idle_s

    async def _canary(self) -> None:
        """One token, straight to the server (not through the gateway): no answer within the
        canary's timeout, or no connection, is a hang."""
        canary = self.spec.canary
        assert canary is not None
        began = self.clock.monotonic()
        try:
            if self.served is None:
                listed = json.loads(await self.client.get(self.port, "/v1/models",
                                                          canary.timeout_s, read_body=True))
                self.served = str(listed["data"][0]["id"])
            status = await self.client.post(self.port, "/v1/completions", {
                "model": self.served, "prompt": "ok", "max_tokens": 1, "temperature": 0},
                canary.timeout_s)
        except ProbeFailed as exc:
            if self.stopped or self.in_flight() > 0:
                return  # a client's request came meanwhile: the stall check judges it now
            if self.monitor.pauses.after(began) > 0 or not now_judgeable(self.monitor,
                                                                            self.clock):
                return  # engined itself did not run meanwhile: not the server's fault
            self.condemn(f"no token within {canary.timeout_s:g}s of a canary request while "
                         f"idle ({exc})", Reason.CANARY)
            return
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            log.warning("[canary] %s: /v1/models lists no model (%s): no canary",
                        self.spec.name, exc)
            status = 0
        if status and not 200 <= status < 300:
            log.warning("[canary] %s: its one-token request got HTTP %d", self.spec.name, status)
        self.quiet_since = self.clock.monotonic()

    def _passed(self, spawned: float) -> None:
        self.failures = 0
        now = self.clock.monotonic()
        if not self.ready:
            self.ready = True
            self.progress.moved_at = now
            self.deliver(proto.Ready(engine=self.spec.name, incarnation=self.incarnation,
                                     load_s=now - spawned, device=_device(self.spec),
                                     model=" ".join(self.spec.command)[:200], dtype=""))
        self._beat(now)

    def _failed(self, why: str, began: float) -> None:
        self.last_error = why
        if self.monitor.pauses.after(began) > 0 or not now_judgeable(self.monitor,
                                                                        self.clock):
            return  # engined itself did not run during this probe: not the server's fault
        if not self.ready:
            return  # still loading: startup_timeout is the judge
        self.failures += 1
        log.info("[probe] %s: %s (%d of %d)", self.spec.name, why, self.failures,
                 self.probe.failures)
        if self.failures >= self.probe.failures:
            self.condemn(f"{self.failures} probes failed in a row (last: {why})")

    async def _read_progress(self) -> None:
        progress = self.spec.progress
        assert progress is not None
        text = await self.client.get(self.port, progress.metrics, self.probe.timeout_s,
                                     read_body=True)
        counter = metric_sum(text, progress.counter)
        busy_gauge = metric_sum(text, progress.busy)
        state, now = self.progress, self.clock.monotonic()
        running = max(int(busy_gauge or 0), self.in_flight())
        waiting = int(metric_sum(text, WAITING) or 0)
        busy = running > 0 or waiting > 0  # either is work the stall check watches
        if counter is not None and counter != state.counter:
            state.counter, state.moved_at = counter, now
            state.iteration += 1
        elif busy and not state.busy:
            state.moved_at = now  # work just began: the stall clock starts now
        state.busy, state.running, state.waiting = busy, running, waiting
        usage = next((u for name in KV_CACHE_USAGE if (u := metric_sum(text, name)) is not None),
                     None)
        state.kv_cache_usage = min(1.0, max(0.0, usage)) if usage is not None else None

    def _beat(self, now: float) -> None:
        state = self.progress
        self.deliver(proto.Heartbeat(
            engine=self.spec.name, incarnation=self.incarnation, iteration=state.iteration,
            last_iteration_at=state.moved_at if self.spec.progress is not None else now,
            waiting=state.waiting, running=state.running if self.spec.progress is not None else 0,
            tokens=int(state.counter or 0), kv_cache_usage=state.kv_cache_usage))

    async def _sleep_until(self, when: float) -> None:
        delay = when - self.clock.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


def now_judgeable(monitor: LoopMonitor, clock: Clock) -> bool:
    """Right after a pause of engined, what queued meanwhile is read before anything is judged."""
    return clock.monotonic() >= monitor.judge_after


def _device(spec: EngineSpec) -> str:
    return ",".join(f"cuda:{g}" for g in spec.gpus) if spec.gpus else "cpu"
