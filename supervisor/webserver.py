"""aiohttp server settings shared by both of the daemon's HTTP servers (the control socket and
the TCP endpoint): client timeouts, a connection cap, and client errors logged without noise.

A client (or anyone on the host, for the loopback TCP endpoint) must not be able to pin the
daemon's resources: an unfinished request is cut off after CLIENT_TIMEOUT_S, and connections past
a server's cap are closed as soon as they are accepted. Every connection is an fd, and a daemon out
of fds cannot spawn engines, and libzmq aborts the whole process when its ipc listener cannot
accept an engine's connection (EMFILE is not among the errors it tolerates).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from typing import Any, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_server import Server

log = logging.getLogger("engined.http")

# A client must deliver a request's headers, and then its body, within this; a slow or stalled
# client is cut off (408 or a closed connection) instead of holding a connection and an fd forever.
CLIENT_TIMEOUT_S = 10.0
# A request whose answer is an endless stream (`logs -f`, `events -f`): an upgrade does not wait
# for it to end (it is cut; the follower reconnects).
LONG_LIVED = "engined.long_lived"
# After answering a request whose body was not read (413, 408), read the rest only this long
# before closing: long enough for a local client to see the answer.
_LINGER_S = 2.0
_CLIENT_ERROR_LOG_EVERY_S = 5.0


def make_runner(app: web.Application, max_connections: int,
                may_accept: Callable[[], bool] = lambda: True) -> CappedRunner:
    """An AppRunner with the timeouts, the connection cap (and `may_accept`: the daemon's
    file-descriptor reserve) and the quiet client-error log."""
    # keepalive_timeout also bounds the wait for a first complete request (aiohttp arms it at
    # accept): a client that sends half a request line is closed when it expires.
    # handler_cancellation: a client that goes away cancels its handler, so a request it was
    # waiting for is aborted (and a `logs -f` follower unregistered) at once.
    return CappedRunner(app, max_connections, may_accept, handle_signals=False, access_log=None,
                        handler_cancellation=True,
                        keepalive_timeout=CLIENT_TIMEOUT_S, lingering_time=_LINGER_S,
                        logger=ServerLog(logging.getLogger("engined.http")))


class CappedRunner(web.AppRunner):
    """Its sites accept at most `max_connections` at a time, and none while `may_accept()` says
    no (descriptors are short); the rest are closed at once."""

    def __init__(self, app: web.Application, max_connections: int,
                 may_accept: Callable[[], bool], **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.max_connections = max_connections
        self.may_accept = may_accept
        self.draining = False  # an upgrade's hand-over: every answer closes its connection
        app.on_response_prepare.append(self._closing)

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
        if (len(self.inner.connections) >= self.runner.max_connections
                or not self.runner.may_accept()):
            return _Refuse()
        return self.inner()


class _Refuse(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


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
