"""vLLM's sleep mode for a `vllm serve` command engine (supervisor.routing.sleepmode), against a
real HTTP server on loopback that answers as vLLM's dev routes do: `POST /sleep?level=N` and
`POST /wake_up`, an error answer told with its status and text; and the server's environment
(VLLM_SERVER_DEV_MODE=1, without which vLLM serves neither). Engine children get the same as
channel tasks: tests/e2e/test_sleep_mode.py, tests/lifecycle/test_sleep_mode.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiohttp import web

from engined.supervisor.gateway.upstream import Upstream
from engined.supervisor.host.launcher import command_environment
from engined.supervisor.lifecycle.clock import SystemClock
from engined.supervisor.routing.sleepmode import SleepMode
from engined.supervisor.spec import parse_fleet
from tests.unit.test_spec_ondemand import fleet_of

SPEC = ("- {name: c, command: [vllm, serve, m, --enable-sleep-mode], gpus: [0], "
        "gpus_per_replica: 1, sleep_mode: level2, idle_timeout: 1m, port: 8000}\n")


def test_a_command_engine_sleeps_and_wakes_through_vllms_dev_routes() -> None:
    spec = parse_fleet(fleet_of(SPEC), "fleet.yaml").engines[0]
    asked: list[str] = []
    refuse = {"wake": False}

    async def sleep(request: web.Request) -> web.Response:
        asked.append(f"sleep level={request.query.get('level')}")
        return web.json_response({"status": "sleeping"})

    async def wake_up(request: web.Request) -> web.Response:
        asked.append("wake_up")
        if refuse["wake"]:
            return web.json_response({"error": "CUDA out of memory"}, status=500)
        return web.json_response({"status": "awake"})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/sleep", sleep)
        app.router.add_post("/wake_up", wake_up)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        upstream = Upstream()
        mode = SleepMode(None, upstream, SystemClock(), lambda inc: 0)  # type: ignore[arg-type]
        inc = SimpleNamespace(port=port, address=("c-0", 1))
        try:
            assert await mode.sleep(spec, inc) is None  # type: ignore[arg-type]
            assert await mode.wake(spec, inc) is None  # type: ignore[arg-type]
            refuse["wake"] = True
            error = await mode.wake(spec, inc)  # type: ignore[arg-type]
            assert error is not None and error.startswith("POST /wake_up: HTTP 500: ") \
                and "CUDA out of memory" in error, error
        finally:
            await upstream.close()
            await runner.cleanup()
        assert asked == ["sleep level=2", "wake_up", "wake_up"]
    asyncio.run(main())


def test_a_command_engine_that_sleeps_in_place_gets_vllms_dev_mode() -> None:
    spec = parse_fleet(fleet_of(SPEC), "fleet.yaml").engines[0]
    assert command_environment(spec, 1, 8000)["VLLM_SERVER_DEV_MODE"] == "1"
    plain = parse_fleet(fleet_of("- {name: c, command: [vllm, serve, m], port: 8000}\n"),
                        "fleet.yaml").engines[0]
    assert "VLLM_SERVER_DEV_MODE" not in command_environment(plain, 1, 8000)
