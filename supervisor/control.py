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

from supervisor import __version__
from supervisor.fleet import Fleet, NoEngineReady, UnknownEngine
from supervisor.handle import Desired, EngineHandle
from supervisor.ipc import EngineChannels, RequestFailed
from supervisor.reload import ReloadRejected
from supervisor.sampler import Sample, Sampler
from supervisor.state import EngineState
from supervisor.webserver import CLIENT_TIMEOUT_S

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
                                            actual_size=request.content_length)
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
        handles = list(ctx.fleet.handles.values())
        sample = await ctx.sampler.sample([h.pid for h in handles if h.pid is not None])
        engines = [engine_status(h, sample) for h in handles]
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
            handles = fleet.resolve(request.match_info["name"])
        except UnknownEngine as exc:
            return _error(404, str(exc))
        before = {h.name: (h.incarnation, h.pid is not None)
                  for h in (*handles, *(m for h in handles if h.gang for m in h.gang.members))}
        handles = fleet.command(action, request.match_info["name"])
        results = await asyncio.gather(*(_settle(h, action, *before[h.name], wait, timeout_s)
                                         for h in handles))
        return web.json_response({"engines": results})

    async def logs(self, request: web.Request) -> web.StreamResponse:
        try:
            (handle,) = self.ctx.fleet.resolve(request.match_info["name"])
        except UnknownEngine as exc:
            return _error(404, str(exc))
        except ValueError:
            return _error(400, "logs take one replica name, not a group")
        try:
            lines = int(request.query.get("lines", "50"))
        except ValueError:
            return _error(400, "'lines' must be an integer")
        lines = max(0, min(lines, 100_000))
        head = "".join(f"{line}\n" for line in handle.log.last_lines(lines))
        if request.query.get("follow") not in ("1", "true"):
            return web.Response(text=head, content_type="text/plain")
        return await _follow(request, handle, head)

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


async def _settle(handle: EngineHandle, action: str, incarnation: int, was_running: bool,
                  wait: bool, timeout_s: float) -> dict[str, Any]:
    """Wait (if asked) until the engine reached the action's target state, then report it."""
    needs_new = action == "restart" or not was_running

    def done(h: EngineHandle) -> bool:
        if action == "stop":
            return h.state is EngineState.STOPPED and h.pid is None
        if h.desired is Desired.STOPPED:
            return True  # someone stopped it meanwhile
        fresh = h.incarnation > incarnation or not needs_new
        return fresh and h.state in (EngineState.READY, EngineState.FAILED)

    ok, error = True, None
    if wait:
        reached = await handle.wait_for(done, timeout_s)
        target = "STOPPED" if action == "stop" else "READY"
        ok = reached and handle.state.value == target
        if not reached:
            error = f"not {target} within {timeout_s:g}s (state {handle.state.value})"
        elif not ok:
            error = handle.fail_reason or f"ended {handle.state.value}"
    return {"name": handle.name, "state": handle.state.value, "pid": handle.pid, "ok": ok,
            "error": error}


async def _follow(request: web.Request, handle: EngineHandle, head: str) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8"})
    await response.prepare(request)
    queue = handle.log.follow()
    try:
        await response.write(head.encode())
        while (line := await queue.get()) is not None:
            await response.write(f"{line}\n".encode())
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        handle.log.unfollow(queue)
    return response


def engine_status(handle: EngineHandle, sample: Sample) -> dict[str, Any]:
    spec, hb, now = handle.spec, handle.heartbeat, time.monotonic()
    tree = sample.trees.get(handle.pid) if handle.pid is not None else None
    return {
        "name": handle.name, "group": spec.group, "rank": spec.rank,
        "state": handle.state.value, "desired": handle.desired.value, "pid": handle.pid,
        "incarnation": handle.incarnation, "restarts": handle.restarts.total(),
        "restarts_by_reason": {r.value: n for r, n in handle.restarts.items()},
        "since": handle.since, "startup_s": handle.startup_s,
        "heartbeat_age_s": (round(now - handle.last_heartbeat_at, 3)
                            if handle.last_heartbeat_at is not None and handle.pid else None),
        "phase": handle.phase, "model": spec.model.source,
        # What the current incarnation's READY reported (None until it is READY).
        "device": handle.ready_info.device if handle.ready_info else None,
        "dtype": handle.ready_info.dtype if handle.ready_info else None,
        "restart_at": (time.time() + handle.restart_at - now
                       if handle.restart_at is not None else None),
        "fail_reason": handle.fail_reason or None,
        "last_exit": handle.last_exit.to_json() if handle.last_exit else None,
        "last_cleanup": handle.cleanup or None,
        "gpus": list(spec.gpus), "rss_bytes": tree.rss_bytes if tree else None,
        "queue": {"waiting": hb.waiting, "running": hb.running} if hb else None,
        "gpu_memory": _gpu_memory(handle, sample),
    }


def _gpu_memory(handle: EngineHandle, sample: Sample) -> list[dict[str, Any]]:
    """torch's figures from the heartbeat, joined with NVML's per-process figure per GPU."""
    hb = handle.heartbeat if handle.pid is not None else None
    nvml = {d.index: d.process_bytes.get(handle.pid) for d in sample.gpus}
    torch_by_gpu = {m.gpu: m for m in (hb.gpu_memory if hb else [])}
    rows = []
    for gpu in handle.spec.gpus:
        mem = torch_by_gpu.get(gpu)
        rows.append({"gpu": gpu,
                     "allocated_bytes": mem.allocated_bytes if mem else None,
                     "reserved_bytes": mem.reserved_bytes if mem else None,
                     "peak_bytes": mem.peak_bytes if mem else None,
                     "used_bytes": nvml.get(gpu)})
    return rows
