"""A request on a command engine's own OpenAI API (`openai: true` / `openai: vllm`).

The relay treats it like a request on one of engined's engines: `Upstream.open` returns a
stream of the engine protocol's TokenChunks and then a GenerateResult, and a replica that goes
away ends it with EngineLost, so routing, retries and moves are the relay's as before. Upstream,
the request is always streamed, with the upstream's own model name (`GET /v1/models`, asked once
per incarnation). The first attempt is the client's completion or chat as it came. A move after
tokens were delivered needs their ids: vLLM returns them (`return_token_ids`, sent when the
engine is `openai: vllm`), and the continuation is a completion whose prompt is the original
prompt's ids plus the delivered ones (chat included: its templated prompt's ids come with the
first chunk). A plain OpenAI server gives no ids, so its stream cannot continue elsewhere: the
client gets an error event. A stop string that straddles a move is not caught (the upstream
checks only its own output).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from engined.engine import protocol as proto
from engined.supervisor.gateway.openai import ApiError, Job
from engined.supervisor.ipc import EngineLost
from engined.supervisor.notices import Lost
from engined.supervisor.routing import Lease

log = logging.getLogger("engined.gateway")

MAX_LINE_BYTES = 1 << 20
Item = proto.TokenChunk | proto.GenerateResult


class Upstream:
    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._names: dict[tuple[str, int], str] = {}  # incarnation's address -> model name
        self._open: set[UpstreamStream] = set()

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
                auto_decompress=False, read_bufsize=1 << 16)
        return self._session

    def open(self, lease: Lease, job: Job, request_id: str, delivered: list[int],
             memo: dict[str, Any]) -> UpstreamStream:
        """`memo` lives as long as the client request: the original prompt's ids and size."""
        name = lease.replica.name
        if lease.incarnation.port is None:
            raise EngineLost(f"{name} has no port", name, "has no port")
        stream = UpstreamStream(self, lease, job, request_id, delivered, memo)
        self._open.add(stream)
        return stream

    def on_lost(self, lost: Lost) -> None:
        """The incarnation is gone: end its requests now (a descendant might keep a socket)."""
        for stream in list(self._open):
            if stream.address == lost.address:
                stream.lost = f"{stream.engine} {lost.why}"
                stream.close()
        self._names.pop(lost.address, None)

    async def model_name(self, engine: str, address: tuple[str, int], port: int) -> str:
        """The upstream's own model name (`GET /v1/models`), asked once per incarnation."""
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

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class UpstreamStream:
    def __init__(self, upstream: Upstream, lease: Lease, job: Job, request_id: str,
                 delivered: list[int], memo: dict[str, Any]) -> None:
        self.upstream, self.job, self.id = upstream, job, request_id
        self.engine, self.incarnation = lease.replica.name, lease.replica.incarnation
        self.address, self.port = lease.incarnation.address, lease.incarnation.port
        self.vllm = lease.replica.spec.openai == "vllm"
        self.delivered, self.memo = list(delivered), memo
        self.lost: str | None = None
        self._response: aiohttp.ClientResponse | None = None
        self._iterator: AsyncIterator[Item] | None = None

    def close(self) -> None:
        self.upstream._open.discard(self)
        if self._response is not None:
            self._response.close()  # drops the connection: the server aborts the request

    def __aiter__(self) -> AsyncIterator[Item]:
        return self._items()

    async def next(self, timeout_s: float | None = None) -> Item:
        """The next item, as `RequestStream.next`: StopAsyncIteration at the end,
        asyncio.TimeoutError if none came within `timeout_s` (which ends the upstream request:
        the wait cancels it)."""
        if self._iterator is None:
            self._iterator = self._items()
        return await asyncio.wait_for(self._iterator.__anext__(), timeout_s)

    def _lost(self, why: str) -> EngineLost:
        return EngineLost(f"{self.engine}: {self.lost or why}", self.engine, self.lost or why)

    async def _items(self) -> AsyncIterator[Item]:
        assert self.port is not None
        try:
            path, body = await self._request()
            session = self.upstream.session()
            self._response = await session.post(f"http://127.0.0.1:{self.port}{path}",
                                                json=body)
            response = self._response
            if response.status >= 400:
                text = (await response.text())[:2000]
                if 400 <= response.status < 500 and response.status != 408:
                    yield self._result(error=_error_text(text, response.status), rejected=True)
                    return
                raise self._lost(f"HTTP {response.status}: {text[:200]}")
            async for item in self._events(response):
                yield item
        except (aiohttp.ClientError, ConnectionError, ValueError) as exc:
            raise self._lost(f"{type(exc).__name__}: {exc}") from None
        finally:
            self.close()

    async def _request(self) -> tuple[str, dict[str, Any]]:
        job, sampling = self.job, self.job.sampling
        body: dict[str, Any] = {
            "model": await self.upstream.model_name(self.engine, self.address, self.port or 0),
            "max_tokens": sampling.max_tokens - len(self.delivered),
            "temperature": sampling.temperature, "top_p": sampling.top_p,
            "stream": True, "stream_options": {"include_usage": True}}
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if self.vllm:
            body["return_token_ids"] = True
        if self.delivered or self.memo.get("sent"):
            prompt_ids = self.memo.get("prompt_ids")
            if prompt_ids is None or len(self.delivered) == 0:
                raise ApiError(503, f"the request's engine {self.engine} went away mid-stream and "
                                    f"its server gives no token ids to continue from (openai: "
                                    f"vllm servers do)", kind="server_error",
                               code="cannot_resume", headers={"Retry-After": "1"})
            body["prompt"] = list(prompt_ids) + self.delivered
            return "/v1/completions", body
        if job.kind == "chat":
            body["messages"] = [{"role": m.role, "content": m.content}
                                for m in job.messages or []]
            return "/v1/chat/completions", body
        body["prompt"] = job.prompt_ids if job.prompt_ids is not None else job.prompt
        return "/v1/completions", body

    async def _events(self, response: aiohttp.ClientResponse) -> AsyncIterator[Item]:
        finish: str | None = None
        generated = 0
        usage: dict[str, Any] = {}
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                if finish is None:
                    break
                self.memo.setdefault("prompt_tokens", usage.get("prompt_tokens", 0))
                generated = int(usage.get("completion_tokens", generated))
                yield self._result(finish=finish, generated=generated)
                return
            chunk = json.loads(data)
            if "error" in chunk:  # the server failed it (vLLM: its engine core died)
                raise self._lost(f"error event: {str(chunk['error'])[:200]}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if "prompt_token_ids" in chunk and chunk["prompt_token_ids"] is not None:
                self._first_ids(chunk["prompt_token_ids"])
            for choice in chunk.get("choices") or ():
                if choice.get("prompt_token_ids") is not None:
                    self._first_ids(choice["prompt_token_ids"])
                delta = choice.get("delta") or {}
                text = choice.get("text") if "text" in choice else delta.get("content")
                ids = [int(t) for t in choice.get("token_ids") or ()]
                generated += len(ids) if self.vllm else (1 if text else 0)
                if text or ids:
                    self.memo["sent"] = True
                    yield proto.TokenChunk(self.id, self.engine, self.incarnation, ids,
                                           text or "")
                if choice.get("finish_reason"):
                    finish = str(choice["finish_reason"])
        raise self._lost("the stream ended before the answer did")

    def _first_ids(self, ids: list[int]) -> None:
        if "prompt_ids" not in self.memo:  # the original prompt (not a continuation's)
            self.memo["prompt_ids"] = [int(t) for t in ids]
            self.memo["prompt_tokens"] = len(ids)

    def _result(self, finish: str | None = None, generated: int = 0, error: str | None = None,
                rejected: bool = False) -> proto.GenerateResult:
        return proto.GenerateResult(
            self.id, self.engine, self.incarnation, finish_reason=finish,
            prompt_tokens=int(self.memo.get("prompt_tokens", 0)),
            completion_tokens=len(self.delivered) + generated, error=error, rejected=rejected)


def _error_text(text: str, status: int) -> str:
    try:
        message = json.loads(text)["error"]
        message = message.get("message", message) if isinstance(message, dict) else message
    except (ValueError, KeyError, TypeError):
        message = text
    return f"the engine's server answered HTTP {status}: {str(message)[:500]}"
