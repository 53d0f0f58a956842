"""The benchmarks' load generator (bench/common.py's LeanHTTP) against a real aiohttp server, on
TCP and on a Unix socket: it reads what a server answers (a length, chunks, an error status),
keeps one connection per request in flight and reuses it, drops one the server closes, and
fails loudly on an answer it cannot read. The benchmark figures rest on it reading answers right.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bench.common import BenchError, LeanHTTP


class _Server:
    """An aiohttp app whose routes answer the ways servers do; it counts its connections."""

    def __init__(self, **runner: Any) -> None:
        self.peers: set[int] = set()  # id() of each connection's transport
        app = web.Application()
        app.router.add_post("/echo", self.echo)
        app.router.add_post("/chunked", self.chunked)
        app.router.add_post("/close", self.close)
        app.router.add_post("/missing", self.missing)
        app.router.add_post("/slow", self.slow)
        # handler_cancellation: /slow ends with its client
        self.runner = web.AppRunner(app, handler_cancellation=True, **runner)

    def _seen(self, request: web.Request) -> None:
        assert request.transport is not None
        self.peers.add(id(request.transport))

    async def echo(self, request: web.Request) -> web.Response:
        self._seen(request)
        return web.json_response({"got": await request.json()})

    async def chunked(self, request: web.Request) -> web.StreamResponse:
        self._seen(request)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        body = json.dumps({"got": await request.json(), "pad": "x" * 3000}).encode()
        for i in range(0, len(body), 1000):  # three chunks
            await resp.write(body[i:i + 1000])
        await resp.write_eof()
        return resp

    async def close(self, request: web.Request) -> web.Response:
        self._seen(request)
        return web.json_response({"closing": True}, headers={"Connection": "close"})

    async def missing(self, request: web.Request) -> web.Response:
        self._seen(request)
        return web.json_response({"error": "no such engine"}, status=404)

    async def slow(self, request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({})


Check = Callable[[_Server, LeanHTTP], Awaitable[None]]


async def _served(kind: str, where: Path, check: Check) -> None:
    """Run `check` against a fresh server on TCP or on a Unix socket, in one event loop."""
    server = _Server()
    await server.runner.setup()
    if kind == "tcp":
        site: Any = web.TCPSite(server.runner, "127.0.0.1", 0)
        await site.start()
        client = LeanHTTP(port=server.runner.addresses[0][1], timeout_s=2.0)
    else:
        site = web.UnixSite(server.runner, str(where / "s.sock"))
        await site.start()
        client = LeanHTTP(unix=str(where / "s.sock"), timeout_s=2.0)
    try:
        await check(server, client)
    finally:
        client.close()
        await server.runner.cleanup()


@pytest.fixture(params=["tcp", "unix"])
def served(request: pytest.FixtureRequest, short_tmp: Path) -> Callable[[Check], None]:
    return lambda check: asyncio.run(_served(request.param, short_tmp, check))


def test_an_answer_by_length_and_by_chunks(
        served: Callable[[Check], None]) -> None:
    async def check(server: _Server, client: LeanHTTP) -> None:
        assert await client.post("/echo", {"n": 1}) == (200, {"got": {"n": 1}})
        status, data = await client.post("/chunked", {"n": 2})
        assert status == 200 and data["got"] == {"n": 2} and len(data["pad"]) == 3000
        assert await client.post("/missing", {}) == (404, {"error": "no such engine"})
        assert len(server.peers) == 1  # one after the other: one keep-alive connection
    served(check)


def test_one_connection_per_request_in_flight_reused_after(
        served: Callable[[Check], None]) -> None:
    async def check(server: _Server, client: LeanHTTP) -> None:
        answers = await asyncio.gather(*(client.post("/echo", {"k": k}) for k in range(4)))
        assert answers == [(200, {"got": {"k": k}}) for k in range(4)]
        assert len(server.peers) == 4
        await asyncio.gather(*(client.post("/echo", {"k": k}) for k in range(4)))
        assert len(server.peers) == 4  # the same four again
    served(check)


def test_a_connection_the_server_closes_is_not_reused(
        served: Callable[[Check], None]) -> None:
    async def check(server: _Server, client: LeanHTTP) -> None:
        assert await client.post("/close", {}) == (200, {"closing": True})
        assert await client.post("/echo", {}) == (200, {"got": {}})
        assert len(server.peers) == 2
    served(check)


def test_a_slow_answer_times_out_and_its_connection_is_dropped(
        served: Callable[[Check], None]) -> None:
    async def check(server: _Server, client: LeanHTTP) -> None:
        with pytest.raises(TimeoutError):
            await client.post("/slow", {})
        assert await client.post("/echo", {}) == (200, {"got": {}})  # on a new connection
        assert len(server.peers) == 1  # /slow records none; the echo's is the only one seen
    served(check)


def test_a_connection_closed_while_idle_is_not_reused() -> None:
    """A server's keep-alive timeout (uvicorn's is 5 s) closes idle connections."""
    async def check() -> None:
        server = _Server(keepalive_timeout=0.1)
        await server.runner.setup()
        await web.TCPSite(server.runner, "127.0.0.1", 0).start()
        client = LeanHTTP(port=server.runner.addresses[0][1], timeout_s=2.0)
        try:
            assert await client.post("/echo", {"k": 1}) == (200, {"got": {"k": 1}})
            await asyncio.sleep(0.5)  # the server closes it
            assert await client.post("/echo", {"k": 2}) == (200, {"got": {"k": 2}})
            assert len(server.peers) == 2
        finally:
            client.close()
            await server.runner.cleanup()

    asyncio.run(check())


def test_a_request_the_server_closed_on_goes_again_on_a_new_connection() -> None:
    """The close can cross the next request on the wire: nothing answered, so it is resent."""
    answered: list[int] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)  # the body: {}
        if answered:  # the second connection
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n{\"n\":2}")
            answered.append(2)
            await writer.drain()
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n{\"n\":1}")
        answered.append(1)
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # the next request: closed on, unanswered
        writer.close()

    async def check() -> None:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        client = LeanHTTP(port=server.sockets[0].getsockname()[1], timeout_s=2.0)
        try:
            assert await client.post("/x", {}) == (200, {"n": 1})
            assert await client.post("/x", {}) == (200, {"n": 2})
            assert answered == [1, 2]
        finally:
            client.close()
            server.close()
            await server.wait_closed()

    asyncio.run(check())


def test_an_answer_without_a_length_is_an_error() -> None:
    """HTTP/1.0 style, the body read to the close: not what our servers send, so an error."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{}")
        await writer.drain()
        writer.close()

    async def check() -> None:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        client = LeanHTTP(port=server.sockets[0].getsockname()[1], timeout_s=2.0)
        try:
            with pytest.raises(BenchError, match="without a length"):
                await client.post("/bare", {})
        finally:
            client.close()
            server.close()
            await server.wait_closed()

    asyncio.run(check())
