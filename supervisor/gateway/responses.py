"""OpenAI's Responses API (`POST /v1/responses`) for engined's own engines: text in (a string, or
messages with text content, and `instructions`), one assistant message out, whole or as the
API's event stream. It runs as a chat job, so it survives an engine's death like any chat (a
stream continues from its delivered tokens). Nothing is stored: `previous_response_id` and
`background` are refused, as are tools and non-text formats (a 400 naming the field). A command
engine's server answers the route itself (gateway.proxy).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from aiohttp import web

from engined.engine import protocol as proto
from engined.supervisor import bodies
from engined.supervisor import request_fields as fields
from engined.supervisor.gateway.openai import (
    MAX_TOKENS_DEFAULT_CHAT,
    TEMPERATURE_DEFAULT,
    ApiError,
    Job,
    bad,
    outcome,
)
from engined.supervisor.gateway.relay import Done, Piece

_TEXT_PARTS = ("input_text", "output_text", "text")


def parse(body: dict[str, Any]) -> Job:
    """A Responses request as a chat job; ApiError 400 naming the field."""
    try:
        ask = bodies.read(body, bodies.ResponsesBody)
        if not ask.model:
            raise bad("model", "'model' is required: one of GET /v1/models")
        for key, allowed in (("previous_response_id", (None,)), ("background", (None, False)),
                             ("tools", (None, [])), ("tool_choice", (None, "none", "auto")),
                             ("top_logprobs", (None, 0)), ("include", (None, []))):
            if getattr(ask, key) not in allowed:
                raise bad(key, f"'{key}' is not supported by engined's own engines (nothing "
                               f"is stored; text in, text out)")
        if ask.text is not None and ask.text.get("format") not in (None, {"type": "text"}):
            raise bad("text", "only text output is supported ('text': {\"format\": {\"type\": "
                              "\"text\"}})")
        messages = _messages(ask.input, ask.instructions)
        sampling = fields.sampling(ask, ask.max_output_tokens, MAX_TOKENS_DEFAULT_CHAT,
                                   TEMPERATURE_DEFAULT, "max_output_tokens")
    except fields.BadField as exc:
        raise bad(exc.param, exc.message) from None
    return Job("chat", ask.model, "", None, messages, sampling, bool(ask.stream),
               include_usage=False)


def _messages(value: Any, instructions: Any) -> list[proto.ChatMessage]:
    items: list[dict[str, Any]] = []
    if instructions:
        items.append({"role": "system", "content": instructions})
    if isinstance(value, str) and value:
        items.append({"role": "user", "content": value})
    elif isinstance(value, list) and value:
        for i, item in enumerate(value):
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                raise fields.BadField(f"input[{i}]", "only message items are supported "
                                                     "(role and text content)")
            content = item.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") in _TEXT_PARTS
                           and isinstance(p.get("text"), str) for p in content):
                    raise fields.BadField(f"input[{i}].content", "only text content parts "
                                                                 "are supported")
                content = "".join(p["text"] for p in content)
            items.append({"role": item.get("role"), "content": content})
    else:
        raise fields.BadField("input", "'input' must be a non-empty string or list of messages")
    return fields.messages(items)


class Reply:
    """One Responses answer: the response object, and its event stream."""

    def __init__(self, job: Job, request_id: str, body: dict[str, Any],
                 clock: Callable[[], float], on_first: Callable[[str, float], None]) -> None:
        self.job, self.body, self.clock, self.on_first = job, body, clock, on_first
        self.id, self.item_id = f"resp_{request_id}", f"msg_{request_id}"
        self.created = int(time.time())
        self.sequence = 0

    def response(self, status: str, text: str | None = None, done: Done | None = None
                 ) -> dict[str, Any]:
        sampling = self.job.sampling
        output = [] if text is None else [self.item("completed", text)]
        incomplete = done is not None and done.finish_reason == proto.FINISH_LENGTH
        usage = None if done is None else {
            "input_tokens": done.usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": done.usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.usage.prompt_tokens + done.usage.completion_tokens}
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": "incomplete" if incomplete else status,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "error": None, "model": self.job.model,
                "instructions": self.body.get("instructions"), "output": output,
                "max_output_tokens": self.body.get("max_output_tokens"),
                "temperature": sampling.temperature, "top_p": sampling.top_p,
                "parallel_tool_calls": bool(self.body.get("parallel_tool_calls", True)),
                "tool_choice": self.body.get("tool_choice") or "auto", "tools": [],
                "text": {"format": {"type": "text"}}, "truncation": "disabled",
                "previous_response_id": None, "reasoning": None, "store": False,
                "metadata": self.body.get("metadata"), "user": self.body.get("user"),
                "usage": usage, "background": False, "service_tier": "auto"}

    def item(self, status: str, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [self.part(text)]
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant",
                "content": content}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    async def whole(self, run: AsyncGenerator[Piece | Done, None]) -> tuple[str, web.Response]:
        started, text = self.clock(), list[str]()
        async for item in run:
            if isinstance(item, Done):
                return "ok", web.json_response(self.response("completed", "".join(text), item))
            if not text:
                self.on_first(self.job.model, self.clock() - started)
            text.append(item.text)
        raise AssertionError("a relayed request ends with Done")

    async def stream(self, request: web.Request, run: AsyncGenerator[Piece | Done, None]
                     ) -> tuple[str, web.StreamResponse]:
        started, text = self.clock(), list[str]()
        out = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Request-Id": request["request_id"]})
        await out.prepare(request)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        try:
            await self._event(out, "response.created",
                              response=self.response("in_progress"))
            await self._event(out, "response.in_progress",
                              response=self.response("in_progress"))
            await self._event(out, "response.output_item.added", output_index=0,
                              item=self.item("in_progress", None))
            await self._event(out, "response.content_part.added", **where,
                              part=self.part(""))
            async for item in run:
                if isinstance(item, Piece):
                    if not text:
                        self.on_first(self.job.model, self.clock() - started)
                    text.append(item.text)
                    if item.text:
                        await self._event(out, "response.output_text.delta", **where,
                                          delta=item.text, logprobs=[])
                    continue
                whole = "".join(text)
                await self._event(out, "response.output_text.done", **where,
                                  text=whole, logprobs=[])
                await self._event(out, "response.content_part.done", **where,
                                  part=self.part(whole))
                await self._event(out, "response.output_item.done", output_index=0,
                                  item=self.item("completed", whole))
                final = self.response("completed", whole, item)
                kind = "response.completed" if final["status"] == "completed" \
                    else "response.incomplete"
                await self._event(out, kind, response=final)
                return "ok", out
            raise AssertionError("a relayed request ends with Done")
        except ApiError as exc:
            await self._event(out, "error", code=exc.code, message=exc.message,
                              param=exc.param)
            return outcome(exc), out
        except (ConnectionResetError, RuntimeError):
            return "client_gone", out

    async def _event(self, out: web.StreamResponse, kind: str, **data: Any) -> None:
        event = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        await out.write(f"event: {kind}\ndata: ".encode() +
                             json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
