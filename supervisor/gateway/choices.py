"""engined's own engines' answer to one client request: its choices (each prompt of a batch, `n`
samples of each) relayed at once, each surviving an engine's death on its own, merged into one
OpenAI answer or one event stream, as vLLM's server answers them (choice index = prompt index x n
+ sample; `usage` counts each prompt once and every choice's completion; a stream's choice ends
with its last tokens and finish_reason in one event, chat's opens with the role)."""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

from aiohttp import web

from engined.supervisor.gateway.openai import (
    Answer,
    ApiError,
    Batch,
    Echoed,
    Ending,
    Job,
    Logprobs,
    Usage,
    fingerprint,
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
        answer = Answer(batch.first, rid, self._fingerprint(group))
        try:
            if batch.first.stream:
                return await _Stream(self, request, batch, runs, answer).run()
            return await self._whole(batch, runs, answer)
        finally:
            for run in runs:  # closes their engine streams: an unfinished request is aborted
                await run.aclose()

    def _fingerprint(self, group: str) -> str:
        return fingerprint(self.relay.router.route_of(group).config)

    async def _whole(self, batch: Batch, runs: list[AsyncGenerator[Item, None]],
                     answer: Answer) -> tuple[str, web.Response]:
        started = self.clock()
        first: list[bool] = []

        async def collect(run: AsyncGenerator[Item, None]) -> tuple[Echoed, Done]:
            said = Echoed(positions=[] if batch.first.logprobs is not None else None,
                          token_ids=[] if batch.first.token_ids else None)
            async for item in run:
                if isinstance(item, Done):
                    said.message = item.message
                    return said, item
                if not first:
                    first.append(True)
                    self.on_first(batch.first.model, self.clock() - started)
                said.text += item.text
                said.prompt = said.prompt or item.prompt
                if said.token_ids is not None:
                    said.token_ids.extend(item.token_ids)
                if said.positions is not None and item.logprobs is not None:
                    said.positions.extend(item.logprobs)
            raise AssertionError("a relayed request ends with Done")

        results = await all_or_none([collect(run) for run in runs])
        usage = _usage(batch, [done for _, done in results])
        return "ok", web.json_response(answer.full(
            [(said, _ending(done)) for said, done in results], usage))


class _Stream:
    """Server-sent events of every choice, as they come; an error after the stream began is an
    `error` event (and the choices still running are aborted).

    As vLLM's server: a choice's last tokens and its finish_reason are one event (a choice's
    end that the engine sent with its last tokens is here with them: the relay yields both at
    once), chat opens every choice with its role when the first of them has something, and a
    completion's first event with `echo` begins with the prompt."""

    def __init__(self, choices: Choices, request: web.Request, batch: Batch,
                 runs: list[AsyncGenerator[Item, None]], answer: Answer) -> None:
        self.choices, self.request, self.batch, self.runs = choices, request, batch, runs
        self.job: Job = batch.first
        self.answer = answer
        self.logprobs: dict[int, Logprobs] = {}  # per choice: its text offsets go on

    async def _piece(self, response: web.StreamResponse, index: int, piece: Piece,
                     first: bool, done: Done | None) -> None:
        """A choice's new tokens as one event (with `echo`, its first begins with the prompt;
        with `done`, its last); nothing for a piece with nothing to show, unless it ends the
        choice."""
        ending = None if done is None else _ending(done)
        if piece.delta is not None:  # a chat a vLLM engine's frontend read (tools, reasoning)
            logprobs = None
            if self.job.logprobs is not None and piece.logprobs:
                shape = self.logprobs.setdefault(index, Logprobs(self.job))
                logprobs = shape.render(list(piece.logprobs))
            if piece.delta or logprobs or ending is not None:
                await _sse(response, self.answer.chunk(piece.text, index=index,
                                                       logprobs=logprobs, ending=ending,
                                                       parsed=piece.delta,
                                                       token_ids=piece.token_ids))
            return
        if first:
            said = Echoed(piece.text, list(piece.logprobs or []), piece.prompt)
            text, positions = self.answer.shown(said)
        else:
            text, positions = ("", []) if self.job.echo_only else (
                piece.text, list(piece.logprobs or []))
        logprobs = None
        if self.job.logprobs is not None:
            shape = self.logprobs.setdefault(index, Logprobs(self.job))
            logprobs = shape.render(positions) if positions else None
        echoed = first and (self.job.echo or self.job.token_ids) and piece.prompt is not None
        ids = [] if self.job.echo_only else piece.token_ids
        if text or positions or ids or done is not None:
            await _sse(response, self.answer.chunk(
                text, index=index, logprobs=logprobs,
                ending=None if done is None else _ending(done),
                prompt_token_ids=list(piece.prompt.token_ids) if echoed and piece.prompt
                else None, token_ids=ids))

    async def run(self) -> tuple[str, web.StreamResponse]:
        started = self.choices.clock()
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Request-Id": self.request["request_id"]})
        await response.prepare(self.request)
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        pumps = [asyncio.ensure_future(_pump(i, run, queue)) for i, run in enumerate(self.runs)]
        pending: collections.deque[tuple[int, Any]] = collections.deque()  # taken, not sent
        opened: set[int] = set()
        dones: dict[int, Done] = {}
        tokens_came = False
        try:
            while len(dones) < len(self.runs):
                if not pending:
                    pending.append(await queue.get())
                while not queue.empty():  # what came with it: a choice's end, maybe
                    pending.append(queue.get_nowait())
                index, item = pending.popleft()
                if isinstance(item, BaseException):
                    raise item
                if not opened and self.job.kind == "chat":
                    prompt = item.prompt if isinstance(item, Piece) else None
                    for i in range(len(self.runs)):
                        await _sse(response, self.answer.opener(i, prompt))
                    for i in range(len(self.runs) if self.job.echoed else 0):
                        await _sse(response, self.answer.echo_chunk(i))
                if isinstance(item, Piece):
                    if not tokens_came:
                        tokens_came = True
                        self.choices.on_first(self.job.model, self.choices.clock() - started)
                    done = _take_done(pending, index)
                    await self._piece(response, index, item, index not in opened, done)
                    if done is not None:
                        dones[index] = done
                elif isinstance(item, Done):
                    await _sse(response, self.answer.chunk("", index=index,
                                                           ending=_ending(item)))
                    dones[index] = item
                opened.add(index)
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


def _take_done(pending: collections.deque[tuple[int, Any]], index: int) -> Done | None:
    """Choice `index`'s end, taken out of `pending` if it is that choice's next item there."""
    for position, (i, item) in enumerate(pending):
        if i == index:
            if isinstance(item, Done):
                del pending[position]
                return item
            return None
    return None


def _ending(done: Done) -> Ending:
    return Ending(done.finish_reason, done.stop_reason)


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
