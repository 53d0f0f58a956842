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
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable

import msgspec
import zmq

from engined.engine import protocol as proto
from engined.engine.contract import control_endpoint, request_endpoint, routing_id
from engined.supervisor.lifecycle.notices import Lost

log = logging.getLogger("engined.ipc")

_LOG_EVERY_S = 5.0
_WAKE = proto.encode(proto.Wake())
_ID_PREFIX = os.urandom(6).hex()  # this daemon's run: ids never repeat across restarts
_ID_COUNTER = itertools.count(1)


def new_request_id() -> str:
    """A request id unique to this daemon's lifetime and beyond (a random prefix per run, then
    a counter): as unique as a uuid4 for routing results back, without a syscall per request."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):x}"


class RequestFailed(Exception):
    """A generate request could not be served (engine gone or unreachable, or it reported an
    error)."""


class RequestTooLarge(ValueError):
    """The request does not fit in one frame the engine accepts (proto.MAX_FRAME_BYTES): the
    client's error, sent nowhere (the engine would drop it, and the client wait in vain)."""


class RequestTimeout(RequestFailed):
    """The engine did not answer in time."""


class EngineChannels:
    def __init__(self, runtime_dir: str,
                 on_message: Callable[[proto.ChildMessage], str | None]) -> None:
        self.control_endpoint = control_endpoint(runtime_dir)
        self.request_endpoint = request_endpoint(runtime_dir)
        self.on_message = on_message  # returns None if applied, else a drop reason
        # Both channels are plain sockets drained from reader callbacks: that costs far less per
        # message than an awaited zmq.asyncio recv (the control channel carries every heartbeat,
        # the request channel every token chunk).
        self._sync_ctx = zmq.Context()
        self.control = self._bind(zmq.PULL, self.control_endpoint)
        self.requests = self._bind(zmq.ROUTER, self.request_endpoint)
        self.requests.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer: an error, not a drop
        self.dropped: collections.Counter[str] = collections.Counter()
        self._streams: dict[str, RequestStream] = {}
        self._last_log = 0.0
        self._control_fd = -1
        self._requests_fd = -1
        self._drain_due = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def _bind(self, kind: int, endpoint: str) -> zmq.Socket:
        sock = self._sync_ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        # Bound frames: a hostile or corrupt sender cannot make us allocate without limit.
        sock.setsockopt(zmq.MAXMSGSIZE, proto.MAX_FRAME_BYTES)
        sock.bind(endpoint)
        return sock

    def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._control_fd = int(self.control.getsockopt(zmq.FD))
        loop.add_reader(self._control_fd, self._drain_control)
        self._requests_fd = int(self.requests.getsockopt(zmq.FD))
        loop.add_reader(self._requests_fd, self._drain_requests)
        loop.call_soon(self._drain_control)  # the FD is edge-triggered: catch early arrivals
        loop.call_soon(self._drain_requests)

    def close_now(self) -> None:
        """An upgrade's exec: the sockets closed, so the engines see their peer go and connect
        again to the new code's (ZeroMQ reconnects by itself)."""
        loop = self._loop
        if loop is not None:
            loop.remove_reader(self._control_fd)
            if self._requests_fd >= 0:
                loop.remove_reader(self._requests_fd)
                self._requests_fd = -1
        self.control.close(linger=0)
        self.requests.close(linger=0)
        self._sync_ctx.term()

    async def close(self) -> None:
        for stream in list(self._streams.values()):
            stream.fail(RequestFailed("engined is shutting down"))
        self.close_now()

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
    def _drain_requests(self) -> None:
        """Read every queued request-channel message. The FD signals edges, and a send on the
        same socket may consume one: every send schedules a drain too (`_kick`)."""
        self._drain_due = False
        if self._requests_fd < 0:
            return
        while int(self.requests.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                frames = self.requests.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
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

    def _kick(self) -> None:
        if not self._drain_due and self._loop is not None:
            self._drain_due = True
            self._loop.call_soon(self._drain_requests)

    def _resolve(self, identity: bytes, msg: proto.RequestMessage) -> None:
        if isinstance(msg, proto.Ready):
            if identity != routing_id(msg.engine, msg.incarnation):
                self._drop("forged", f"Ready for {msg.engine!r} from {identity!r}")
                return
            self._apply(msg)
            return
        if isinstance(msg, proto.Results):
            if not msg.items:
                self._drop("malformed", f"empty Results from {identity!r}")
            for item in msg.items:
                self._deliver(identity, item)
            return
        if not isinstance(msg, (proto.GenerateResult, proto.TokenChunk)):
            self._drop("unexpected", f"{type(msg).__name__} from {identity!r}")
            return
        self._deliver(identity, msg)

    def _deliver(self, identity: bytes, msg: proto.GenerateResult | proto.TokenChunk) -> None:
        stream = self._streams.get(msg.id)
        if stream is None or identity != routing_id(stream.engine, stream.incarnation):
            self._drop("stale", f"{type(msg).__name__} {msg.id!r} from {identity!r}")
            return
        stream.put(msg)

    # --- requests ----------------------------------------------------------------------------
    def open(self, address: tuple[str, int], request: proto.GenerateRequest,
             wake: Iterable[tuple[str, int]] = ()) -> RequestStream:
        """Send `request` to one incarnation; its chunks and result arrive on the stream.
        `wake`: data-parallel peers that must join its step. Raises RequestFailed if it cannot
        be sent."""
        for peer in wake:
            self.wake(*peer)
        engine, incarnation = address
        frame = proto.encode(request)
        if len(frame) > proto.MAX_FRAME_BYTES:
            raise RequestTooLarge(f"the request is {len(frame)} bytes for the engine, more than "
                                  f"it takes ({proto.MAX_FRAME_BYTES}): send a shorter prompt")
        stream = RequestStream(self, engine, incarnation, request.id)
        self._send(routing_id(engine, incarnation), frame)
        self._streams[request.id] = stream
        return stream

    def _close(self, stream: RequestStream) -> None:
        if self._streams.get(stream.id) is stream:
            del self._streams[stream.id]
            if not stream.finished:  # the client went away: the engine stops generating it
                self.abort(stream.engine, stream.incarnation, stream.id)

    def abort(self, engine: str, incarnation: int, request_id: str) -> None:
        try:
            self._send(routing_id(engine, incarnation), proto.encode(proto.Abort(request_id)))
        except RequestFailed:
            pass  # gone: nothing to abort

    def _send(self, identity: bytes, frame: bytes) -> None:
        # A READY engine is routable (its READY came through this socket); an unreachable one
        # has just gone away, and its exit fails the request anyway.
        try:
            self.requests.send_multipart([identity, frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise RequestFailed(f"cannot send to {identity.decode()}: {exc.strerror}") from None
        finally:
            self._kick()

    def reachable(self, address: tuple[str, int]) -> bool:
        """Whether an engine child is connected to the request channel now (a Wake, which an
        engine takes as nothing but the end of an idle poll, can be sent to it)."""
        try:
            self.requests.send_multipart([routing_id(*address), _WAKE], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        finally:
            self._kick()
        return True

    def wake(self, engine: str, incarnation: int) -> None:
        """Best effort: end a data-parallel rank's idle poll so it joins its peers' next step."""
        try:
            self.requests.send_multipart([routing_id(engine, incarnation), _WAKE],
                                         flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # not routable (yet): it joins at the end of its idle poll
        self._kick()

    def on_lost(self, lost: Lost) -> None:
        """An incarnation is gone: fail its in-flight requests now, not at their timeout."""
        engine, incarnation = lost.address
        for stream in list(self._streams.values()):
            if stream.engine == engine and stream.incarnation == incarnation:
                stream.fail(EngineLost(f"{engine} {lost.why}", engine, lost.why))


class EngineLost(RequestFailed):
    """The incarnation serving a request exited, hung or stalled, or was stopped."""

    def __init__(self, message: str, engine: str, why: str) -> None:
        super().__init__(message)
        self.engine, self.why = engine, why


class RequestStream:
    """One request's events, in order: TokenChunks, then its GenerateResult; an engine that goes
    away ends it with EngineLost. One reader iterates it, or calls `next(timeout_s)`; `close()`
    when done (aborts it if unfinished).

    The daemon waits on thousands of these: a wait is one future and, with a timeout, one timer
    handle (asyncio.wait_for would add a task per wait: per request, and per streamed chunk),
    and an item that is already here is returned without waiting at all.
    """

    def __init__(self, channels: EngineChannels, engine: str, incarnation: int,
                 request_id: str) -> None:
        self.channels = channels
        self.engine, self.incarnation, self.id = engine, incarnation, request_id
        self._items: collections.deque[proto.TokenChunk | proto.GenerateResult | RequestFailed] \
            = collections.deque()
        self._waiter: asyncio.Future[bool] | None = None
        self.finished = False

    def _push(self, item: proto.TokenChunk | proto.GenerateResult | RequestFailed) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    def put(self, msg: proto.TokenChunk | proto.GenerateResult) -> None:
        if self.finished:
            return
        if isinstance(msg, proto.GenerateResult):
            self.finished = True
        self._push(msg)

    def fail(self, error: RequestFailed) -> None:
        if not self.finished:
            self.finished = True
            self._push(error)

    async def next(self, timeout_s: float | None = None
                   ) -> proto.TokenChunk | proto.GenerateResult:
        """The next item. StopAsyncIteration after the result; the RequestFailed that ended the
        stream; asyncio.TimeoutError if nothing came within `timeout_s`."""
        if not self._items:
            if self.finished:
                raise StopAsyncIteration
            await self._wait(timeout_s)
        item = self._items.popleft()
        if isinstance(item, RequestFailed):
            raise item
        return item

    async def _wait(self, timeout_s: float | None) -> None:
        if self._waiter is not None:  # a second reader would steal the first one's wake-up
            raise RuntimeError(f"request {self.id} already has a reader waiting")
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = (loop.call_later(max(timeout_s, 0.0), _expire, waiter)
                 if timeout_s is not None else None)
        try:
            arrived = await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        if not arrived and not self._items:
            raise asyncio.TimeoutError

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> proto.TokenChunk | proto.GenerateResult:
        return await self.next()

    async def result(self, timeout_s: float | None = None) -> proto.GenerateResult:
        """Its GenerateResult (chunks, if any, are skipped); asyncio.TimeoutError past
        `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            try:
                item = await self.next(None if deadline is None else deadline - loop.time())
            except StopAsyncIteration:
                raise RequestFailed(f"{self.engine} sent no result for {self.id}") from None
            if isinstance(item, proto.GenerateResult):
                return item

    def close(self) -> None:
        self.channels._close(self)


async def result_of(stream: RequestStream, timeout_s: float) -> proto.GenerateResult | None:
    """A task's one answer (None: something else came); the stream is closed after it."""
    try:
        item = await stream.next(timeout_s)
    finally:
        stream.close()
    return item if isinstance(item, proto.GenerateResult) else None


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)
