"""The daemon's side of the engine channels (ZeroMQ, bound here so children never race for ports).

* control: PULL, receives Hello/Progress/Heartbeat/Goodbye from every child.
* requests: ROUTER. A child's Ready arrives here, so an engine is READY exactly when it is
  routable; GenerateRequest goes to one child by routing identity and the matching future
  resolves when its GenerateResult comes back.

Malformed frames, unknown engines and stale incarnations are dropped, counted by kind and logged
(rate-limited); they never change engine state.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from engined.engine import protocol as proto
from engined.engine.contract import control_endpoint, request_endpoint, routing_id

log = logging.getLogger("engined.ipc")

_LOG_EVERY_S = 5.0
_WAKE = proto.encode(proto.Wake())


class RequestFailed(Exception):
    """A generate request could not be served (engine gone or unreachable, or it reported an
    error)."""


class RequestTimeout(RequestFailed):
    """The engine did not answer in time."""


class EngineChannels:
    def __init__(self, runtime_dir: str,
                 on_message: Callable[[proto.ChildMessage], str | None]) -> None:
        self.control_endpoint = control_endpoint(runtime_dir)
        self.request_endpoint = request_endpoint(runtime_dir)
        self.on_message = on_message  # returns None if applied, else a drop reason
        self.ctx = zmq.asyncio.Context()
        # The control channel carries every heartbeat: a plain socket drained from a reader
        # callback costs far less per message than an awaited zmq.asyncio recv.
        self._sync_ctx = zmq.Context()
        self.control = self._bind(zmq.PULL, self.control_endpoint, self._sync_ctx)
        self.requests = self._bind(zmq.ROUTER, self.request_endpoint)
        self.requests.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer: an error, not a drop
        self.dropped: collections.Counter[str] = collections.Counter()
        self._pending: dict[str, tuple[str, int, asyncio.Future[proto.GenerateResult]]] = {}
        self._last_log = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        self._control_fd = -1

    def _bind(self, kind: int, endpoint: str, ctx: zmq.Context | None = None) -> zmq.Socket:
        sock = (ctx or self.ctx).socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        # Bound frames: a hostile or corrupt sender cannot make us allocate without limit.
        sock.setsockopt(zmq.MAXMSGSIZE, proto.MAX_FRAME_BYTES)
        sock.bind(endpoint)
        return sock

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._control_fd = int(self.control.getsockopt(zmq.FD))
        loop.add_reader(self._control_fd, self._drain_control)
        self._tasks = [loop.create_task(self._read_results(), name="ipc:requests")]
        loop.call_soon(self._drain_control)  # the FD is edge-triggered: catch early arrivals

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for _, _, future in self._pending.values():
            if not future.done():
                future.set_exception(RequestFailed("engined is shutting down"))
        asyncio.get_running_loop().remove_reader(self._control_fd)
        self.control.close(linger=0)
        self.requests.close(linger=0)
        self.ctx.term()
        self._sync_ctx.term()

    # --- control channel ---------------------------------------------------------------------
    def _drain_control(self) -> None:
        """Read every queued control message (ZeroMQ's FD signals edges, so drain fully)."""
        while int(self.control.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                frames = self.control.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_control_frames(frames)

    def _on_control_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self._drop("malformed", f"{len(frames)}-part control message")
            return
        try:
            msg = proto.decode_control(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._drop("malformed", str(exc))
            return
        self._apply(msg)

    def _apply(self, msg: proto.ChildMessage) -> None:
        reason = self.on_message(msg)
        if reason is not None:
            self._drop(reason, f"{type(msg).__name__} for {msg.engine!r} "
                               f"incarnation {msg.incarnation}")

    def _drop(self, kind: str, detail: str) -> None:
        self.dropped[kind] += 1
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            log.warning("[ipc] dropped %s message: %s (dropped so far: %s)", kind, detail[:200],
                        dict(self.dropped))

    # --- request channel ---------------------------------------------------------------------
    async def _read_results(self) -> None:
        while True:
            frames: list[bytes] = await self.requests.recv_multipart()  # type: ignore[misc]
            if len(frames) != 2:
                self._drop("malformed", f"{len(frames)}-part request-channel message")
                continue
            identity, frame = frames
            try:
                msg = proto.decode_request(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._drop("malformed", str(exc))
                continue
            self._resolve(identity, msg)

    def _resolve(self, identity: bytes, msg: proto.RequestMessage) -> None:
        if isinstance(msg, proto.Ready):
            if identity != routing_id(msg.engine, msg.incarnation):
                self._drop("forged", f"Ready for {msg.engine!r} from {identity!r}")
                return
            self._apply(msg)
            return
        if not isinstance(msg, proto.GenerateResult):
            self._drop("unexpected", f"{type(msg).__name__} from {identity!r}")
            return
        entry = self._pending.get(msg.id)
        if entry is None or identity != routing_id(entry[0], entry[1]):
            self._drop("stale", f"result {msg.id!r} from {identity!r}")
            return
        future = entry[2]
        if not future.done():
            future.set_result(msg)

    async def generate(self, engine: str, incarnation: int, prompt: str, max_tokens: int,
                       timeout_s: float) -> proto.GenerateResult:
        request = proto.GenerateRequest(uuid.uuid4().hex, prompt, max_tokens)
        future: asyncio.Future[proto.GenerateResult] = asyncio.get_running_loop().create_future()
        self._pending[request.id] = (engine, incarnation, future)
        try:
            self._send(routing_id(engine, incarnation), proto.encode(request))
            result = await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"{engine} did not answer within {timeout_s:g}s") from None
        finally:
            self._pending.pop(request.id, None)
        if result.error is not None:
            raise RequestFailed(f"{engine}: {result.error}")
        return result

    def _send(self, identity: bytes, frame: bytes) -> None:
        # A READY engine is routable (its READY came through this socket); an unreachable one
        # has just gone away, and its exit fails the request anyway.
        try:
            self.requests.send_multipart([identity, frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise RequestFailed(f"cannot send to {identity.decode()}: {exc.strerror}") from None

    def wake(self, engine: str, incarnation: int) -> None:
        """Best effort: end a data-parallel rank's idle poll so it joins its peers' next step."""
        try:
            self.requests.send_multipart([routing_id(engine, incarnation), _WAKE],
                                         flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # not routable (yet): it joins at the end of its idle poll

    def fail_engine(self, engine: str, incarnation: int, reason: str) -> None:
        """The engine's incarnation is gone: fail its in-flight requests now, not at timeout."""
        for name, inc, future in list(self._pending.values()):
            if name == engine and inc == incarnation and not future.done():
                future.set_exception(RequestFailed(f"{engine} {reason}"))

    def in_flight(self, engine: str) -> int:
        return sum(1 for name, _, _ in self._pending.values() if name == engine)

