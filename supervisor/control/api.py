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
from typing import Any, Awaitable, Callable, Protocol

from aiohttp import web

from engined.engine import protocol as proto
from engined.supervisor import __version__, bodies
from engined.supervisor import request_fields as fields
from engined.supervisor.control.events import EventLog
from engined.supervisor.ipc import EngineChannels, RequestFailed, RequestStream, new_request_id
from engined.supervisor.lifecycle.fleet import Fleet, UnknownEngine
from engined.supervisor.lifecycle.replica import Replica
from engined.supervisor.lifecycle.state import EngineState
from engined.supervisor.lifecycle.view import EngineView
from engined.supervisor.observe.sampler import Sample, Sampler
from engined.supervisor.routing.replicas import ReplicaLease, Router
from engined.supervisor.routing.routes import NoReplica
from engined.supervisor.spec.reload import ReloadRejected
from engined.supervisor.upgrade.handover import HandoverRejected
from engined.supervisor.webserver import LONG_LIVED, ApiKey, BodyTimeout, read_body

log = logging.getLogger("engined.control")

MAX_BODY_BYTES = 64 * 1024
GENERATE_MAX_TOKENS = 64  # POST /v1/generate's default token budget


class SleepWake(Protocol):
    """On-demand engines (routing.ondemand): what `enginectl sleep`, `wake` and status use."""

    def sleep(self, name: str, reason: str) -> Any: ...

    def wake(self, name: str, reason: str) -> Any: ...

    def blocked_by(self, name: str) -> str | None: ...

    def stuck_waking(self, name: str) -> bool: ...

    def status_of(self, name: str) -> dict[str, Any] | None: ...


class ControlContext:
    """What the routes need; built once by the daemon."""

    def __init__(self, fleet: Fleet, router: Router, channels: EngineChannels, sampler: Sampler,
                 events: EventLog, config_path: str,
                 reload: Callable[[], Awaitable[dict]] | None = None,
                 fork_servers: Callable[[], list[dict[str, Any]]] = list,
                 ondemand: SleepWake | None = None) -> None:
        self.fleet = fleet
        self.router = router
        self.channels = channels
        self.sampler = sampler
        self.events = events  # state transitions (published by the replicas)
        self.config_path = config_path
        self.reload = reload
        self.fork_servers = fork_servers  # the launcher's
        self.started = time.time()
        self.generation = 1
        # the daemon's (supervisor.handover): an upgrade in place, and what status says of it
        self.upgrade: Callable[[asyncio.Event, float], Awaitable[dict]] | None = None
        self.handover_info: Callable[[], dict[str, Any]] = dict
        self.ondemand = ondemand  # sleep and wake (routing.ondemand)


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


def _bearer(token: ApiKey) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Any) -> Any:
        if not token.allows(request.headers.get("Authorization")):
            return _error(401, "a bearer token is required (the one in engined's "
                               "control_token_file): enginectl --token-file FILE")
        return await handler(request)
    return check


@web.middleware
async def _errors_as_json(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.reason)


def make_app(ctx: ControlContext, token: ApiKey | None = None) -> web.Application:
    """The control API; `token`: on TCP (supervisor.control_tcp), every request must bring it
    (401 otherwise), in place of the unix socket's peer check."""
    middlewares = [_errors_as_json, _peer_check]
    if token is not None:
        middlewares.append(_bearer(token))
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    routes = _Routes(ctx)
    app.router.add_get("/v1/status", routes.status)
    app.router.add_post("/v1/engines/{name}/{action}", routes.action)
    app.router.add_get("/v1/engines/{name}/logs", routes.logs)
    app.router.add_post("/v1/generate", routes.generate)
    app.router.add_post("/v1/reload", routes.reload)
    app.router.add_post("/v1/upgrade", routes.upgrade)
    app.router.add_get("/v1/events", routes.events)
    return app


async def _json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    if (request.content_length or 0) > MAX_BODY_BYTES:  # refuse now, not after waiting for it
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES,
                                            actual_size=request.content_length or 0)
    try:
        raw = await read_body(request)
    except BodyTimeout as exc:
        raise web.HTTPRequestTimeout(reason=str(exc)) from None
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


def generate_request(body: dict[str, Any] | bodies.GenerateBody) -> proto.GenerateRequest:
    """`POST /v1/generate`'s body (supervisor.bodies.GenerateBody) as the engine protocol's
    request; HTTPBadRequest names what is wrong. `prompt` (text or token ids) or `messages` (a
    chat), max_tokens (default 64), temperature (default 0: greedy) and the gateway's other
    sampling fields, with its limits."""
    try:
        ask = body if isinstance(body, bodies.GenerateBody) else read(body, bodies.GenerateBody)
        if ask.prompt is not None and ask.messages is not None:
            raise bodies.BadField("messages", "give either 'prompt' or 'messages' (a chat), "
                                              "not both")
        if ask.messages is None:
            prompt, prompt_ids = fields.prompt(ask.prompt)
            chat = None
        else:
            prompt, prompt_ids, chat = "", None, fields.messages(ask.messages)
        sampling = fields.sampling(ask, ask.max_tokens, GENERATE_MAX_TOKENS, 0.0)
    except fields.BadField as exc:
        raise web.HTTPBadRequest(reason=exc.message) from None
    return proto.GenerateRequest(new_request_id(), prompt=prompt, prompt_ids=prompt_ids,
                                 messages=chat, sampling=sampling, stream=bool(ask.stream))


def read(body: dict[str, Any], kind: type[bodies.B]) -> bodies.B:
    """A control request's body as its declaration (supervisor.bodies); HTTPBadRequest naming
    the field."""
    try:
        return bodies.read(body, kind)
    except bodies.BadField as exc:
        raise web.HTTPBadRequest(reason=exc.message) from None


class _Routes:
    def __init__(self, ctx: ControlContext) -> None:
        self.ctx = ctx

    async def status(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        supervisor = {"pid": os.getpid(), "version": __version__,
                      "uptime_s": round(time.time() - ctx.started, 3),
                      "config": ctx.config_path, "generation": ctx.generation,
                      "ipc_dropped": dict(ctx.channels.dropped),
                      "fork_servers": ctx.fork_servers(), **ctx.handover_info()}
        views = ctx.fleet.view().engines
        sample = await ctx.sampler.sample([v.pid for v in views if v.pid is not None])
        engines = [engine_status(v, sample) for v in views]
        if ctx.ondemand is not None:
            for engine in engines:
                engine["on_demand"] = ctx.ondemand.status_of(engine["name"])
        return web.json_response({"supervisor": supervisor, "engines": engines})

    async def action(self, request: web.Request) -> web.Response:
        action = request.match_info["action"]
        if action not in ("start", "stop", "restart", "sleep", "wake"):
            raise web.HTTPNotFound(reason=f"unknown action {action!r}")
        ask = read(await _json_body(request), bodies.ActionBody)
        wait, timeout_s, all_at_once = ask.wait, ask.timeout_s, ask.all_at_once
        fleet = self.ctx.fleet
        try:
            affected = fleet.affected(request.match_info["name"])
        except UnknownEngine as exc:
            return _error(404, str(exc))
        before = {r.name: r.view() for r in affected}
        if action in ("sleep", "wake"):
            return web.json_response({"engines": await self._on_demand(
                action, request.match_info["name"], affected, before, wait, timeout_s)})
        fleet.command(action, request.match_info["name"], all_at_once=all_at_once)
        results = await asyncio.gather(*(_settle(r, action, before[r.name], wait, timeout_s)
                                         for r in affected))
        return web.json_response({"engines": results})

    async def _on_demand(self, action: str, name: str, affected: list[Replica],
                         before: dict[str, EngineView], wait: bool,
                         timeout_s: float) -> list[dict[str, Any]]:
        """`enginectl sleep` / `wake`: a wake that the memory budget holds back says why."""
        ondemand = self.ctx.ondemand
        assert ondemand is not None
        getattr(ondemand, action)(name, "operator")
        if action == "wake":  # one that only busy engines' memory keeps asleep fails at once
            stuck = [r for r in affected if ondemand.stuck_waking(r.name)]
            affected = [r for r in affected if r not in stuck]
        results = await asyncio.gather(*(_settle(r, action, before[r.name], wait, timeout_s)
                                         for r in affected))
        if action == "wake":
            results += [{"name": r.name, "state": r.state.value, "pid": None, "ok": False,
                         "error": "asleep"} for r in stuck]
        for result in results:
            blocked = ondemand.blocked_by(result["name"]) if action == "wake" else None
            if blocked and not result["ok"]:
                result["error"] = f"{result['error'] or 'asleep'}: {blocked}"
        return list(results)

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
        request[LONG_LIVED] = True
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
        ask = read(await _json_body(request), bodies.GenerateBody)
        gen = generate_request(ask)  # raises HTTPBadRequest naming the field
        engine, timeout_s = ask.engine, ask.timeout_s
        started = time.monotonic()
        try:
            lease, stream = await self._open(engine, gen, started + timeout_s)
        except UnknownEngine as exc:
            return _error(404, str(exc))
        except (NoReplica, RequestFailed) as exc:
            return _error(503, str(exc))
        try:
            if gen.stream:
                return await self._generate_stream(request, lease, stream, timeout_s, started)
            return await self._generate_whole(lease, stream, timeout_s, started)
        finally:
            stream.close()
            self.ctx.router.release(lease)

    async def _open(self, engine: str | None, gen: proto.GenerateRequest,
                    deadline: float) -> tuple[ReplicaLease, RequestStream]:
        """A replica of `engine` (a replica, a group; any when None) chosen by the router, and
        the request sent to it."""
        fleet, router = self.ctx.fleet, self.ctx.router
        replicas = fleet.resolve(engine) if engine else list(fleet.replicas.values())
        lease = await router.lease_for(replicas, engine, engine in fleet.replicas, deadline)
        try:
            return lease, self.ctx.channels.open(lease.incarnation.address, gen,
                                                 wake=router.peers(lease))
        except RequestFailed:
            router.release(lease)
            raise

    async def _generate_whole(self, lease: ReplicaLease, stream: RequestStream,
                              timeout_s: float, started: float) -> web.Response:
        replica = lease.replica
        try:
            result = await stream.result(timeout_s)
        except asyncio.TimeoutError:
            replica.count_request("timeout")
            return _error(503, f"{replica.name} did not answer within {timeout_s:g}s")
        except RequestFailed as exc:
            replica.count_request("error")
            return _error(503, str(exc))
        replica.count_request("ok" if result.error is None else "error")
        if result.error is not None:
            return _error(400 if result.rejected else 503, f"{result.engine}: {result.error}")
        return web.json_response({**_result_fields(result), "text": result.text,
                                  "total_s": time.monotonic() - started})

    async def _generate_stream(self, request: web.Request, lease: ReplicaLease,
                               stream: RequestStream, timeout_s: float,
                               started: float) -> web.StreamResponse:
        """NDJSON: one `{"text", "token_ids"}` line per chunk as tokens come, then a last line
        with `"done": true` and usage (or `{"error": ...}`)."""
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
            await _write_line(response, {"error": f"{lease.replica.name} did not finish within "
                                                  f"{timeout_s:g}s"})
        except RequestFailed as exc:
            await _write_line(response, {"error": str(exc)})
        except (ConnectionResetError, StopAsyncIteration):
            outcome = "error"  # the client went away (the stream's close aborts the request)
        finally:
            lease.replica.count_request(outcome)
        return response

    async def upgrade(self, request: web.Request) -> web.StreamResponse:
        """Check the installed engined, answer, then hand the engines over to it (the
        daemon's exec follows this answer)."""
        if self.ctx.upgrade is None:
            return _error(501, "upgrade is not available in this daemon")
        ask = read(await _json_body(request), bodies.UpgradeBody)
        answered = asyncio.Event()
        try:
            accepted = await self.ctx.upgrade(answered, ask.settle_s)
        except HandoverRejected as exc:
            return _error(409, str(exc))
        response = web.json_response(accepted, status=202)
        await response.prepare(request)
        await response.write_eof()
        answered.set()
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

    rest = {"stop": EngineState.STOPPED, "sleep": EngineState.ASLEEP}.get(action)

    def done(v: EngineView) -> bool:
        if rest is not None:  # asleep in place (vLLM's sleep mode) keeps its process
            return v.state is rest and (v.pid is None or rest is EngineState.ASLEEP)
        if action == "wake" and v.asleep:
            return False  # held back by the memory budget, or not yet woken
        if not v.wanted:
            return True  # someone stopped it meanwhile
        fresh = v.incarnation > before.incarnation or not needs_new
        return fresh and v.state in (EngineState.READY, EngineState.FAILED)

    ok, error = True, None
    if wait:
        reached = await replica.wait_for(done, timeout_s)
    view = replica.view()
    if wait:
        target = rest.value if rest is not None else "READY"
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
    request[LONG_LIVED] = True
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
        "state": view.state.value, "desired": view.desired,
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
        # engine.memory: the batch limit an out-of-memory step lowered, how many there were,
        # what is left under memory_limit (None where the backend has none of it)
        "batch_limit": hb.batch_limit if hb else None,
        "oom_total": view.oom_total,  # every incarnation's
        "memory": dict(ready.memory) if ready and ready.memory else None,
        "memory_headroom_bytes": hb.memory_headroom if hb else None,
        "gpu_memory": _gpu_memory(view, sample),
        "port": view.port,
        "launcher": view.launcher or None,
        "role": "standby" if view.standby else "serving",
        "adopted_at": view.adopted_at,
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
