"""The gateway's client for command engines' servers and a cluster's nodes keeps its connections
between requests, and a kept connection the server closed while idle is never taken for the
server's failure: the request goes once more on a new connection."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from engined.supervisor.gateway.upstream import Upstream

OK = b'{"ok": true}'


class Server:
    """A raw HTTP/1.1 server on loopback that answers every request with OK on a kept
    connection, except that the connections numbered in `drop` are closed when their second
    request arrives, unanswered: a server that timed the connection out just as the client
    sent on it (the FIN still on its way). It counts connections and what it answered."""

    def __init__(self, drop: frozenset[int] = frozenset()) -> None:
        self.drop = drop
        self.connections = 0
        self.answered: list[tuple[int, dict]] = []  # (connection, body)
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn, served = self.connections, 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length) if length else b""
                if conn in self.drop and served == 1:
                    return  # closed without an answer
                served += 1
                self.answered.append((conn, json.loads(body) if body else {}))
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(OK), OK))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), 30))


def test_requests_to_one_server_share_a_kept_connection():
    async def main() -> None:
        server, upstream = Server(), Upstream()
        port = await server.start()
        try:
            for i in range(5):
                status, _, data = await upstream.fetch(("127.0.0.1", port), "POST",
                                                       "/v1/completions",
                                                       json.dumps({"i": i}).encode())
                assert (status, data) == (200, OK)
            response = await upstream.open(("127.0.0.1", port), "/v1/completions", b'{"i": 5}')
            assert response.status == 200 and await response.read() == OK
            response.close()
        finally:
            await upstream.close()
            await server.stop()
        assert server.connections == 1
        assert [body["i"] for _, body in server.answered] == [0, 1, 2, 3, 4, 5]
    run(main)


@pytest.mark.parametrize("how", ["fetch", "open"])
def test_a_kept_connection_the_server_closed_while_idle_is_not_a_failure(how):
    async def main() -> None:
        server, upstream = Server(drop=frozenset({1})), Upstream()
        port = await server.start()
        address = ("127.0.0.1", port)
        try:
            status, _, _ = await upstream.fetch(address, "POST", "/v1/completions", b'{"i": 0}')
            assert status == 200
            if how == "fetch":
                status, _, data = await upstream.fetch(address, "POST", "/v1/completions",
                                                       b'{"i": 1}')
            else:
                response = await upstream.open(address, "/v1/completions", b'{"i": 1}')
                status, data = response.status, await response.read()
                response.close()
            assert (status, data) == (200, OK)
        finally:
            await upstream.close()
            await server.stop()
        # the second request reached the server once more, on a connection of its own, and
        # was answered exactly once
        assert server.connections == 2
        assert server.answered == [(1, {"i": 0}), (2, {"i": 1})]
    run(main)


def test_a_server_that_is_gone_fails_the_request_at_once():
    async def main() -> None:
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        upstream = Upstream()
        try:
            with pytest.raises(aiohttp.ClientConnectorError):
                await upstream.fetch(("127.0.0.1", port), "POST", "/v1/completions", b"{}")
        finally:
            await upstream.close()
    run(main)
