"""vLLM's sleep mode for engines on demand with `sleep_mode: level1` or `level2`.

A replica of such a group sleeps in place (supervisor.lifecycle.worker carries it out, this says
how): it is routed nothing more, its requests in flight finish (bounded by its stop_timeout: one
still running then is left to a stop), then the engine sleeps at its level and keeps its process
(level 1: the weights go to host memory and the KV cache is dropped; level 2: both are dropped).
A wake asks it back, much faster than a start: the process, its CUDA context and its compiled
graphs are there. An engine child gets the `sleep` and `wake_up` tasks over its channel; a
`vllm serve` command engine gets `POST /sleep?level=N` and `POST /wake_up` on its port, which
vLLM serves with VLLM_SERVER_DEV_MODE=1 (engined sets it for these engines) and
`--enable-sleep-mode` (their command says it: `--check` requires it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from engined.engine import protocol as proto
from engined.supervisor.gateway.upstream import Upstream
from engined.supervisor.ipc import EngineChannels, RequestFailed, new_request_id, result_of
from engined.supervisor.lifecycle.clock import Clock
from engined.supervisor.lifecycle.incarnation import Incarnation
from engined.supervisor.spec.model import EngineSpec

DRAIN_STEP_S = 0.05  # how often a sleep looks whether its requests in flight have finished
WAKE_TASK_TIMEOUT_S = 300.0  # a wake reads the weights back (level 2: from disk)


class SleepMode:
    def __init__(self, channels: EngineChannels, upstream: Upstream, clock: Clock,
                 in_flight: Callable[[Incarnation], int]) -> None:
        self.channels, self.upstream, self.clock = channels, upstream, clock
        self.in_flight = in_flight  # requests the gateway routed to an incarnation, now

    async def sleep(self, spec: EngineSpec, inc: Incarnation) -> str | None:
        deadline = self.clock.monotonic() + spec.stop_timeout_s
        while (left := self.in_flight(inc)) > 0:
            if self.clock.monotonic() >= deadline:
                return (f"{left} requests still in flight after its stop_timeout "
                        f"({spec.stop_timeout_s:g}s)")
            await asyncio.sleep(DRAIN_STEP_S)
        return await self._ask(spec, inc, proto.TASK_SLEEP, spec.stop_timeout_s)

    async def wake(self, spec: EngineSpec, inc: Incarnation) -> str | None:
        return await self._ask(spec, inc, proto.TASK_WAKE_UP, WAKE_TASK_TIMEOUT_S)

    async def _ask(self, spec: EngineSpec, inc: Incarnation, task: str,
                   timeout_s: float) -> str | None:
        try:
            if spec.is_command:
                return await self._over_http(inc, task, spec.sleep_level, timeout_s)
            return await self._over_channel(inc, task, spec.sleep_level, timeout_s)
        except (RequestFailed, asyncio.TimeoutError, OSError, ValueError) as exc:
            return f"{task}: {exc or type(exc).__name__}"

    async def _over_channel(self, inc: Incarnation, task: str, level: int,
                            timeout_s: float) -> str | None:
        stream = self.channels.open(inc.address, proto.GenerateRequest(
            new_request_id(), task=task, sleep_level=level))
        item = await result_of(stream, timeout_s)
        if item is None:
            return f"{task}: an unexpected answer"
        return None if item.error is None else f"{task}: {item.error}"

    async def _over_http(self, inc: Incarnation, task: str, level: int,
                         timeout_s: float) -> str | None:
        path = f"/sleep?level={level}" if task == proto.TASK_SLEEP else "/wake_up"
        status, _, text = await asyncio.wait_for(
            self.upstream.fetch(("127.0.0.1", inc.port or 0), "POST", path, b""), timeout_s)
        if status == 200:
            return None
        return f"POST {path}: HTTP {status}: {text.decode(errors='replace')[:300]}"
