"""The gateway's HTTP client for command engines' own servers (loopback) and a cluster's nodes:
one session, each incarnation's model name (`GET /v1/models`, asked once per incarnation), and
the calls in flight per incarnation, which end with EngineLost the moment it is gone
(supervisor.notices): a server's descendant may keep a socket open after the server itself died.

Connections are kept open between requests (as a reverse proxy keeps its upstreams'), for at most
KEEPALIVE_S idle: a new connection per request costs both sides a connect and an accept, the
server's on its busy event loop, and leaves a socket in TIME_WAIT for a minute, which at a few
hundred requests a second would use up the ephemeral ports to one server. A kept connection the
server closed while it was idle fails the next request before any answer; that request is sent
once more on a new connection (RFC 9112, 9.3.1), so a server's idle timeout is never taken for
its failure."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import aiohttp

from engined.supervisor.ipc import EngineLost
from engined.supervisor.lifecycle.notices import Lost

log = logging.getLogger("engined.gateway")

MAX_BODY_BYTES = 64 << 20  # a whole answer read from a server (embeddings can be large)
# idle seconds a kept connection may wait for its next request: under uvicorn's 5 s (vLLM's
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE, SGLang's and most Python servers'), so that the server is rarely
# the side that closes it (one idle longer is never sent on again; aiohttp closes it later)
KEEPALIVE_S = 2.0
Address = tuple[str, int]


class Upstream:
    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None  # a new connection for every request
        self._names: dict[Address, str] = {}  # incarnation's address -> its model name
        self._flights: dict[Address, set[asyncio.Future[None]]] = {}
        self.headers: dict[str, str] = {}  # sent with every call (a cluster's node token)

    def session(self) -> aiohttp.ClientSession:
        """The session of kept connections."""
        if self._session is None or self._session.closed:
            self._session = _session(aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S))
        return self._session

    def _fresh_session(self) -> aiohttp.ClientSession:
        if self._fresh is None or self._fresh.closed:
            self._fresh = _session(aiohttp.TCPConnector(limit=0, force_close=True))
        return self._fresh

    async def _send(self, method: str, address: Address, path: str, body: bytes | None,
                    headers: dict[str, str]) -> aiohttp.ClientResponse:
        """The request's answer (its status and headers read, its body not yet). A connection
        closed or reset before any answer is replaced by a new one, once: which connection the
        pool gave is not known here, and a kept one the server timed out is the usual cause."""
        url = _url(address, path)
        try:
            return await self.session().request(method, url, data=body, headers=headers)
        except aiohttp.ClientConnectorError:
            raise  # no connection could be made: the server is not there
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            # the server closed or reset the connection before answering. On a new connection,
            # a server that is gone refuses it (and the request moves as before); one that is
            # there gets the request again (a kept connection it had timed out never saw it).
            return await self._fresh_session().request(method, url, data=body, headers=headers)

    @contextlib.asynccontextmanager
    async def flight(self, address: Address, engine: str) -> AsyncIterator[asyncio.Future[None]]:
        """A future that fails with EngineLost when the incarnation at `address` is gone."""
        lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        lost.add_done_callback(_consume)
        flights = self._flights.setdefault(address, set())
        flights.add(lost)
        try:
            yield lost
        finally:
            flights.discard(lost)
            if not flights:
                self._flights.pop(address, None)
            if not lost.done():
                lost.cancel()

    def on_lost(self, lost: Lost) -> None:
        """The incarnation is gone: end its calls now."""
        engine = lost.address[0]
        for future in self._flights.pop(lost.address, set()):
            if not future.done():
                future.set_exception(EngineLost(f"{engine} {lost.why}", engine, lost.why))
        self._names.pop(lost.address, None)

    async def model_name(self, engine: str, address: Address, port: int) -> str:
        """The upstream's own model name, asked once per incarnation."""
        name = self._names.get(address)
        if name is None:
            async with self.session().get(f"http://127.0.0.1:{port}/v1/models") as response:
                if response.status != 200:
                    raise EngineLost(f"{engine}: GET /v1/models: HTTP {response.status}",
                                     engine, "did not list its models")
                data = await response.json(content_type=None)
            try:
                name = str(data["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise EngineLost(f"{engine}: GET /v1/models lists no model",
                                 engine, "lists no model") from None
            self._names[address] = name
        return name

    async def fetch(self, address: Address, method: str, path: str,
                    body: bytes | None) -> tuple[int, dict[str, str], bytes]:
        """One whole exchange with the server at (host, port): (status, headers, body)."""
        headers = {**self.headers, **({"Content-Type": "application/json"}
                                      if body is not None else {})}
        async with await self._send(method, address, path, body, headers) as response:
            # to its end: a body cut short (fewer bytes than its Content-Length, a chunked
            # body without its last chunk) raises ClientPayloadError instead of passing as whole
            parts, size = [], 0
            async for part in response.content.iter_chunked(1 << 16):
                size += len(part)
                if size > MAX_BODY_BYTES:
                    raise ValueError(f"{method} {path}: the answer is larger than "
                                     f"{MAX_BODY_BYTES} bytes")
                parts.append(part)
            return response.status, dict(response.headers), b"".join(parts)

    async def open(self, address: Address, path: str, body: bytes) -> aiohttp.ClientResponse:
        """A POST whose answer is read as it comes (the caller closes it)."""
        return await self._send("POST", address, path, body,
                                {**self.headers, "Content-Type": "application/json"})

    async def close(self) -> None:
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()


def _session(connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=connector,
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
                                 auto_decompress=False, read_bufsize=1 << 16)


def _url(address: Address, path: str) -> str:
    return f"http://{address[0]}:{address[1]}{path}"


def _consume(future: asyncio.Future[None]) -> None:
    """A lost future nobody awaited must not log 'exception was never retrieved'."""
    if not future.cancelled():
        future.exception()
