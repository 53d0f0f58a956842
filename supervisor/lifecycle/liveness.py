"""How one incarnation is judged alive: chosen at spawn, by what the engine is.

* `HeartbeatLiveness`: engined's own engine child says HELLO, READY and heartbeats its busy loop
  (progress and queue depths) every heartbeat_interval; hung = no heartbeat for
  heartbeat_timeout, stalled = no loop progress for stall_timeout while work is queued.
* `ProbeLiveness`: a server engined did not write (`command:`) says nothing; its probes speak for
  it (supervisor.probe.Prober): the first passing probe is its READY, every pass a heartbeat,
  `failures` failures in a row a verdict; a progress check turns "requests in flight and the
  generation counter not moving" into the same stall. Without a probe it is READY once started
  (systemd's Type=simple).

Each strategy owns what differs between the two, so the lifecycle code (supervisor.replica) asks
and never branches on the kind (their interface, `LivenessStrategy`, is the incarnation's:
supervisor.lifecycle.incarnation): the heartbeat timeout, when routing stops trusting a replica's
last sign of life (`stale_after_s`), an external verdict, and how a kill is worded in the log.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from engined.engine import protocol as proto
from engined.supervisor.lifecycle.clock import Clock
from engined.supervisor.lifecycle.incarnation import Deliver, Kind
from engined.supervisor.lifecycle.loopmonitor import LoopMonitor
from engined.supervisor.lifecycle.probe import ProbeClient, Prober
from engined.supervisor.lifecycle.state import Reason
from engined.supervisor.spec.model import EngineSpec


class HeartbeatLiveness:
    kind = Kind.ENGINE
    verdict: str | None = None
    verdict_reason = Reason.HANG

    def __init__(self, heartbeat_interval_s: float, heartbeat_timeout_s: float) -> None:
        self._interval_s, self._timeout_s = heartbeat_interval_s, heartbeat_timeout_s

    @property
    def heartbeat_timeout_s(self) -> float:
        return self._timeout_s

    @property
    def stale_after_s(self) -> float:
        return 2.0 * self._interval_s

    def begin(self, address: tuple[str, int], port: int | None, deliver: Deliver,
              wake: Callable[[], None]) -> None:
        pass  # the child reports by itself

    def end(self) -> None:
        pass

    def missing(self, reason: Reason, cleaning_up: bool) -> str:
        return _missing(reason, cleaning_up, stall="loop progress")


class ProbeLiveness:
    kind = Kind.COMMAND

    def __init__(self, spec: EngineSpec, client: ProbeClient, clock: Clock,
                 monitor: LoopMonitor, in_flight: Callable[[], int],
                 asleep: Callable[[], bool] = lambda: False) -> None:
        self.spec, self.client, self.clock, self.monitor = spec, client, clock, monitor
        self.in_flight = in_flight  # requests routed to this incarnation now
        self.asleep = asleep  # in vLLM's sleep mode now: no canary (it would wake nothing)
        self.verdict: str | None = None
        self.verdict_reason = Reason.HANG
        self._prober: Prober | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def heartbeat_timeout_s(self) -> float:
        """Its heartbeats are its passing probes, and its probes judge a hang (`failures` in a
        row): this is only the backstop, well after they would have."""
        probe = self.spec.probe
        if probe is None:
            return math.inf
        return (probe.failures + 2) * max(probe.interval_s, probe.timeout_s) + probe.timeout_s

    @property
    def stale_after_s(self) -> float:
        probe = self.spec.probe
        return math.inf if probe is None else 2.0 * probe.interval_s + probe.timeout_s

    def begin(self, address: tuple[str, int], port: int | None, deliver: Deliver,
              wake: Callable[[], None]) -> None:
        name, number = address
        if self.spec.probe is None or port is None:
            deliver(proto.Ready(name, number, 0.0, "", self.spec.model.source, ""))
            return

        def condemn(why: str, reason: Reason = Reason.HANG) -> None:
            if self.verdict is None:
                self.verdict, self.verdict_reason = why, reason
                wake()

        self._prober = Prober(self.spec, number, port, self.client, self.clock, self.monitor,
                              deliver, condemn, self.in_flight, self.asleep)
        self._task = asyncio.get_running_loop().create_task(self._prober.run(),
                                                            name=f"probe:{name}")

    def end(self) -> None:
        if self._prober is not None:
            self._prober.stop()  # in case the cancel below is swallowed (see Prober.run)
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def missing(self, reason: Reason, cleaning_up: bool) -> str:
        if self.verdict is not None:
            what = "answer to its canary" if self.verdict_reason is Reason.CANARY else \
                "passing probe"
            return f"{what}: {self.verdict}"
        return _missing(reason, cleaning_up,
                        stall="generation progress with requests in flight")


def _missing(reason: Reason, cleaning_up: bool, stall: str) -> str:
    if reason is Reason.STALL:
        return stall
    if reason is Reason.STARTUP_TIMEOUT:
        return "READY in time"
    if cleaning_up:
        return "exit within stop_timeout of its cleanup"
    return "heartbeat"
