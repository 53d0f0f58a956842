"""The engine core's batching window: work arriving on an idle engine waits for the rest of its
burst, so the burst's first step holds all of it (with vLLM a burst split as [1+7] costs one more
step; with transformers, one more whole `generate`).

The window's loop (`EngineCoreProc._coalesce`) runs here against a scripted socket: each poll
delivers the burst's next frame or reports the gap empty, so what joins is decided by the
script, not by this box's timing. Which backends wait is checked on the classes themselves.
Whether the window is open at all (`BurstWindow`: lone requests in a row turn it off, a split
burst turns it back on) is a table of idle starts, and one run through `_admit`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import zmq

from engined.engine.batching import COALESCE_GAP_S, LONE_STARTS, BurstWindow
from engined.engine.core import EngineCoreProc
from engined.engine.echo import EchoBackend
from engined.engine.transformers_backend import HFBackend
from engined.engine.vllm_backend import VllmBackend


class _Burst:
    """A request socket whose frames reach it one poll at a time (a burst in flight)."""

    def __init__(self, frames: int) -> None:
        self.in_flight = frames
        self.queued = 0
        self.polls: list[int] = []

    def poll(self, timeout_ms: int) -> int:
        self.polls.append(timeout_ms)
        if self.in_flight:
            self.in_flight -= 1
            self.queued += 1
            return zmq.POLLIN
        return 0  # the gap passed empty

    def take(self, table: SimpleNamespace) -> None:
        while self.queued:
            self.queued -= 1
            table.active[f"r{len(table.active)}"] = object()


def _core(burst: _Burst, max_batch_size: int, first: int = 1) -> SimpleNamespace:
    """What `_coalesce` reads of the core: the request table, the socket, the batch bound, the
    stop flag; `first` requests already taken (the ones that ended the idle poll)."""
    table = SimpleNamespace(active={f"r{i}": object() for i in range(first)})
    core = SimpleNamespace(table=table, channels=SimpleNamespace(requests=burst),
                           stop=SimpleNamespace(set=False),
                           config=SimpleNamespace(max_batch_size=max_batch_size))
    core._take_requests = lambda: burst.take(table)
    core.window = BurstWindow(True)
    core._coalesce = lambda: EngineCoreProc._coalesce(core)  # type: ignore[arg-type]
    return core


def test_the_window_takes_a_whole_burst_then_one_empty_gap_ends_it() -> None:
    burst = _Burst(frames=7)
    core = _core(burst, max_batch_size=16)
    EngineCoreProc._coalesce(core)  # type: ignore[arg-type]
    assert len(core.table.active) == 8  # the first and the seven behind it: one step
    assert burst.polls == [round(COALESCE_GAP_S * 1000)] * 8  # seven arrivals, one empty gap


def test_a_lone_request_pays_one_empty_gap() -> None:
    burst = _Burst(frames=0)
    core = _core(burst, max_batch_size=8)
    EngineCoreProc._coalesce(core)  # type: ignore[arg-type]
    assert len(core.table.active) == 1 and len(burst.polls) == 1


def test_the_window_never_waits_past_a_full_batch() -> None:
    burst = _Burst(frames=20)
    core = _core(burst, max_batch_size=8)
    EngineCoreProc._coalesce(core)  # type: ignore[arg-type]
    assert len(core.table.active) == 8 and burst.in_flight == 13  # the rest wait for a step


def test_a_stop_request_ends_the_window() -> None:
    burst = _Burst(frames=7)
    core = _core(burst, max_batch_size=8)
    core.stop.set = True
    EngineCoreProc._coalesce(core)  # type: ignore[arg-type]
    assert len(core.table.active) == 1 and burst.polls == []


def test_vllm_and_transformers_wait_for_a_burst_echo_does_not() -> None:
    # vLLM: requests join a running batch, but a split burst costs a step; transformers: its
    # batch cannot grow; echo: a step costs nothing, the wait would only add latency
    assert VllmBackend.burst_window
    assert HFBackend.burst_window
    assert not EchoBackend.burst_window


def _starts(window: BurstWindow, starts: list[tuple[int, int]]) -> list[bool]:
    """Idle starts as (requests it took, requests that arrived during its first step): whether
    the window was open before each."""
    seen = []
    for taken, arrived in starts:
        seen.append(window.wanted)
        window.started(taken)
        window.first_step_done(arrived)
    return seen


LONE, SPLIT, GATHERED = (1, 0), (1, 7), (8, 0)


@pytest.mark.parametrize(("starts", "open_before_each"), [
    # lone requests: the window is paid LONE_STARTS times, then skipped
    ([LONE] * (LONE_STARTS + 2), [True] * LONE_STARTS + [False] * 2),
    # a burst the window gathered is not lone: the count starts again
    ([LONE] * (LONE_STARTS - 1) + [GATHERED] + [LONE] * LONE_STARTS,
     [True] * (2 * LONE_STARTS)),
    # with the window off, a burst splits once; the split turns it back on
    ([LONE] * LONE_STARTS + [SPLIT, GATHERED], [True] * LONE_STARTS + [False, True]),
    # two requests that arrived together, or one behind the other during the first step
    ([LONE] * LONE_STARTS + [(1, 1), (2, 0)], [True] * LONE_STARTS + [False, True]),
])
def test_lone_requests_turn_the_window_off_and_a_split_burst_turns_it_on(
        starts: list[tuple[int, int]], open_before_each: list[bool]) -> None:
    assert _starts(BurstWindow(True), starts) == open_before_each


def test_a_backend_without_the_window_never_waits() -> None:
    window = BurstWindow(False)
    assert _starts(window, [SPLIT, GATHERED, SPLIT]) == [False] * 3


def test_admit_skips_the_gap_after_lone_requests_and_waits_again_after_a_split() -> None:
    burst = _Burst(frames=0)
    core = _core(burst, max_batch_size=8, first=0)
    for n in range(LONE_STARTS + 1):  # lone requests, each on an idle engine
        burst.queued = 1
        EngineCoreProc._admit(core, was_idle=True)  # type: ignore[arg-type]
        assert len(burst.polls) == min(n + 1, LONE_STARTS)  # the last one paid no gap
        EngineCoreProc._admit(core, was_idle=False)  # type: ignore[arg-type]  # its step
        core.table.active.clear()
    burst.queued = 1  # a burst: its first member reaches the idle engine alone...
    EngineCoreProc._admit(core, was_idle=True)  # type: ignore[arg-type]
    burst.queued = 7  # ...the other seven during its first step
    EngineCoreProc._admit(core, was_idle=False)  # type: ignore[arg-type]
    assert len(core.table.active) == 8 and core.window.wanted
