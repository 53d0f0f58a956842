"""vLLM's `POST /tokenize` and `POST /detokenize` for engined's own engines: the engine that
serves the model answers with its own tokenizer (and chat template), at once, without
generating; vLLM's request and answer shapes. A command engine's server answers them itself
(gateway.proxy)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from engined.engine import protocol as proto
from engined.supervisor import bodies
from engined.supervisor import request_fields as fields
from engined.supervisor.gateway.openai import ApiError, bad
from engined.supervisor.gateway.relay import acquire, moved, with_adapter
from engined.supervisor.ipc import (
    EngineChannels,
    RequestFailed,
    RequestTooLarge,
    new_request_id,
)
from engined.supervisor.routing.routes import LostOn, Routes


def tokenize_request(body: dict[str, Any]) -> proto.GenerateRequest:
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`)."""
    try:
        ask = bodies.read(body, bodies.TokenizeBody)
        if ask.messages is not None:
            if ask.add_generation_prompt not in (None, True):
                raise bad("add_generation_prompt", "only add_generation_prompt true is "
                                                   "supported (the engine's chat template "
                                                   "ends with the assistant's turn)")
            return proto.GenerateRequest("", messages=fields.messages(ask.messages),
                                         task=proto.TASK_TOKENIZE,
                                         token_strs=ask.return_token_strs)
        if ask.prompt is None:
            raise bad("prompt", "'prompt' must be a string (or send 'messages')")
        fields.text(ask.prompt, "prompt")
    except fields.BadField as exc:
        raise bad(exc.param, exc.message) from None
    return proto.GenerateRequest("", prompt=ask.prompt, task=proto.TASK_TOKENIZE,
                                 token_strs=ask.return_token_strs,
                                 add_special_tokens=ask.add_special_tokens)


def detokenize_request(body: dict[str, Any]) -> proto.GenerateRequest:
    try:
        ids = bodies.read(body, bodies.DetokenizeBody).tokens
    except fields.BadField as exc:
        raise bad(exc.param, exc.message) from None
    return proto.GenerateRequest("", prompt_ids=list(ids), task=proto.TASK_DETOKENIZE)


def answer(request: proto.GenerateRequest, result: proto.GenerateResult) -> dict[str, Any]:
    if request.task == proto.TASK_DETOKENIZE:
        return {"prompt": result.text}
    return {"count": len(result.token_ids), "max_model_len": result.max_model_len,
            "tokens": result.token_ids, "token_strs": result.token_strs}


async def ask(router: Routes, channels: EngineChannels, clock: Callable[[], float],
              group: str, request: proto.GenerateRequest, deadline: float,
              limit: int) -> proto.GenerateResult:
    """One answer from a replica of `group`; a replica lost on the way is replaced by another
    (at most `limit` times); the engine's rejection is a 400 in its words."""
    lost_on = LostOn(clock)
    moves = 0
    while True:
        lease = await acquire(router, group, deadline, lost_on)
        try:
            attempt = with_adapter(proto.GenerateRequest(**{**_fields(request),
                                                           "id": new_request_id()}))
            try:
                stream = channels.open(lease.address, attempt)
            except RequestTooLarge as exc:
                raise ApiError(400, str(exc), code="request_too_large") from None
            except RequestFailed as exc:
                lost = str(exc)
            else:
                try:
                    item = await stream.next(max(0.001, deadline - clock()))
                    if isinstance(item, proto.GenerateResult):
                        if item.error is None:
                            return item
                        if item.rejected:
                            raise ApiError(400, item.error, code="rejected_by_engine")
                        lost = f"{item.engine}: {item.error}"
                    else:
                        lost = "an unexpected chunk"
                except (RequestFailed, StopAsyncIteration) as exc:
                    lost = str(exc) or "the engine ended the request"
                except asyncio.TimeoutError:
                    raise ApiError(503, "the request did not finish within its "
                                        "request_timeout", kind="server_error",
                                   code="timeout", headers={"Retry-After": "5"}) from None
                finally:
                    stream.close()
        finally:
            router.release(lease)
        lost_on.add(lease.target, lost)
        moves = moved(request.id or request.task, lost, moves, limit, 0)


def _fields(request: proto.GenerateRequest) -> dict[str, Any]:
    return {f: getattr(request, f) for f in request.__struct_fields__}
