"""The control API's validation, against the real aiohttp app over a fleet of fake children: every
bad request is a 4xx naming what is wrong, and none of them touches the fleet."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engined.engine import protocol as proto
from engined.supervisor.control.api import ControlContext, make_app
from engined.supervisor.control.events import EventLog
from engined.supervisor.ipc import RequestFailed
from engined.supervisor.lifecycle.state import EngineState
from engined.supervisor.observe.sampler import Sampler
from lifecycle.fakes import World


class _NoNvml:
    available = False

    def devices(self) -> tuple[()]:
        return ()


class FakeChannels:
    """What the routes use of the engine channels: drop counts and requests (an echo)."""

    def __init__(self) -> None:
        self.dropped: collections.Counter[str] = collections.Counter()
        self.sent: list[tuple[str, str, int]] = []

    def open(self, address: tuple[str, int], request: proto.GenerateRequest,
             wake: Iterable[tuple[str, int]] = ()) -> FakeStream:
        engine, incarnation = address
        self.sent.append((engine, request.prompt, request.sampling.max_tokens))
        return FakeStream(engine, incarnation, request)


class FakeStream:
    def __init__(self, engine: str, incarnation: int, request: proto.GenerateRequest) -> None:
        self.engine, self.incarnation, self.request = engine, incarnation, request

    async def result(self, timeout_s: float | None = None) -> proto.GenerateResult:
        prompt, n = self.request.prompt, self.request.sampling.max_tokens
        if prompt == "fail":
            raise RequestFailed(f"{self.engine}: boom")
        return proto.GenerateResult(self.request.id, self.engine, self.incarnation,
                                    prompt[:n], prompt_tokens=len(prompt),
                                    completion_tokens=min(len(prompt), n))

    def close(self) -> None:
        pass


BAD_REQUESTS: list[tuple[str, str, Any, int, str]] = [
    # method, path, body (dict = JSON, bytes = raw), status, a fragment of the error
    ("POST", "/v1/engines/a-0/frobnicate", {}, 404, "unknown action 'frobnicate'"),
    ("POST", "/v1/engines/nosuch/restart", {}, 404, "unknown engine 'nosuch'"),
    ("POST", "/v1/engines/a/restart", {"wait": "yes"}, 400, "'wait': expected `bool`, got `str`"),
    ("POST", "/v1/engines/a/stop", {"timeout_s": -1}, 400, "'timeout_s': expected `float` >= 0.0"),
    ("POST", "/v1/engines/a/stop", {"timeout_s": True}, 400, "'timeout_s': expected `float`"),
    ("POST", "/v1/engines/a/stop", {"timeout": 5}, 400,
     "unrecognized request argument supplied: timeout"),
    ("POST", "/v1/engines/a/start", b"{not json", 400, "malformed JSON body"),
    ("POST", "/v1/engines/a/start", b"[1, 2]", 400, "JSON body must be an object"),
    ("POST", "/v1/engines/a/start", b"\xff\xfe", 400, "malformed JSON body"),
    ("POST", "/v1/engines/a/start", b"[" * 100_000, 413, ""),
    ("POST", "/v1/generate", {}, 400, "'prompt' must be a non-empty string"),
    ("POST", "/v1/generate", {"prompt": ""}, 400, "'prompt' must be a non-empty string"),
    ("POST", "/v1/generate", {"prompt": "x" * 70_000}, 413, ""),  # the socket's body limit
    ("POST", "/v1/generate", {"prompt": [1, -2]}, 400, "'prompt' token ids must be"),
    ("POST", "/v1/generate", {"prompt": "hi", "stop": ["a"] * 17}, 400, "length <= 16"),
    ("POST", "/v1/generate", b'{"prompt": "\\ud800"}', 400, "valid Unicode"),
    ("POST", "/v1/generate", {"prompt": "hi", "engine": 5}, 400,
     "'engine': expected `str`, got `int`"),
    ("POST", "/v1/generate", {"prompt": "hi", "timeout_s": 0}, 400,
     "'timeout_s': expected `float` >= 0.001"),
    ("POST", "/v1/generate", {"prompt": "hi", "max_tokens": 0}, 400, "'max_tokens'"),
    ("POST", "/v1/generate", {"prompt": "hi", "max_tokens": 1e9}, 400, "'max_tokens'"),
    ("POST", "/v1/generate", {"prompt": "hi", "engine": "nosuch"}, 404, "unknown engine"),
    ("GET", "/v1/engines/nosuch/logs", None, 404, "unknown engine 'nosuch'"),
    ("GET", "/v1/engines/a-0/logs?lines=ten", None, 400, "'lines' must be an integer"),
    ("GET", "/v1/nothing-here", None, 404, ""),
    ("DELETE", "/v1/status", None, 405, ""),
    ("POST", "/v1/reload", {}, 501, "reload is not available"),
]


def _run(tmp_path: Path, body: Any) -> None:
    async def main() -> None:
        world = await World.build(tmp_path, [{"name": "a", "replicas": 2}])
        await world.start("a-0", "a-1")
        channels = FakeChannels()
        ctx = ControlContext(world.fleet, world.router, channels,  # type: ignore[arg-type]
                             Sampler(_NoNvml()), EventLog(),  # type: ignore[arg-type]
                             "/etc/engined/fleet.yaml")
        client = TestClient(TestServer(make_app(ctx)))
        await client.start_server()
        try:
            await body(world, channels, client)
        finally:
            await client.close()
            await world.close()
    asyncio.run(main())


@pytest.mark.parametrize("method, path, body, status, fragment", BAD_REQUESTS)
def test_bad_requests_are_refused_and_the_fleet_is_untouched(tmp_path, method, path, body,
                                                             status, fragment):
    async def check(world: World, channels: FakeChannels, client: TestClient) -> None:
        before = {n: (world.spawns(n), world.state(n)) for n in ("a-0", "a-1")}
        kwargs: dict[str, Any] = {}
        if isinstance(body, bytes):
            kwargs = {"data": body, "headers": {"Content-Type": "application/json"}}
        elif body is not None:
            kwargs = {"json": body}
        resp = await client.request(method, path, **kwargs)
        assert resp.status == status, await resp.text()
        if fragment:
            error = (await resp.json())["error"]
            assert fragment in error, error
        await world.settle(0.05)  # a real loop here: anything the request set off has run
        assert {n: (world.spawns(n), world.state(n)) for n in ("a-0", "a-1")} == before
        assert channels.sent == []
        assert not any(c.signals for cs in world.launcher.children.values() for c in cs)

    _run(tmp_path, check)


def test_status_reports_every_engine_from_its_view(tmp_path):
    async def check(world: World, channels: FakeChannels, client: TestClient) -> None:
        world.child("a-1").exit(1)
        await world.settle()
        resp = await client.get("/v1/status")
        assert resp.status == 200
        data = await resp.json()
        engines = {e["name"]: e for e in data["engines"]}
        assert engines["a-0"]["state"] == "READY" and engines["a-0"]["device"] == "cpu"
        assert engines["a-1"]["state"] == "STARTING" and engines["a-1"]["incarnation"] == 2
        assert engines["a-1"]["last_exit"]["code"] == 1
        assert engines["a-1"]["restarts_by_reason"] == {"exit": 1}
        assert data["supervisor"]["ipc_dropped"] == {}

    _run(tmp_path, check)


def test_generate_goes_to_a_ready_engine_and_failures_are_503(tmp_path):
    async def check(world: World, channels: FakeChannels, client: TestClient) -> None:
        resp = await client.post("/v1/generate", json={"prompt": "hello", "max_tokens": 3})
        assert resp.status == 200
        assert (await resp.json())["text"] == "hel"
        resp = await client.post("/v1/generate", json={"prompt": "fail", "engine": "a-1"})
        assert resp.status == 503 and "boom" in (await resp.json())["error"]
        world.fleet.command("stop", "all")
        await world.settle()
        resp = await client.post("/v1/generate", json={"prompt": "hello"})
        assert resp.status == 503 and "no READY engine" in (await resp.json())["error"]
        views = {v.name: v for v in world.fleet.view().engines}
        assert views["a-1"].requests_of("error") == 1
        assert sum(v.requests_of("ok") for v in views.values()) == 1

    _run(tmp_path, check)


def test_actions_wait_for_the_target_state(tmp_path):
    async def check(world: World, channels: FakeChannels, client: TestClient) -> None:
        resp = await client.post("/v1/engines/a/stop", json={"timeout_s": 10})
        results = (await resp.json())["engines"]
        assert [(r["name"], r["state"], r["ok"]) for r in results] == [
            ("a-0", "STOPPED", True), ("a-1", "STOPPED", True)]
        start = asyncio.ensure_future(client.post("/v1/engines/a-0/start",
                                                  json={"timeout_s": 30}))
        await world.until(lambda: world.state("a-0") is EngineState.STARTING)
        world.ready("a-0")
        resp = await start
        (result,) = (await resp.json())["engines"]
        assert (result["state"], result["ok"], result["error"]) == ("READY", True, None)
        resp = await client.post("/v1/engines/a-1/start", json={"timeout_s": 0.2})
        (result,) = (await resp.json())["engines"]
        assert result["ok"] is False and "not READY within 0.2s" in result["error"]

    _run(tmp_path, check)

