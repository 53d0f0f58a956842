"""Running one client request on the fleet so that no engine death loses it.

A streamed request is streamed from the engine too, so the relay knows every token it has
forwarded; a client that waits for the whole answer gets it in one piece from the engine. If the
replica goes away (it crashed, was declared hung or stalled, or was stopped) the request is sent
again to another routable replica (or to the replacement, when none is READY): from scratch
when nothing was delivered yet, mid-stream with `resume` = the token ids already delivered (the
engine continues after them; stop strings are checked across the seam). At most
`migration_limit` moves, then an error. The client sees one uninterrupted answer; `usage`
reports the original prompt. A seeded sampled request is not reproduced after a move.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from engined.engine import protocol as proto
from engined.supervisor.gateway.openai import ApiError, Job, Usage
from engined.supervisor.ipc import (
    EngineChannels,
    EngineLost,
    RequestFailed,
    RequestStream,
    RequestTooLarge,
    new_request_id,
)
from engined.supervisor.routing.adapters import ADAPTER
from engined.supervisor.routing.routes import Lease, LostOn, NoReplica, Routes

log = logging.getLogger("engined.gateway")


@dataclass(frozen=True)
class Piece:
    """New text for the client (and the ids it stands for, with their logprobs if asked; the
    request's first piece carries the prompt when it asked for `echo`)."""

    text: str
    token_ids: list[int]
    logprobs: list[proto.Position] | None = None
    prompt: proto.PromptEcho | None = None
    delta: dict[str, Any] | None = None  # a chat read by the engine's frontend: its delta


@dataclass(frozen=True)
class Done:
    finish_reason: str
    usage: Usage
    engine: str
    moves: int
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    message: dict[str, Any] | None = None  # a chat read by the engine's frontend, whole


class Relay:
    """engined's own engines' requests (command engines' go through supervisor.gateway.proxy)."""

    def __init__(self, router: Routes, channels: EngineChannels, clock: Callable[[], float],
                 on_move: Callable[[str], None] = lambda model: None) -> None:
        self.router, self.channels, self.clock = router, channels, clock
        self.on_move = on_move

    async def run(self, job: Job, group: str, request_id: str, deadline: float,
                  limit: int) -> AsyncGenerator[Piece | Done, None]:
        """Pieces as tokens come, then Done; raises ApiError (400 for a request the engine
        rejects, 503 past the deadline or the migration limit)."""
        delivered: list[int] = []
        lost_on = LostOn(self.clock)  # not sent back to an incarnation it was lost on
        moves = 0
        while True:
            lease = await self._acquire(group, deadline, lost_on)
            log.debug("[gateway] %s -> %s incarnation %d", request_id, *lease.address)
            try:
                engine_id = new_request_id()  # a fresh id per attempt: never mixed up
                try:
                    stream = self.channels.open(lease.address,
                                                with_adapter(job.request(engine_id,
                                                                         list(delivered))),
                                                wake=self.router.peers(lease))
                except RequestTooLarge as exc:
                    raise ApiError(400, str(exc), code="request_too_large") from None
                except RequestFailed as exc:
                    lost: str = str(exc)
                else:
                    try:
                        async for item in _until(stream, deadline, self.clock):
                            if isinstance(item, proto.TokenChunk):
                                delivered.extend(item.token_ids)
                                yield Piece(item.text, item.token_ids, item.logprobs,
                                            item.prompt, item.delta)
                                continue
                            if item.error is None:
                                if item.text or item.token_ids or item.prompt is not None \
                                        or any((item.delta or {}).values()):
                                    delivered.extend(item.token_ids)
                                    yield Piece(item.text, item.token_ids, item.logprobs,
                                                item.prompt, item.delta)
                                yield Done(item.chat_finish or item.finish_reason
                                           or proto.FINISH_STOP,
                                           Usage(item.prompt_tokens, item.completion_tokens),
                                           item.engine, moves, item.stop_reason,
                                           item.message)
                                return
                            if item.rejected:
                                raise ApiError(400, item.error, code="rejected_by_engine")
                            lost = f"{item.engine}: {item.error}"  # e.g. "engine stopping"
                            break
                        else:
                            lost = f"{lease.name} ended the stream"
                    except EngineLost as exc:
                        lost = str(exc)
                    finally:
                        stream.close()
            finally:
                self.router.release(lease)
            lost_on.add(lease.target, lost)
            if delivered and not job.resumable:
                raise ApiError(503, f"the request lost its engine after {len(delivered)} "
                                    f"tokens and cannot go on elsewhere (a structured-output "
                                    f"grammar's state is the engine's): {lost}",
                               kind="server_error", code="cannot_move",
                               headers={"Retry-After": "1"})
            moves = moved(request_id, lost, moves, limit, len(delivered))
            self.on_move(job.model)

    async def _acquire(self, group: str, deadline: float,
                       avoid: LostOn) -> Lease:
        return await acquire(self.router, group, deadline, avoid)


async def acquire(router: Routes, group: str, deadline: float,
                  avoid: LostOn) -> Lease:
    """A lease on a routable replica of `group` (not one of `avoid` while liveness may still be
    deciding about it: routes.LostOn); ApiError 503 past the deadline."""
    try:
        return await router.acquire(group, deadline, avoid)
    except NoReplica as exc:
        last = f" (its last attempt: {avoid.last})" if avoid.last else ""
        raise ApiError(503, f"{exc}{last}", kind="server_error", code="no_replica",
                       headers={"Retry-After": "5"}) from None


def with_adapter(request: proto.GenerateRequest) -> proto.GenerateRequest:
    """The request with the LoRA adapter its model names (routing.adapters), if it does."""
    adapter = ADAPTER.get()
    return request if adapter is None else msgspec.structs.replace(request, adapter=adapter)


def moved(request_id: str, lost: str, moves: int, limit: int, delivered: int) -> int:
    """A request lost its engine (`lost` says how): one move more, or ApiError 503 past
    migration_limit. Returns the moves so far."""
    moves += 1
    if moves > limit:
        raise ApiError(503, f"the request lost its engine {moves} times (migration_limit "
                            f"{limit}); last: {lost}", kind="server_error",
                       code="migration_limit", headers={"Retry-After": "5"})
    log.warning("[gateway] %s: %s; moving it (move %d of %d, %d tokens delivered)",
                request_id, lost, moves, limit, delivered)
    return moves


async def _until(stream: RequestStream, deadline: float,
                 clock: Callable[[], float]
                 ) -> AsyncIterator[proto.TokenChunk | proto.GenerateResult]:
    """The stream's items, ApiError 503 at the request's deadline."""
    while True:
        left = deadline - clock()
        if left <= 0:
            raise ApiError(503, "the request did not finish within its request_timeout",
                           kind="server_error", code="timeout", headers={"Retry-After": "5"})
        try:
            item = await stream.next(left)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            continue  # the deadline check above raises
        yield item
