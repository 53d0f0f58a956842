"""engined's own engines' answer to one client request: its choices (each prompt of a batch, `n`
samples of each) relayed at once, each surviving an engine's death on its own, merged into one
OpenAI answer or one event stream, as vLLM's server answers them (choice index = prompt index x n
+ sample; `usage` counts each prompt once and every choice's completion)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

from aiohttp import web

from engined.supervisor.gateway.openai import (
    Answer,
    ApiError,
    Batch,
    Echoed,
    Job,
    Logprobs,
    Usage,
    outcome,
)
from engined.supervisor.gateway.relay import Done, Piece, Relay

Item = Piece | Done
_END = object()  # a choice's pump is done


class Choices:
    def __init__(self, relay: Relay, clock: Callable[[], float],
                 on_first: Callable[[str, float], None]) -> None:
        self.relay, self.clock, self.on_first = relay, clock, on_first  # (model, seconds)

    async def answer(self, request: web.Request, batch: Batch, group: str, deadline: float,
                     limit: int) -> tuple[str, web.StreamResponse]:
        rid = request["request_id"]
        runs = [self.relay.run(job, group, rid if len(batch.jobs) == 1 else f"{rid}.{i}",
                               deadline, limit) for i, job in enumerate(batch.jobs)]
        try:
            if batch.first.stream:
                return await _Stream(self, request, batch, runs).run()
            return await self._whole(batch, runs, rid)
        finally:
            for run in runs:  # closes their engine streams: an unfinished request is aborted
                await run.aclose()

    async def _whole(self, batch: Batch, runs: list[AsyncGenerator[Item, None]],
                     rid: str) -> tuple[str, web.Response]:
        started = self.clock()
        first: list[bool] = []

        async def collect(run: AsyncGenerator[Item, None]) -> tuple[Echoed, Done]:
            said = Echoed(positions=[] if batch.first.logprobs is not None else None)
            async for item in run:
                if isinstance(item, Done):
                    said.message = item.message
                    return said, item
                if not first:
                    first.append(True)
                    self.on_first(batch.first.model, self.clock() - started)
                said.text += item.text
                said.prompt = said.prompt or item.prompt
                if said.positions is not None and item.logprobs is not None:
                    said.positions.extend(item.logprobs)
            raise AssertionError("a relayed request ends with Done")

        results = await all_or_none([collect(run) for run in runs])
        answer = Answer(batch.first, rid)
        usage = _usage(batch, [done for _, done in results])
        return "ok", web.json_response(answer.full(
            [(said, done.finish_reason) for said, done in results], usage))


class _Stream:
    """Server-sent events of every choice, as they come; an error after the stream began is an
    `error` event (and the choices still running are aborted)."""

    def __init__(self, choices: Choices, request: web.Request, batch: Batch,
                 runs: list[AsyncGenerator[Item, None]]) -> None:
        self.choices, self.request, self.batch, self.runs = choices, request, batch, runs
        self.job: Job = batch.first
        self.answer = Answer(self.job, request["request_id"])
        self.logprobs: dict[int, Logprobs] = {}  # per choice: its text offsets go on

    async def _piece(self, response: web.StreamResponse, index: int, piece: Piece,
                     first: bool) -> None:
        """A choice's new tokens as one event (with `echo`, its first begins with the prompt);
        nothing for a piece with nothing to show, unless it opens the choice."""
        if piece.delta is not None:  # a chat the engine's frontend read (tools, reasoning)
            logprobs = None
            if self.job.logprobs is not None and piece.logprobs:
                shape = self.logprobs.setdefault(index, Logprobs(self.job))
                logprobs = shape.render(list(piece.logprobs))
            if piece.delta or first or logprobs:
                await _sse(response, self.answer.chunk(piece.text, first=first, index=index,
                                                       logprobs=logprobs, parsed=piece.delta))
            return
        said = Echoed(piece.text, list(piece.logprobs or []), piece.prompt if first else None)
        if not first:
            said = Echoed("" if self.job.echo_only else piece.text,
                          [] if self.job.echo_only else list(piece.logprobs or []))
        text, positions = self.answer.shown(said) if first else (said.text,
                                                                  said.positions or [])
        logprobs = None
        if self.job.logprobs is not None:
            shape = self.logprobs.setdefault(index, Logprobs(self.job))
            logprobs = shape.render(positions) if positions else None
        if text or positions or first:
            await _sse(response, self.answer.chunk(text, first=first, index=index,
                                                   logprobs=logprobs))

    async def run(self) -> tuple[str, web.StreamResponse]:
        started = self.choices.clock()
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Request-Id": self.request["request_id"]})
        await response.prepare(self.request)
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        pumps = [asyncio.ensure_future(_pump(i, run, queue)) for i, run in enumerate(self.runs)]
        opened: set[int] = set()
        dones: dict[int, Done] = {}
        try:
            while len(dones) < len(self.runs):
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Piece):
                    if not opened:
                        self.choices.on_first(self.job.model, self.choices.clock() - started)
                    await self._piece(response, index, item, index not in opened)
                    opened.add(index)
                elif isinstance(item, Done):
                    if index not in opened:  # nothing came before its end: open it anyway
                        await _sse(response, self.answer.chunk("", first=True, index=index))
                        opened.add(index)
                    await _sse(response, self.answer.chunk("", item.finish_reason,
                                                           index=index))
                    dones[index] = item
            if self.job.include_usage:
                await _sse(response, self.answer.usage_chunk(
                    _usage(self.batch, [dones[i] for i in range(len(self.runs))])))
            await response.write(b"data: [DONE]\n\n")
            return "ok", response
        except ApiError as exc:
            await _sse(response, exc.body())
            await response.write(b"data: [DONE]\n\n")
            return outcome(exc), response
        except (ConnectionResetError, RuntimeError):
            return "client_gone", response
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)


async def _pump(index: int, run: AsyncGenerator[Item, None],
                queue: asyncio.Queue[tuple[int, Any]]) -> None:
    try:
        async for item in run:
            await queue.put((index, item))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - handed to the stream, which answers it
        await queue.put((index, exc))


async def all_or_none(coros: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Every result, in order; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _usage(batch: Batch, dones: list[Done]) -> Usage:
    """Each prompt counted once (its first sample's), every choice's completion."""
    prompt = sum(done.usage.prompt_tokens for i, done in enumerate(dones) if i % batch.n == 0)
    return Usage(prompt, sum(done.usage.completion_tokens for done in dones))


async def _sse(response: web.StreamResponse, data: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(data, separators=(",", ":")).encode() +
                         b"\n\n")
