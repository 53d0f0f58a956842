"""The child's side of its two ZeroMQ channels to the daemon (engine.protocol): control, a PUSH
for Hello / Progress / Goodbye (the heartbeat thread has a PUSH of its own), and requests, a
DEALER with the routing identity ``name:incarnation`` that READY and every result go out on.

Sends never block: a daemon that is gone or not reading costs a message, never the engine's
loop. The sockets reconnect within milliseconds, as engined re-binds them when it upgrades in
place.
"""

from __future__ import annotations

import sys
from typing import Iterator

import msgspec
import zmq

from engined.engine import contract
from engined.engine import protocol as proto

LINGER_MS = 500  # bounded linger: a dead daemon must not block our exit
_SEND_TIMEOUT_MS = 1000
_SEND_HWM = 10_000
_HEARTBEAT_HWM = 4  # a stale heartbeat is worthless: do not queue many
_RECONNECT_MS = 10  # a lost connection to engined is tried again after this (ZeroMQ: 100),
_RECONNECT_MAX_MS = 500  # then doubling up to this

Reply = proto.TokenChunk | proto.GenerateResult


class Channels:
    def __init__(self, config: proto.EngineConfig) -> None:
        self.config = config
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.control = self._connect(zmq.PUSH, config.control_endpoint)
        self.requests = self._connect(zmq.DEALER, config.request_endpoint, identity=True)
        self._outbox: list[Reply] = []

    def _connect(self, kind: int, endpoint: str, identity: bool = False) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        _reconnect_fast(sock)
        if identity:
            sock.setsockopt(zmq.IDENTITY,
                            contract.routing_id(self.config.name, self.config.incarnation))
        sock.connect(endpoint)
        return sock

    def heartbeat_socket(self) -> zmq.Socket:
        """The heartbeat thread's own PUSH to the control channel (it closes it itself)."""
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _HEARTBEAT_HWM)
        _reconnect_fast(sock)
        sock.connect(self.config.control_endpoint)
        return sock

    # --- control -----------------------------------------------------------------------------
    def send(self, message: msgspec.Struct) -> None:
        try:
            self.control.send(proto.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the daemon is not reading (gone or overloaded); heartbeats are best effort

    # --- requests ----------------------------------------------------------------------------
    def receive(self) -> Iterator[proto.RequestMessage]:
        """What arrived, without waiting; a malformed frame is logged and dropped."""
        while True:
            try:
                frame = self.requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                yield proto.decode_request(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                print(f"[ipc] {self.config.name} dropped malformed request frame: {exc}",
                      file=sys.stderr, flush=True)

    def reply(self, message: Reply) -> None:
        """Queued: what one step produced goes out together (`flush`)."""
        self._outbox.append(message)

    def flush(self) -> None:
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        self.send_now(items[0] if len(items) == 1 else proto.Results(items))

    def send_now(self, message: msgspec.Struct) -> None:
        try:
            self.requests.send(proto.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the daemon is gone or not reading; it fails the request itself

    def close(self) -> None:
        self.control.close(linger=LINGER_MS)
        self.requests.close(linger=0)
        self.ctx.term()


def _reconnect_fast(sock: zmq.Socket) -> None:
    """engined re-binds its sockets when it upgrades in place: be back within milliseconds."""
    sock.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_MAX_MS)
