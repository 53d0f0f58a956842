"""aiohttp server settings shared by the daemon's HTTP servers (the control socket, the metrics
endpoint and the gateway): client deadlines, a connection cap that sheds, and client errors
logged without noise.

A client (or anyone who can reach the gateway) must not be able to pin the daemon's resources,
nor keep other clients out (ClientLimits, the spec's `supervisor.clients`):

* a connection must complete a request's headers within `header_timeout` of being accepted or
  answered (aiohttp's keep-alive timer: slow headers and idle keep-alive connections alike);
* a request's body must arrive within `body_timeout` plus its length at `body_min_rate`
  (`read_body`: 408);
* a client that reads nothing of its answer for `write_timeout` (the transport stays paused:
  a stream nobody reads) is cut off, which cancels its handler and aborts its request in the
  engine;
* at the connection cap, or when the daemon's fd reserve says no, a new connection is not
  refused while another can make room: the one idle the longest (waiting for a request's
  headers) is closed, else the one receiving a body the longest; only when every connection
  is serving a request is the new one closed. An optional cap per client address.

Every connection is an fd, and a daemon out of fds cannot spawn engines, and libzmq aborts the
whole process when its ipc listener cannot accept an engine's connection (EMFILE is not among
the errors it tolerates). Each act is counted (`stats`, in /metrics).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import os
import socket
import sys
import time
from typing import Any, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_server import Server

from engined.supervisor.spec.model import ClientLimits

log = logging.getLogger("engined.http")

# A client must deliver a request's headers, and then its body, within this (the defaults of
# ClientLimits; the control socket's); a slow or stalled client is cut off (408 or a closed
# connection) instead of holding a connection and an fd forever.
CLIENT_TIMEOUT_S = 10.0
WATCH_EVERY_S = 1.0  # how often paused writers (clients that stopped reading) are checked
# A request whose answer is an endless stream (`logs -f`, `events -f`): an upgrade does not wait
# for it to end (it is cut; the follower reconnects).
LONG_LIVED = "engined.long_lived"
# After answering a request whose body was not read (413, 408), read the rest only this long
# before closing: long enough for a local client to see the answer.
_LINGER_S = 2.0
_CLIENT_ERROR_LOG_EVERY_S = 5.0


CONTROL_LIMITS = ClientLimits(header_timeout_s=CLIENT_TIMEOUT_S, body_timeout_s=CLIENT_TIMEOUT_S)
RUNNER = web.AppKey("engined.runner", object)  # the app's runner, for read_body


def make_runner(app: web.Application, max_connections: int,
                may_accept: Callable[[], bool] = lambda: True,
                limits: ClientLimits = CONTROL_LIMITS,
                stats: collections.Counter[str] | None = None) -> CappedRunner:
    """An AppRunner with the deadlines, the connection cap (and `may_accept`: the daemon's
    file-descriptor reserve) and the quiet client-error log."""
    # keepalive_timeout also bounds the wait for a first complete request (aiohttp arms it at
    # accept): a client that sends half a request line is closed when it expires.
    # handler_cancellation: a client that goes away cancels its handler, so a request it was
    # waiting for is aborted (and a `logs -f` follower unregistered) at once.
    runner = CappedRunner(app, max_connections, may_accept, limits, stats,
                          handle_signals=False, access_log=None, handler_cancellation=True,
                          keepalive_timeout=limits.header_timeout_s, lingering_time=_LINGER_S,
                          logger=ServerLog(logging.getLogger("engined.http")))
    app[RUNNER] = runner
    return runner


class ApiKey:
    """The bearer token clients must send, read from a file (None: no token required, unless
    `required`: then nobody is let in without one; the control API on TCP)."""

    def __init__(self, path: str | None, what: str = "api_key_file",
                 required: bool = False) -> None:
        self.path, self.what, self.required = path, what, required
        self.token: str | None = None
        self.reload(path)

    def reload(self, path: str | None) -> None:
        """Re-read (at start and on every reload); a file that cannot be read keeps the old
        token (the reload itself reports the problem)."""
        self.path = path
        if path is None:
            self.token = None
            return
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read(4096).strip()
        except (OSError, UnicodeDecodeError) as exc:
            log.error("[http] cannot read %s %s: %s (keeping the old token)", self.what,
                      path, exc)
            return
        if token:
            self.token = token

    def headers(self) -> dict[str, str]:
        """What a client sends to be let in by a server with this token."""
        return {"Authorization": f"Bearer {self.token}"} if self.token is not None else {}

    def allows(self, header: str | None) -> bool:
        if self.token is None:
            return not self.required
        scheme, _, given = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                                  self.token.encode())


class BodyTimeout(Exception):
    """A request's body did not arrive in time (ClientLimits.body_timeout_s)."""


async def read_body(request: web.BaseRequest) -> bytes:
    """The request's body, within its deadline: body_timeout plus its length at body_min_rate.
    While it arrives, its connection is one the cap may shed (the slowest first)."""
    runner = request.app.get(RUNNER) if isinstance(request, web.Request) else None
    if request.content.is_eof() or not isinstance(runner, CappedRunner):
        return await request.read()  # all here already (a small body usually is)
    limits = runner.limits
    timeout_s = limits.body_timeout_s + (request.content_length or 0) / limits.body_min_rate
    handler = request.protocol
    runner.receiving[handler] = time.monotonic()
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        runner.stats["timeout_body"] += 1
        raise BodyTimeout(f"request body not received within {timeout_s:g}s") from None
    finally:
        runner.receiving.pop(handler, None)


class CappedRunner(web.AppRunner):
    """Its sites hold at most `max_connections` at a time, fewer while `may_accept()` says no
    (descriptors are short): a new connection sheds an idle or slow one, or is closed."""

    def __init__(self, app: web.Application, max_connections: int,
                 may_accept: Callable[[], bool], limits: ClientLimits,
                 stats: collections.Counter[str] | None, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.max_connections = max_connections
        self.may_accept = may_accept
        self.limits = limits
        self.stats: collections.Counter[str] = stats if stats is not None else \
            collections.Counter()
        self.receiving: dict[Any, float] = {}  # handler -> since when its body is awaited
        self.paused_since: dict[Any, float] = {}  # handler -> since when its writes are paused
        self.draining = False  # an upgrade's hand-over: every answer closes its connection
        self._watch: asyncio.Task[None] | None = None
        app.on_response_prepare.append(self._closing)

    async def setup(self) -> None:
        await super().setup()
        self._watch = asyncio.get_running_loop().create_task(self._watch_writers())

    async def cleanup(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await super().cleanup()

    async def _watch_writers(self) -> None:
        """Cut off clients that read nothing of their answer for write_timeout."""
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            now, paused = time.monotonic(), {}
            for handler in self._handlers():
                if handler.writing_paused and handler.transport is not None:
                    since = self.paused_since.get(handler, now)
                    if now - since >= self.limits.write_timeout_s:
                        self.stats["timeout_write"] += 1
                        _cut(handler)
                        continue
                    paused[handler] = since
            self.paused_since = paused

    def victim(self) -> tuple[Any, str] | None:
        """The connection to close for a new one: of those idle (waiting for a request's
        headers since their accept or last answer) and those receiving a body, the one waiting
        the longest; None when all are serving requests. A client that sends its request at
        once is never the oldest of a flood that came before it."""
        loop_now = asyncio.get_running_loop().time()
        header_s = self.limits.header_timeout_s
        best: tuple[float, Any, str] | None = None
        for h in self._handlers():
            if h.transport is None or h._request_in_progress or h._messages:  # noqa: SLF001
                continue
            waited = loop_now - (h._next_keepalive_close_time - header_s)  # noqa: SLF001
            if best is None or waited > best[0]:
                best = (waited, h, "idle")
        now = time.monotonic()
        for h, since in self.receiving.items():
            if h.transport is not None and (best is None or now - since > best[0]):
                best = (now - since, h, "slow")
        return None if best is None else (best[1], best[2])

    async def _closing(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        if self.draining:  # "Connection: close": the client's next request waits for the new
            response.force_close()  # code in the backlog instead of racing the exec
            response.headers["Connection"] = "close"  # (the hook runs after aiohttp set it)

    def hold(self) -> int:
        """An upgrade: stop accepting but keep the listening socket open (a duplicate is
        returned, -1 if none), so new clients wait in its backlog; every answer from now on
        closes its connection, so a client's next request waits there too."""
        self.draining = True
        fd = -1
        for site in self.sites:
            server = site._server  # noqa: SLF001 - aiohttp keeps the asyncio server here
            if server is None:
                continue
            fd = os.dup(server.sockets[0].fileno())  # type: ignore[attr-defined]
            server.close()
        return fd

    def _handlers(self) -> list[Any]:
        inner = web.AppRunner.server.fget(self)  # type: ignore[attr-defined]
        return inner.connections if inner is not None else []

    def busy(self) -> int:
        """Connections with a request read and not yet answered (a follower's endless stream,
        marked LONG_LIVED, is not waited for)."""
        count = 0
        for handler in self._handlers():
            request = handler._current_request  # noqa: SLF001
            if request is not None and request.get(LONG_LIVED):
                continue
            if handler._request_in_progress or handler._messages:  # noqa: SLF001
                count += 1
        return count

    def idle_connections(self) -> list[int]:
        """An upgrade's exec: duplicates of the open connections that are not serving a
        request (a keep-alive connection between requests, one accepted whose request is still
        in the kernel's buffer), for the new code to take over: they survive the exec, and
        their next request is the new code's."""
        fds = []
        for handler in self._handlers():
            transport = handler.transport
            if transport is None or handler._request_in_progress or handler._messages:  # noqa
                continue
            sock = transport.get_extra_info("socket")
            if sock is not None:
                fds.append(os.dup(sock.fileno()))
        return fds

    async def adopt_connections(self, fds: list[int]) -> None:
        """The new code's side: each connection served as if just accepted."""
        loop = asyncio.get_running_loop()
        for fd in fds:
            try:
                await loop.connect_accepted_socket(self.server, listening(fd))
            except OSError as exc:
                log.warning("[http] a connection handed over could not be adopted: %s", exc)

    async def accept_again(self, fd: int) -> None:
        """Serve again on a socket `hold` kept (an upgrade that was abandoned)."""
        self.draining = False
        await web.SockSite(self, listening(fd)).start()

    @property
    def server(self) -> Any:  # what sites use as their protocol factory
        inner = super().server
        return None if inner is None else _CappedFactory(inner, self)


def listening(fd: int) -> socket.socket:
    """A socket handed across an exec (or held by `hold`), as ours: not inherited by children,
    non-blocking."""
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    sock.setblocking(False)
    return sock


class _CappedFactory:
    def __init__(self, inner: Server, runner: CappedRunner) -> None:
        self.inner, self.runner = inner, runner

    def __call__(self) -> asyncio.BaseProtocol:
        runner = self.runner
        if len(self.inner.connections) >= runner.max_connections or not runner.may_accept():
            found = runner.victim()
            if found is None:
                runner.stats["refused_full"] += 1
                return _Refuse()
            handler, why = found
            runner.stats[f"shed_{why}"] += 1
            runner.receiving.pop(handler, None)
            _cut(handler)
        if runner.limits.max_per_address:
            return _PerAddress(self.inner(), runner, self.inner)
        return self.inner()


def _cut(handler: Any) -> None:
    """Close a connection now: abort, not close (which would wait to flush what a client that
    does not read will never take), so its handler is cancelled and its request aborted."""
    transport = handler.transport
    if transport is not None:
        transport.abort()


class _Refuse(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class _PerAddress(asyncio.Protocol):
    """A connection past its address's cap is closed when made; others go to aiohttp's handler
    (this forwards every event to it)."""

    def __init__(self, handler: Any, runner: CappedRunner, server: Server) -> None:
        self.handler, self.runner, self.server = handler, runner, server

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = _address(transport)
        same = sum(1 for h in self.server.connections
                   if h.transport is not None and _address(h.transport) == peer)
        if peer is not None and same >= self.runner.limits.max_per_address:
            self.runner.stats["refused_per_address"] += 1
            transport.close()
            self.handler = None
            return
        self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.handler is not None:
            self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.handler is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.handler is not None:
            self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()


def _address(transport: asyncio.BaseTransport) -> str | None:
    peer = transport.get_extra_info("peername")
    return peer[0] if isinstance(peer, tuple) and peer else None


class ServerLog(logging.LoggerAdapter):
    """aiohttp's server logger, minus the noise clients can cause.

    aiohttp logs each malformed request and each client that hangs up mid-request as an ERROR
    with a traceback. Those are the client's faults: they become one warning line at most every
    few seconds (with a count), so garbage on a socket cannot flood the journal. Exceptions from
    our own handlers keep their traceback.
    """

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, {})
        self._last_at = -_CLIENT_ERROR_LOG_EVERY_S
        self._suppressed = 0

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if exc is True or isinstance(exc, tuple):
            exc = sys.exc_info()[1] if exc is True else exc[1]
        if not isinstance(exc, (HttpProcessingError, ConnectionError)):
            super().log(level, msg, *args, **kwargs)
            return
        now = time.monotonic()
        if now - self._last_at < _CLIENT_ERROR_LOG_EVERY_S:
            self._suppressed += 1
            return
        self.logger.warning("[http] bad request or lost client: %s (%d more since the last "
                            "report)", " ".join(f"{type(exc).__name__}: {exc}".split())[:200],
                            self._suppressed)
        self._last_at, self._suppressed = now, 0
