"""The control API: HTTP/1.1 + JSON over the daemon's unix socket, served by aiohttp.

Routes map onto fleet commands; nothing here decides lifecycle. Access: the peer's uid (from
SO_PEERCRED) must be root or the daemon's own uid. Every error is `{"error": "..."}` with a 4xx/5xx
status; a bad request never touches the fleet.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
import time
from typing import Any, Awaitable, Callable

from aiohttp import web

from engined.supervisor import __version__
from engined.supervisor.fleet import Fleet, NoEngineReady, UnknownEngine
from engined.supervisor.ipc import EngineChannels, RequestFailed
from engined.supervisor.reload import ReloadRejected
from engined.supervisor.replica import Replica
from engined.supervisor.sampler import Sample, Sampler
from engined.supervisor.state import EngineState
from engined.supervisor.view import EngineView
from engined.supervisor.webserver import CLIENT_TIMEOUT_S

log = logging.getLogger("engined.control")

MAX_BODY_BYTES = 64 * 1024
DEFAULT_WAIT_S = 120.0
MAX_PROMPT_CHARS = 32 * 1024


class ControlContext:
    """What the routes need; built once by the daemon."""

    def __init__(self, fleet: Fleet, channels: EngineChannels, sampler: Sampler,
                 config_path: str, reload: Callable[[], Awaitable[dict]] | None = None) -> None:
        self.fleet = fleet
        self.channels = channels
        self.sampler = sampler
        self.config_path = config_path
        self.reload = reload
        self.started = time.time()
        self.generation = 1


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


@web.middleware
async def _peer_check(request: web.Request, handler):
    """Only root and the daemon's own uid may drive it; everyone else gets 403."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None and sock.family == socket.AF_UNIX:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid not in (0, os.getuid()):
            log.warning("[control] refused uid %d", uid)
            return _error(403, f"access denied for uid {uid}")
    return await handler(request)


@web.middleware
async def _errors_as_json(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.reason)


def make_app(ctx: ControlContext) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES,
                          middlewares=[_errors_as_json, _peer_check])
    routes = _Routes(ctx)
    app.router.add_get("/v1/status", routes.status)
    app.router.add_post("/v1/engines/{name}/{action}", routes.action)
    app.router.add_get("/v1/engines/{name}/logs", routes.logs)
    app.router.add_post("/v1/generate", routes.generate)
    app.router.add_post("/v1/reload", routes.reload)
    return app


async def _json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    if (request.content_length or 0) > MAX_BODY_BYTES:  # refuse now, not after waiting for it
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES,
                                            actual_size=request.content_length or 0)
    try:
        raw = await asyncio.wait_for(request.read(), CLIENT_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise web.HTTPRequestTimeout(
            reason=f"request body not received within {CLIENT_TIMEOUT_S:g}s") from None
    try:
        body = json.loads(raw or b"{}")
    # ValueError: bad JSON, bad UTF-8, an integer past Python's digit limit; RecursionError:
    # nesting deeper than the decoder's stack.
    except (ValueError, RecursionError) as exc:
        raise web.HTTPBadRequest(reason=f"malformed JSON body: {exc}"[:300]) from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(reason="JSON body must be an object")
    return body


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _number(body: dict, key: str, default: float, low: float, high: float) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise web.HTTPBadRequest(reason=f"{key!r} must be a number in [{low:g}, {high:g}]")
    return float(value)


class _Routes:
    def __init__(self, ctx: ControlContext) -> None:
        self.ctx = ctx

    async def status(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        supervisor = {"pid": os.getpid(), "version": __version__,
                      "uptime_s": round(time.time() - ctx.started, 3),
                      "config": ctx.config_path, "generation": ctx.generation,
                      "ipc_dropped": dict(ctx.channels.dropped)}
        views = ctx.fleet.view().engines
        sample = await ctx.sampler.sample([v.pid for v in views if v.pid is not None])
        engines = [engine_status(v, sample) for v in views]
        return web.json_response({"supervisor": supervisor, "engines": engines})

    async def action(self, request: web.Request) -> web.Response:
        action = request.match_info["action"]
        if action not in ("start", "stop", "restart"):
            raise web.HTTPNotFound(reason=f"unknown action {action!r}")
        body = await _json_body(request)
        wait = body.get("wait", True)
        if not isinstance(wait, bool):
            raise web.HTTPBadRequest(reason="'wait' must be true or false")
        timeout_s = _number(body, "timeout_s", DEFAULT_WAIT_S, 0, 86400)
        fleet = self.ctx.fleet
        try:
            affected = fleet.affected(request.match_info["name"])
        except UnknownEngine as exc:
            return _error(404, str(exc))
        before = {r.name: r.view() for r in affected}
        fleet.command(action, request.match_info["name"])
        results = await asyncio.gather(*(_settle(r, action, before[r.name], wait, timeout_s)
                                         for r in affected))
        return web.json_response({"engines": results})

    async def logs(self, request: web.Request) -> web.StreamResponse:
        try:
            (replica,) = self.ctx.fleet.resolve(request.match_info["name"])
        except UnknownEngine as exc:
            return _error(404, str(exc))
        except ValueError:
            return _error(400, "logs take one replica name, not a group")
        try:
            lines = int(request.query.get("lines", "50"))
        except ValueError:
            return _error(400, "'lines' must be an integer")
        lines = max(0, min(lines, 100_000))
        head = "".join(f"{line}\n" for line in replica.log.last_lines(lines))
        if request.query.get("follow") not in ("1", "true"):
            return web.Response(text=head, content_type="text/plain")
        return await _follow(request, replica, head)

    async def generate(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        prompt, engine = body.get("prompt"), body.get("engine")
        if not isinstance(prompt, str) or not prompt or len(prompt) > MAX_PROMPT_CHARS:
            return _error(400, f"'prompt' must be a non-empty string of at most "
                               f"{MAX_PROMPT_CHARS} characters")
        if not _is_unicode(prompt):
            return _error(400, "'prompt' must be valid Unicode (JSON allows lone surrogate "
                               "escapes such as \\ud800; text cannot hold them)")
        if engine is not None and not isinstance(engine, str):
            return _error(400, "'engine' must be a string or null")
        max_tokens = int(_number(body, "max_tokens", 64, 1, 4096))
        timeout_s = _number(body, "timeout_s", 300, 0.001, 3600)
        started = time.monotonic()
        try:
            result = await self.ctx.fleet.generate(self.ctx.channels, prompt, max_tokens,
                                                   engine, timeout_s)
        except UnknownEngine as exc:
            return _error(404, str(exc))
        except (NoEngineReady, RequestFailed) as exc:
            return _error(503, str(exc))
        return web.json_response({
            "engine": result.engine, "text": result.text,
            "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "batch_size": result.batch_size, "queue_s": result.queue_s,
            "compute_s": result.compute_s, "total_s": time.monotonic() - started})

    async def reload(self, request: web.Request) -> web.Response:
        if self.ctx.reload is None:
            return _error(501, "reload is not available in this daemon")
        try:
            return web.json_response(await self.ctx.reload())
        except ReloadRejected as exc:
            return _error(400, str(exc))


async def _settle(replica: Replica, action: str, before: EngineView, wait: bool,
                  timeout_s: float) -> dict[str, Any]:
    """Wait (if asked) until the engine reached the action's target state, then report it."""
    needs_new = action == "restart" or before.pid is None

    def done(v: EngineView) -> bool:
        if action == "stop":
            return v.state is EngineState.STOPPED and v.pid is None
        if not v.wanted:
            return True  # someone stopped it meanwhile
        fresh = v.incarnation > before.incarnation or not needs_new
        return fresh and v.state in (EngineState.READY, EngineState.FAILED)

    ok, error = True, None
    if wait:
        reached = await replica.wait_for(done, timeout_s)
    view = replica.view()
    if wait:
        target = "STOPPED" if action == "stop" else "READY"
        ok = reached and view.state.value == target
        if not reached:
            error = f"not {target} within {timeout_s:g}s (state {view.state.value})"
        elif not ok:
            error = view.fail_reason or f"ended {view.state.value}"
    return {"name": view.name, "state": view.state.value, "pid": view.pid, "ok": ok,
            "error": error}


async def _follow(request: web.Request, replica: Replica, head: str) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8"})
    await response.prepare(request)
    queue = replica.log.follow()
    try:
        await response.write(head.encode())
        while (line := await queue.get()) is not None:
            await response.write(f"{line}\n".encode())
    except ConnectionResetError:
        pass  # the follower went away
    finally:
        replica.log.unfollow(queue)
    return response


def engine_status(view: EngineView, sample: Sample) -> dict[str, Any]:
    """The status JSON of one engine (DESIGN "GET /v1/status")."""
    tree = sample.trees.get(view.pid) if view.pid is not None else None
    hb, ready = view.heartbeat, view.ready
    return {
        "name": view.name, "group": view.group, "rank": view.rank,
        "state": view.state.value, "desired": "run" if view.wanted else "stopped",
        "pid": view.pid, "incarnation": view.incarnation, "restarts": view.restarts,
        "restarts_by_reason": dict(view.restarts_by_reason),
        "since": view.since, "startup_s": view.startup_s,
        "heartbeat_age_s": view.heartbeat_age_s,
        "phase": view.phase, "model": view.model,
        # What the current incarnation's READY reported (None until it is READY).
        "device": ready.device if ready else None,
        "dtype": ready.dtype if ready else None,
        "restart_at": view.restart_at,
        "fail_reason": view.fail_reason or None,
        "last_exit": view.last_exit.to_json() if view.last_exit else None,
        "last_cleanup": view.last_cleanup or None,
        "gpus": list(view.gpus), "rss_bytes": tree.rss_bytes if tree else None,
        "queue": {"waiting": hb.waiting, "running": hb.running} if hb else None,
        "gpu_memory": _gpu_memory(view, sample),
    }


def _gpu_memory(view: EngineView, sample: Sample) -> list[dict[str, Any]]:
    """torch's figures from the heartbeat, joined with NVML's per-process figure per GPU."""
    hb = view.heartbeat
    nvml = {d.index: d.process_bytes.get(view.pid) for d in sample.gpus} if view.pid else {}
    torch_by_gpu = {m.gpu: m for m in (hb.gpu_memory if hb else [])}
    rows = []
    for gpu in view.gpus:
        mem = torch_by_gpu.get(gpu)
        rows.append({"gpu": gpu,
                     "allocated_bytes": mem.allocated_bytes if mem else None,
                     "reserved_bytes": mem.reserved_bytes if mem else None,
                     "peak_bytes": mem.peak_bytes if mem else None,
                     "used_bytes": nvml.get(gpu)})
    return rows
