"""RequestStream, the daemon's side of one request: items in order, the end, failures, and
timeouts that cost no task (a future and a timer handle per wait)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engined.engine import protocol as proto
from engined.supervisor.ipc import EngineLost, RequestStream, new_request_id


class _Channels:
    def __init__(self) -> None:
        self.closed: list[str] = []

    def _close(self, stream: RequestStream) -> None:
        self.closed.append(stream.id)


def _stream() -> RequestStream:
    return RequestStream(_Channels(), "e-0", 1, "r1")  # type: ignore[arg-type]


def _chunk(text: str) -> proto.TokenChunk:
    return proto.TokenChunk("r1", "e-0", 1, [ord(c) for c in text], text)


def _result() -> proto.GenerateResult:
    return proto.GenerateResult("r1", "e-0", 1, "ab", finish_reason="length")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_items_come_in_order_then_the_stream_ends() -> None:
    async def main() -> list[Any]:
        stream = _stream()
        stream.put(_chunk("a"))
        stream.put(_result())
        stream.put(_chunk("late"))  # after the result: dropped
        got = [item async for item in stream]
        with pytest.raises(StopAsyncIteration):
            await stream.next(0.01)
        return got

    got = run(main())
    assert [type(x).__name__ for x in got] == ["TokenChunk", "GenerateResult"]


def test_a_waiting_reader_wakes_on_the_item_and_creates_no_task() -> None:
    async def main() -> tuple[Any, int]:
        stream = _stream()
        loop = asyncio.get_running_loop()
        during: list[int] = []

        def arrive() -> None:
            during.append(len(asyncio.all_tasks()))  # while the reader waits
            stream.put(_result())

        loop.call_later(0.01, arrive)
        before = len(asyncio.all_tasks())
        item = await stream.result(timeout_s=30)
        return item, during[0] - before

    item, new_tasks = run(main())
    assert item.finish_reason == "length" and new_tasks == 0


def test_a_timeout_raises_and_a_later_item_is_still_read() -> None:
    async def main() -> Any:
        stream = _stream()
        with pytest.raises(asyncio.TimeoutError):
            await stream.next(0.01)
        with pytest.raises(asyncio.TimeoutError):
            await stream.result(timeout_s=0)
        stream.put(_result())
        return await stream.next(0.01)

    assert isinstance(run(main()), proto.GenerateResult)


def test_a_failure_ends_the_stream_with_its_error() -> None:
    async def main() -> None:
        stream = _stream()
        stream.put(_chunk("a"))
        stream.fail(EngineLost("e-0 exited", "e-0", "exited"))
        stream.put(_result())  # nothing after a failure
        assert isinstance(await stream.next(), proto.TokenChunk)
        with pytest.raises(EngineLost, match="e-0 exited"):
            await stream.next()
        with pytest.raises(StopAsyncIteration):
            await stream.next()

    run(main())


def test_a_cancelled_reader_leaves_the_stream_readable() -> None:
    async def main() -> Any:
        stream = _stream()
        reader = asyncio.ensure_future(stream.next(30))
        await asyncio.sleep(0.01)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        stream.put(_result())
        return await stream.next(0.01)

    assert isinstance(run(main()), proto.GenerateResult)


def test_a_second_reader_is_refused_and_the_first_still_gets_the_item() -> None:
    async def main() -> Any:
        stream = _stream()
        first = asyncio.ensure_future(stream.next(30))
        await asyncio.sleep(0.01)
        with pytest.raises(RuntimeError, match="already has a reader"):
            await stream.next(30)
        stream.put(_result())
        return await first

    assert isinstance(run(main()), proto.GenerateResult)


def test_request_ids_do_not_repeat() -> None:
    ids = {new_request_id() for _ in range(10_000)}
    assert len(ids) == 10_000 and all(len(i) >= 13 for i in ids)
