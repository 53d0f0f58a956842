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

from engined.engine import protocol as proto
from engined.supervisor import __version__
from engined.supervisor.events import EventLog
from engined.supervisor.fleet import Fleet, NoEngineReady, UnknownEngine
from engined.supervisor.ipc import EngineChannels, RequestFailed, new_request_id
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
        self.fork_servers: Callable[[], list[dict[str, Any]]] = list  # the launcher's
        self.events = EventLog()  # state transitions (the daemon publishes them)


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
    app.router.add_get("/v1/events", routes.events)
    return app


async def _json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    if (request.content_length or 0) > MAX_BODY_BYTES:  # refuse now, not after waiting for it
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES,
                                            actual_size=request.content_length or 0)
    try:
        if request.content.is_eof():  # the whole body is here (a small one usually is)
            raw = await request.read()
        else:
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


def _result_fields(result: proto.GenerateResult) -> dict[str, Any]:
    return {"engine": result.engine, "finish_reason": result.finish_reason,
            "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "batch_size": result.batch_size, "queue_s": result.queue_s,
            "compute_s": result.compute_s}


async def _write_line(response: web.StreamResponse, data: dict[str, Any]) -> bool:
    """False if the client went away."""
    try:
        await response.write(json.dumps(data).encode() + b"\n")
    except (ConnectionResetError, RuntimeError):
        return False
    return True


def generate_request(body: dict[str, Any]) -> proto.GenerateRequest:
    """`POST /v1/generate`'s body as the engine protocol's request; HTTPBadRequest names what is
    wrong. `prompt` (text) or `messages` (a chat), max_tokens, temperature (0: greedy, the
    default), top_p, seed, stop (a string or a list), stream."""
    prompt, messages = body.get("prompt"), body.get("messages")
    if prompt is not None and messages is not None:
        raise web.HTTPBadRequest(reason="give either 'prompt' or 'messages' (a chat), not both")
    chat = None
    if messages is None:
        _check_text(prompt, "prompt")
    else:
        if not isinstance(messages, list) or not messages or len(messages) > 256:
            raise web.HTTPBadRequest(reason="'messages' must be a non-empty list (at most 256)")
        chat = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or set(m) != {"role", "content"} \
                    or m["role"] not in ("system", "user", "assistant"):
                raise web.HTTPBadRequest(reason=f"'messages[{i}]' must be {{role: system|user|"
                                                f"assistant, content: TEXT}}")
            _check_text(m["content"], f"messages[{i}].content", empty_ok=True)
            chat.append(proto.ChatMessage(m["role"], m["content"]))
    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 8 or not all(
            isinstance(x, str) and 0 < len(x) <= 256 and _is_unicode(x) for x in stop):
        raise web.HTTPBadRequest(reason="'stop' must be a string or a list of at most 8 "
                                        "non-empty strings")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not 0 <= seed < 2**63):
        raise web.HTTPBadRequest(reason="'seed' must be a non-negative integer or null")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise web.HTTPBadRequest(reason="'stream' must be true or false")
    sampling = proto.Sampling(max_tokens=int(_number(body, "max_tokens", 64, 1, 65536)),
                              temperature=_number(body, "temperature", 0.0, 0, 2),
                              top_p=_number(body, "top_p", 1.0, 1e-9, 1), seed=seed, stop=stop)
    return proto.GenerateRequest(new_request_id(), prompt=prompt or "", messages=chat,
                                 sampling=sampling, stream=stream)


def _check_text(value: Any, name: str, empty_ok: bool = False) -> None:
    if not isinstance(value, str) or (not value and not empty_ok) \
            or len(value) > MAX_PROMPT_CHARS:
        raise web.HTTPBadRequest(reason=f"'{name}' must be a {'' if empty_ok else 'non-empty '}"
                                        f"string of at most {MAX_PROMPT_CHARS} characters")
    if not _is_unicode(value):
        raise web.HTTPBadRequest(reason=f"'{name}' must be valid Unicode (JSON allows lone "
                                        "surrogate escapes such as \\ud800; text cannot hold "
                                        "them)")


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
                      "ipc_dropped": dict(ctx.channels.dropped),
                      "fork_servers": ctx.fork_servers()}
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
        all_at_once = body.get("all_at_once", False)
        if not isinstance(all_at_once, bool):
            raise web.HTTPBadRequest(reason="'all_at_once' must be true or false")
        fleet = self.ctx.fleet
        try:
            affected = fleet.affected(request.match_info["name"])
        except UnknownEngine as exc:
            return _error(404, str(exc))
        before = {r.name: r.view() for r in affected}
        fleet.command(action, request.match_info["name"], all_at_once=all_at_once)
        results = await asyncio.gather(*(_settle(r, action, before[r.name], wait, timeout_s)
                                         for r in affected))
        return web.json_response({"engines": results})

    async def events(self, request: web.Request) -> web.StreamResponse:
        """State transitions as JSON lines: the last `lines` (default 100), then, with
        `follow=1`, each new one as it happens until the client goes away."""
        try:
            lines = int(request.query.get("lines", "100"))
        except ValueError:
            return _error(400, "'lines' must be an integer")
        events = self.ctx.events
        recent = list(events.recent)[-max(0, lines):] if lines > 0 else []
        head = "".join(json.dumps(e) + "\n" for e in recent)
        if request.query.get("follow") not in ("1", "true"):
            return web.Response(text=head, content_type="application/x-ndjson")
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        queue = events.follow()
        try:
            await response.write(head.encode())
            while True:
                await response.write((json.dumps(await queue.get()) + "\n").encode())
        except ConnectionResetError:
            pass  # the follower went away
        finally:
            events.unfollow(queue)
        return response

    async def logs(self, request: web.Request) -> web.StreamResponse:
        """One replica's log; for a group (or `all`), every replica's, each line prefixed with
        its replica's name (the last N lines of each in turn, then new lines as they come)."""
        try:
            replicas = self.ctx.fleet.resolve(request.match_info["name"])
        except UnknownEngine as exc:
            return _error(404, str(exc))
        try:
            lines = int(request.query.get("lines", "50"))
        except ValueError:
            return _error(400, "'lines' must be an integer")
        lines = max(0, min(lines, 100_000))
        width = max(len(r.name) for r in replicas)
        prefixes = {r.name: "" if len(replicas) == 1 else f"{r.name:<{width}} | "
                    for r in replicas}
        head = "".join(f"{prefixes[r.name]}{line}\n" for r in replicas
                       for line in r.log.last_lines(lines))
        if request.query.get("follow") not in ("1", "true"):
            return web.Response(text=head, content_type="text/plain")
        return await _follow(request, replicas, prefixes, head)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        engine = body.get("engine")
        if engine is not None and not isinstance(engine, str):
            return _error(400, "'engine' must be a string or null")
        gen = generate_request(body)  # raises HTTPBadRequest naming the field
        timeout_s = _number(body, "timeout_s", 300, 0.001, 3600)
        started = time.monotonic()
        fleet, channels = self.ctx.fleet, self.ctx.channels
        if gen.stream:
            return await self._generate_stream(request, gen, engine, timeout_s, started)
        try:
            result = await fleet.generate(channels, gen, engine, timeout_s)
        except UnknownEngine as exc:
            return _error(404, str(exc))
        except (NoEngineReady, RequestFailed) as exc:
            return _error(503, str(exc))
        if result.error is not None:
            return _error(400 if result.rejected else 503, f"{result.engine}: {result.error}")
        return web.json_response({**_result_fields(result), "text": result.text,
                                  "total_s": time.monotonic() - started})

    async def _generate_stream(self, request: web.Request, gen: proto.GenerateRequest,
                               engine: str | None, timeout_s: float,
                               started: float) -> web.StreamResponse:
        """NDJSON: one `{"text", "token_ids"}` line per chunk as tokens come, then a last line
        with `"done": true` and usage (or `{"error": ...}`)."""
        try:
            replica, stream = self.ctx.fleet.open_request(self.ctx.channels, gen, engine)
        except UnknownEngine as exc:
            return _error(404, str(exc))
        except (NoEngineReady, RequestFailed) as exc:
            return _error(503, str(exc))
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        outcome = "error"
        try:
            await response.prepare(request)
            deadline = started + timeout_s
            while True:
                left = deadline - time.monotonic()
                item = await stream.next(max(left, 0.001))
                if isinstance(item, proto.TokenChunk):
                    if not await _write_line(response, {"text": item.text,
                                                        "token_ids": item.token_ids}):
                        break  # the client went away: the stream's close aborts the request
                    continue
                if item.error is not None:
                    await _write_line(response, {"error": f"{item.engine}: {item.error}"})
                else:
                    outcome = "ok"
                    await _write_line(response, {**_result_fields(item), "done": True,
                                                 "text": item.text, "token_ids": item.token_ids,
                                                 "total_s": time.monotonic() - started})
                break
        except asyncio.TimeoutError:
            outcome = "timeout"
            await _write_line(response, {"error": f"{replica.name} did not finish within "
                                                  f"{timeout_s:g}s"})
        except RequestFailed as exc:
            await _write_line(response, {"error": str(exc)})
        except (ConnectionResetError, StopAsyncIteration):
            outcome = "error"  # the client went away (the stream's close aborts the request)
        finally:
            stream.close()
            replica.count_request(outcome)
        return response

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


async def _follow(request: web.Request, replicas: list[Replica], prefixes: dict[str, str],
                  head: str) -> web.StreamResponse:
    """New lines of every replica named, interleaved as they come, until the follower leaves
    or every log closed."""
    response = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8"})
    await response.prepare(request)
    queue: asyncio.Queue[str | None] = asyncio.Queue()
    for replica in replicas:
        replica.log.follow(queue, prefixes[replica.name])
    open_logs = len(replicas)
    try:
        await response.write(head.encode())
        while open_logs:
            line = await queue.get()
            if line is None:  # that log closed (its replica was removed)
                open_logs -= 1
                continue
            await response.write(f"{line}\n".encode())
    except ConnectionResetError:
        pass  # the follower went away
    finally:
        for replica in replicas:
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
        "port": view.port,
        "launcher": view.launcher or None,
        "role": "standby" if view.standby else "serving",
    }


def _gpu_memory(view: EngineView, sample: Sample) -> list[dict[str, Any]]:
    """torch's figures from the heartbeat, joined with NVML's per-process figure per GPU."""
    hb = view.heartbeat
    tree = sample.trees.get(view.pid) if view.pid is not None else None
    nvml = {d.index: tree.gpu_bytes(d) for d in sample.gpus} if tree is not None else {}
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
