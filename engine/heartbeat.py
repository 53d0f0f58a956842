"""The heartbeat thread: the busy loop's progress, queue depths and memory, every
`heartbeat_interval_s`, from a socket of its own.

A thread, so that a long model step does not miss heartbeats; it reports the loop's stamp, so a
stuck loop still shows as stalled. A GIL-holding hang or SIGSTOP silences it (a hang).

It is started before the engine applies memory_limit (engine.memory), so that its stack (8 MiB)
and its malloc arena are part of the address space the limit starts from, not taken from the
headroom the limit leaves; it beats only once READY is out (`begin`): heartbeats come only past
READY.
"""

from __future__ import annotations

import sys
import threading
from typing import Protocol

import zmq

from engined.engine import memory
from engined.engine import protocol as proto
from engined.engine.backend import Backend
from engined.engine.requests import RequestTable

_JOIN_TIMEOUT_S = 2.0


class Beating(Protocol):
    """What a heartbeat reports of the engine core (engine.core.EngineCoreProc)."""

    config: proto.EngineConfig
    model: Backend | None
    table: RequestTable | None
    iteration: int  # busy-loop iterations so far
    last_iteration_at: float  # the loop's progress stamp (time.monotonic)
    in_collective: bool


def heartbeat(core: Beating) -> proto.Heartbeat:
    cfg, model, table = core.config, core.model, core.table
    load = model.load() if model is not None else None
    device = model.device if model is not None else "cpu"
    return proto.Heartbeat(
        engine=cfg.name, incarnation=cfg.incarnation, iteration=core.iteration,
        last_iteration_at=core.last_iteration_at,
        waiting=load.waiting if load else 0, running=load.running if load else 0,
        requests_ok=table.ok if table else 0, requests_failed=table.failed if table else 0,
        gpu_memory=model.gpu_memory() if model is not None else [],
        in_collective=core.in_collective, tokens=table.tokens if table else 0,
        kv_cache_usage=load.kv_cache_usage if load else None,
        batch_limit=load.batch_limit if load else None,
        oom_total=load.oom_total if load else 0,
        memory_headroom=memory.headroom(cfg.memory_limit, device, sys.modules.get("torch")))


class HeartbeatThread(threading.Thread):
    def __init__(self, core: Beating, sock: zmq.Socket) -> None:
        super().__init__(name="engined-heartbeat", daemon=True)
        self.core = core
        self.sock = sock
        self._stopped = threading.Event()
        self._begun = threading.Event()
        self._warned = False

    def begin(self) -> None:
        """Beat from now on (the thread was started earlier, before memory_limit)."""
        self._begun.set()

    def run(self) -> None:
        interval_s = self.core.config.heartbeat_interval_s
        self._begun.wait()
        while not self._stopped.is_set():
            self._beat()
            if self._stopped.wait(interval_s):
                break
        self.sock.close(linger=0)

    def _beat(self) -> None:
        try:
            beat = heartbeat(self.core)
        except Exception as exc:  # noqa: BLE001 - a dead heartbeat thread would read as a hang
            if not self._warned:
                self._warned = True
                print(f"[heartbeat] {self.core.config.name}: cannot build a heartbeat: "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return
        try:
            self.sock.send(proto.encode(beat), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def stop(self) -> None:
        self._stopped.set()
        self._begun.set()
        self.join(timeout=_JOIN_TIMEOUT_S)
