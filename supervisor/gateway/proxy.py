"""Requests to command engines (servers engined did not write, `openai: true | vllm`), passed
through: the client's body goes upstream as it came and the upstream's answer and errors come
back as the upstream sent them. The gateway reads only what routing, limits and a move need:
`model` (rewritten to the upstream's own name and back), `stream`, and for a stream's move the
prompt or messages, the token budget and a few sampling fields.

A request whose server goes away (it exits, is declared hung or stalled, its connection breaks,
it answers 500/502/503/504) moves to another replica, never back to an incarnation it was lost on:

* before the client got any data (a whole answer, or a stream's first event), it is sent again as
  it came, whatever its fields;
* mid-stream it continues only where its meaning survives a move (`continuation_blocker`): an
  `openai: vllm` server returns the token ids of the prompt and of every token (asked for with
  `return_token_ids`, stripped from what the client sees unless it asked too), and the
  continuation is a completion of the original prompt's ids plus those delivered, its events
  reshaped like the original's. Otherwise the client gets an error event naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from engined.supervisor.gateway.openai import ApiError
from engined.supervisor.gateway.relay import acquire, moved
from engined.supervisor.gateway.upstream import Upstream
from engined.supervisor.ipc import EngineLost
from engined.supervisor.routing.routes import Lease, LostOn, Routes

log = logging.getLogger("engined.gateway")

RETRY_STATUS = frozenset({500, 502, 503, 504})  # the server failed, not the request
MAX_ERROR_BYTES = 1 << 20
_DECODE, _ENCODE = msgspec.json.Decoder().decode, msgspec.json.Encoder().encode
# Fields a moved stream keeps the meaning of (with these values: anything else, e.g. `n: 2`,
# tools or a response_format, limits a move to before the first event).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "prompt_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "structured_outputs": (None,), "use_beam_search": (None, False),
}
# Sampling fields a continuation carries over as they were sent.
_CARRIED = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
            "repetition_penalty", "logit_bias", "ignore_eos", "skip_special_tokens",
            "spaces_between_special_tokens", "include_stop_str_in_output", "user")


def continuation_blocker(body: dict[str, Any], path: str, vllm: bool) -> str | None:
    """Why a stream of this request could not continue on another replica once it has begun
    (None: it can)."""
    if not vllm:
        return "its server gives no token ids to continue from (openai: vllm servers do)"
    if path not in ("/v1/completions", "/v1/chat/completions"):
        return f"{path} is not a completion"
    for key, neutral in _NEUTRAL.items():
        if body.get(key) not in neutral:
            return f"'{key}' is set"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) \
            and len(prompt) > 1:
        return "'prompt' is a batch"
    return None


@dataclass
class _Progress:
    """What the client has seen of one streamed request, across its attempts."""

    delivered: list[int] = field(default_factory=list)  # generated token ids
    prompt_ids: list[int] | None = None  # the original prompt's (chat: its templated prompt)
    sent: bool = False  # an event reached the client: only a continuation can follow
    template: dict[str, Any] = field(default_factory=dict)  # id, object, created of its events


class Proxy:
    def __init__(self, router: Routes, upstream: Upstream, clock: Callable[[], float],
                 on_move: Callable[[str], None] = lambda model: None,
                 on_first: Callable[[str, float], None] = lambda model, s: None) -> None:
        self.router, self.upstream, self.clock, self.on_move = router, upstream, clock, on_move
        self.on_first = on_first  # (model, seconds to the first byte)

    async def forward(self, request: web.Request, path: str, body: dict[str, Any] | None,
                      model: str | None, group: str, deadline: float,
                      limit: int) -> tuple[str, web.StreamResponse]:
        """One client request on `group`'s servers; returns (outcome, response)."""
        if body is not None and body.get("stream") is True:
            assert model is not None
            return await _Stream(self, request, path, body, model, group, deadline,
                                 limit).run()
        return await self._whole(request, path, body, model, group, deadline, limit)

    async def _whole(self, request: web.Request, path: str, body: dict[str, Any] | None,
                     model: str | None, group: str, deadline: float,
                     limit: int) -> tuple[str, web.StreamResponse]:
        lost_on = LostOn(self.clock)
        moves, started = 0, self.clock()
        while True:
            lease = await self.acquire(group, deadline, lost_on)
            try:
                name = await self._upstream_name(lease, model) if model is not None else None
                answer = await self._call(lease, request.method, path, body, name, deadline)
                status, headers, data = answer
                if status not in RETRY_STATUS or moves >= limit:
                    if model is not None:
                        self.on_first(model, self.clock() - started)
                    return _outcome(status), web.Response(
                        status=status, body=_rename_json(data, name, model),
                        content_type=headers.get("Content-Type", "application/json")
                        .split(";")[0])
                lost = f"HTTP {status}"
            except (EngineLost, aiohttp.ClientError, ConnectionError, ValueError) as exc:
                lost = f"{type(exc).__name__}: {exc}"
            finally:
                self.router.release(lease)
            lost_on.add(lease.target, lost)
            moves = self.count_move(model or path, request, lease, lost, moves, limit, 0)

    def count_move(self, model: str, request: web.Request, lease: Lease, lost: str, moves: int,
              limit: int, delivered: int) -> int:
        moves = moved(request["request_id"], f"{lease.name}: {lost}", moves, limit,
                      delivered)
        self.on_move(model)
        return moves

    async def acquire(self, group: str, deadline: float, avoid: LostOn) -> Lease:
        return await acquire(self.router, group, deadline, avoid)

    async def _upstream_name(self, lease: Lease, model: str) -> str:
        if lease.served_as is not None:
            return lease.served_as
        return await self.upstream.model_name(lease.name, lease.address, lease.endpoint[1])

    async def _call(self, lease: Lease, method: str, path: str, body: dict[str, Any] | None,
                    name: str | None, deadline: float) -> tuple[int, dict[str, str], bytes]:
        """One whole exchange with the lease's server; EngineLost if its incarnation goes."""
        sent = None if body is None else json.dumps(_renamed(body, name)).encode()
        async with self.upstream.flight(lease.address, lease.name) as lost:
            call = self.upstream.fetch(lease.endpoint, method, path, sent)
            return await _until(call, lost, deadline - self.clock())


class _Stream:
    """One streamed request: its events to the client as they come, across moves."""

    def __init__(self, proxy: Proxy, request: web.Request, path: str, body: dict[str, Any],
                 model: str, group: str, deadline: float, limit: int) -> None:
        self.proxy, self.request, self.path, self.body = proxy, request, path, body
        self.model, self.group, self.deadline, self.limit = model, group, deadline, limit
        self.vllm = proxy.router.route_of(group).vllm
        self.blocker = continuation_blocker(body, path, self.vllm)
        self.wants_ids = bool(body.get("return_token_ids"))
        self.chat = path == "/v1/chat/completions"
        self.progress = _Progress()
        self.response: web.StreamResponse | None = None
        self.continuing = False  # this attempt continues what an earlier one began
        self.started = proxy.clock()

    async def run(self) -> tuple[str, web.StreamResponse]:
        """Errors after the stream began are an `error` event (the status line is sent)."""
        try:
            return await self._moves()
        except ApiError as exc:
            if self.response is None:
                raise
            await self._send(exc.body())
            await self.response.write(b"data: [DONE]\n\n")
            return "timeout" if exc.code == "timeout" else "error", self.response
        except (ConnectionResetError, RuntimeError):
            if self.response is None:
                raise
            return "client_gone", self.response

    async def _moves(self) -> tuple[str, web.StreamResponse]:
        lost_on = LostOn(self.proxy.clock)
        moves = 0
        while True:
            lease = await self.proxy.acquire(self.group, self.deadline, lost_on)
            try:
                done = await self._attempt(lease)
                if done is not None:
                    return done
                lost = "the stream ended before the answer did"
            except _Lost as exc:
                lost = str(exc)
            finally:
                self.proxy.router.release(lease)
            lost_on.add(lease.target, lost)
            if self.progress.sent and self.blocker is not None:
                return await self._cannot_continue(lease, lost)
            moves = self.proxy.count_move(self.model, self.request, lease, lost, moves, self.limit,
                                     len(self.progress.delivered))

    async def _attempt(self, lease: Lease) -> tuple[str, web.StreamResponse] | None:
        """Stream one attempt to the client. The outcome when it ended the request (an answer,
        or an error the client must see); None, or _Lost, when it must move."""
        proxy = self.proxy
        try:
            name = await proxy._upstream_name(lease, self.model)
        except (EngineLost, aiohttp.ClientError, ConnectionError, ValueError) as exc:
            raise _Lost(f"{type(exc).__name__}: {exc}") from None
        path, body = self._request(name)
        upstream = proxy.upstream
        async with upstream.flight(lease.address, lease.name) as lost:
            try:
                response = await _until(upstream.open(lease.endpoint, path,
                                                      json.dumps(body).encode()),
                                        lost, self.deadline - proxy.clock())
                try:
                    if response.status != 200:
                        return await self._refused(response, name)
                    async with contextlib.aclosing(_events(response, lost, self.deadline,
                                                           proxy.clock)) as reads:
                        async for events in reads:
                            if await self._relay(events, name):
                                assert self.response is not None
                                return "ok", self.response
                finally:
                    response.close()
            except (EngineLost, aiohttp.ClientError, ConnectionError, ValueError) as exc:
                raise _Lost(f"{type(exc).__name__}: {exc}") from None
        return None

    def _request(self, name: str) -> tuple[str, dict[str, Any]]:
        """The body of this attempt: the client's as it came, or a continuation."""
        progress = self.progress
        self.continuing = progress.sent
        if not progress.sent:
            body = _renamed(self.body, name)
            if self.vllm and self.blocker is None:
                body["return_token_ids"] = True
            return self.path, body
        assert progress.prompt_ids is not None
        body = {key: self.body[key] for key in _CARRIED if key in self.body}
        budget = self.body.get("max_completion_tokens", self.body.get("max_tokens"))
        if budget is not None:
            body["max_tokens"] = max(1, int(budget) - len(progress.delivered))
        if self.body.get("min_tokens"):
            body["min_tokens"] = max(0, int(self.body["min_tokens"]) - len(progress.delivered))
        body.update(model=name, prompt=progress.prompt_ids + progress.delivered, stream=True,
                    return_token_ids=True,
                    stream_options={"include_usage": True, "continuous_usage_stats": False})
        return "/v1/completions", body

    async def _refused(self, response: aiohttp.ClientResponse,
                       name: str) -> tuple[str, web.StreamResponse] | None:
        """The server answered something else than a stream: a refusal reaches the client as
        it came (before anything was sent); a server failure is a move."""
        data = await response.content.read(MAX_ERROR_BYTES)
        if response.status in RETRY_STATUS:
            raise _Lost(f"HTTP {response.status}: {data[:200].decode(errors='replace')}")
        if self.progress.sent:  # a continuation refused: the client's stream cannot go on
            raise ApiError(503, f"the continuation was refused: HTTP {response.status}: "
                                f"{data[:300].decode(errors='replace')}", kind="server_error",
                           code="cannot_resume")
        return _outcome(response.status), web.Response(
            status=response.status, body=_rename_json(data, name, self.model),
            content_type=response.headers.get("Content-Type", "application/json").split(";")[0])

    async def _relay(self, events: list[bytes], name: str) -> bool:
        """Forward one read's `data:` events to the client in one write; True at the end of
        the answer. Events before one that fails the attempt still reach the client."""
        out: list[bytes] = []
        done = False
        try:
            for event in events:
                if event == b"[DONE]":
                    done = True
                    break
                out.append(b"data: " + self._event(event, name) + b"\n\n")
        finally:
            if out or done:
                await self._write(b"".join(out) + (b"data: [DONE]\n\n" if done else b""),
                                  counts=bool(out))
        return done

    def _event(self, event: bytes, name: str) -> bytes:
        """One upstream event as the client sees it; its token ids are counted as delivered."""
        chunk = _decoded(event)
        if not isinstance(chunk, dict):
            raise ValueError(f"not an event object: {event[:100]!r}")
        if "error" in chunk and not chunk.get("choices"):  # the server failed it mid-way
            raise _Lost(f"error event: {str(chunk['error'])[:200]}")
        progress = self.progress
        progress.delivered.extend(self._ids(chunk))
        if self.continuing:
            chunk = self._reshaped(chunk)
        else:
            for key in ("id", "object", "created"):
                if key in chunk:
                    progress.template[key] = chunk[key]
        return _ENCODE(_scrubbed(chunk, name, self.model, self.wants_ids))

    def _ids(self, chunk: dict[str, Any]) -> list[int]:
        progress = self.progress
        if progress.prompt_ids is None and chunk.get("prompt_token_ids") is not None:
            progress.prompt_ids = [int(t) for t in chunk["prompt_token_ids"]]
        ids: list[int] = []
        for choice in chunk.get("choices") or ():
            if progress.prompt_ids is None and choice.get("prompt_token_ids") is not None:
                progress.prompt_ids = [int(t) for t in choice["prompt_token_ids"]]
            ids += [int(t) for t in choice.get("token_ids") or ()]
        return ids

    def _reshaped(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """A continuation's completion event in the shape of the original request's events."""
        progress = self.progress
        out: dict[str, Any] = {**chunk, **progress.template}
        choices = []
        for choice in chunk.get("choices") or ():
            text = choice.get("text") or ""
            if self.chat:
                new = {"index": 0, "delta": {"content": text} if text else {},
                       "logprobs": None, "finish_reason": choice.get("finish_reason")}
            else:
                new = {"index": 0, "text": text, "logprobs": None,
                       "finish_reason": choice.get("finish_reason")}
            if "token_ids" in choice:
                new["token_ids"] = choice["token_ids"]
            if "stop_reason" in choice:
                new["stop_reason"] = choice["stop_reason"]
            choices.append(new)
        out["choices"] = choices
        usage = chunk.get("usage")
        if usage:  # the original prompt, and every token delivered across the attempts
            prompt_tokens, completion = len(progress.prompt_ids or ()), len(progress.delivered)
            out["usage"] = {**usage, "prompt_tokens": prompt_tokens,
                            "completion_tokens": completion,
                            "total_tokens": prompt_tokens + completion}
        return out

    async def _open(self) -> web.StreamResponse:
        if self.response is None:
            self.response = web.StreamResponse(headers={
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Request-Id": self.request["request_id"]})
            await self.response.prepare(self.request)
        return self.response

    async def _send(self, chunk: dict[str, Any]) -> None:
        await self._write(b"data: " + _ENCODE(chunk) + b"\n\n")

    async def _write(self, data: bytes, counts: bool = True) -> None:
        """`data` to the client; `counts`: it holds an event (not only the end marker), after
        which only a continuation may follow."""
        if counts and not self.progress.sent:
            self.proxy.on_first(self.model, self.proxy.clock() - self.started)
        response = await self._open()
        if counts:
            self.progress.sent = True
        await response.write(data)

    async def _cannot_continue(self, lease: Lease, lost: str) -> tuple[str, web.StreamResponse]:
        error = ApiError(503, f"the request's engine {lease.name} went away mid-stream "
                              f"({lost}) and it cannot continue elsewhere: {self.blocker}",
                         kind="server_error", code="cannot_resume",
                         headers={"Retry-After": "1"})
        await self._send(error.body())
        assert self.response is not None
        await self.response.write(b"data: [DONE]\n\n")
        return "error", self.response


class _Lost(Exception):
    """The attempt's server went away: the request moves (or, mid-stream, may not)."""


async def _until(call: Any, lost: asyncio.Future[None], timeout_s: float) -> Any:
    """`call`'s result, EngineLost if the incarnation goes first, ApiError 503 at the deadline."""
    task = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait({task, lost}, timeout=max(0.0, timeout_s),
                                     return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task in done:
        return task.result()
    task.cancel()
    if lost in done:
        lost.result()  # raises its EngineLost
    raise _timeout()


async def _events(response: aiohttp.ClientResponse, lost: asyncio.Future[None],
                  deadline: float, clock: Callable[[], float]
                  ) -> AsyncGenerator[list[bytes], None]:
    """The `data:` payloads of a server-sent event stream, a read's worth at a time, until it
    ends. The incarnation's loss (EngineLost) or the deadline (ApiError) fails the read in
    progress, or the next one: no task or timer per read, which a token's event would pay."""
    content = response.content

    def on_lost(future: asyncio.Future[None]) -> None:
        error = None if future.cancelled() else future.exception()
        if error is not None:
            content.set_exception(error)

    loop = asyncio.get_running_loop()
    timer = loop.call_later(max(0.0, deadline - clock()), content.set_exception, _timeout())
    lost.add_done_callback(on_lost)
    pending = b""
    try:
        while data := await content.readany():
            *lines, pending = (pending + data).split(b"\n")
            events = [line[5:].strip() for line in lines if line.startswith(b"data:")]
            if events:
                yield events
    finally:
        timer.cancel()
        lost.remove_done_callback(on_lost)


def _decoded(event: bytes) -> Any:
    try:
        return _DECODE(event)
    except msgspec.DecodeError:  # what msgspec does not read (NaN, say), the json module may
        return json.loads(event)


def _timeout() -> ApiError:
    return ApiError(503, "the request did not finish within its request_timeout",
                    kind="server_error", code="timeout", headers={"Retry-After": "5"})


def _outcome(status: int) -> str:
    if status < 400:
        return "ok"
    return "rejected" if status < 500 else "error"


def _renamed(body: dict[str, Any], name: str | None) -> dict[str, Any]:
    return {**body, "model": name} if name is not None and "model" in body else dict(body)


def _rename_json(data: bytes, upstream: str | None, model: str | None) -> bytes:
    """The upstream's JSON answer with its model name put back to the one the client used."""
    if upstream is None or model is None or upstream == model:
        return data
    try:
        answer = json.loads(data)
    except ValueError:
        return data
    if isinstance(answer, dict) and answer.get("model") == upstream:
        answer["model"] = model
        return json.dumps(answer).encode()
    return data


def _scrubbed(chunk: dict[str, Any], upstream: str, model: str,
              wants_ids: bool) -> dict[str, Any]:
    """An event for the client: its model name, without the token ids engined asked for."""
    if chunk.get("model") == upstream:
        chunk = {**chunk, "model": model}
    if not wants_ids:
        chunk.pop("prompt_token_ids", None)
        choices = chunk.get("choices")
        if choices:
            chunk["choices"] = [{k: v for k, v in c.items()
                                 if k not in ("token_ids", "prompt_token_ids")}
                                if isinstance(c, dict) else c for c in choices]
    return chunk
