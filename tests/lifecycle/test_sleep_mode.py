"""Sleep in place (sleep_mode level1/level2, supervisor.routing.sleepmode) on fake children and a
jumping clock: the engine is drained, then asked to sleep, and keeps its process (ASLEEP with its
pid, never a restart); a request wakes the same process, counted and timed as any wake; a start
that overtakes a sleep wakes it as soon as it sleeps; a sleep the engine refuses stops the
process (asleep all the same), a wake it refuses restarts it. Every deadline here is exact."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from engined.supervisor.lifecycle.state import EngineState as S
from engined.supervisor.routing.sleepmode import SleepMode
from lifecycle.fakes import World
from lifecycle.fakes import scenario as run_world
from lifecycle.test_ondemand import OnDemandWorld, on_demand

SLEEP_S, WAKE_S = 0.5, 0.2  # how long the fake engine takes to sleep, and to wake up


class FakeSleepMode(SleepMode):
    """SleepMode as the daemon has it (its drain included); the engine's answer is faked."""

    def __init__(self, clock: Any, in_flight: Any) -> None:
        super().__init__(None, None, clock, in_flight)  # type: ignore[arg-type]
        self.asked: list[tuple[float, str, str]] = []  # (at, engine, task)
        self.refuse: set[str] = set()  # tasks answered with an error

    async def _ask(self, spec: Any, inc: Any, task: str, timeout_s: float) -> str | None:
        self.asked.append((self.clock.monotonic(), spec.name, task))
        await asyncio.sleep(SLEEP_S if task == "sleep" else WAKE_S)
        return f"{task}: refused" if task in self.refuse else None


def scenario(tmp_path: Path, body: Any, **keys: Any) -> None:
    holder: dict[str, FakeSleepMode] = {}

    async def wrapped(w: World) -> None:
        await body(OnDemandWorld(w), holder["mode"])

    class Lazy:  # the fake needs the world's clock and router, built with the world
        async def sleep(self, spec: Any, inc: Any) -> str | None:
            return await holder["mode"].sleep(spec, inc)

        async def wake(self, spec: Any, inc: Any) -> str | None:
            return await holder["mode"].wake(spec, inc)

    async def setup(w: World) -> None:
        holder["mode"] = FakeSleepMode(w.clock, w.router.in_flight)
        await wrapped(w)
    run_world(tmp_path, [on_demand("a", sleep_mode="level1", min_replicas=1, **keys)], setup,
              in_place=Lazy())


async def serving(h: OnDemandWorld) -> int | None:
    """The fleet started and a-0 READY (a replica still starting sleeps by a stop): its pid."""
    await h.w.start()
    await h.w.until(lambda: h.state("a-0") is S.READY, what="a-0 READY")
    return h.w.replica("a-0").pid


def test_an_idle_engine_sleeps_in_place_and_a_request_wakes_the_same_process(tmp_path):
    async def body(h: OnDemandWorld, mode: FakeSleepMode) -> None:
        await h.w.start()
        await h.w.until(lambda: h.state("a-0") is S.READY, what="a-0 READY")
        pid = h.w.replica("a-0").pid
        lease = await h.request("a")
        h.od.sleep("a", "operator")  # min_replicas keeps it awake when idle: an operator's
        await h.w.settle(10)
        assert h.state("a-0") is S.READY and mode.asked == []  # drained first: still serving
        h.done(lease)
        drained = h.now
        await h.asleep("a-0")
        assert h.now - drained == pytest.approx(SLEEP_S, abs=0.06)  # the drain's 50 ms steps
        replica = h.w.replica("a-0")
        assert replica.pid == pid and replica.asleep_in_place
        assert h.od.status_of("a-0")["in_place"] is True
        began = h.now
        lease = await h.request("a")
        assert h.now - began == pytest.approx(WAKE_S)
        assert lease.replica.pid == pid and h.w.spawns("a-0") == 1
        h.done(lease)
        assert h.w.states_of("a-0")[-2:] == ["ASLEEP", "READY"]
        assert h.kinds("a-0") == [("sleep", "operator"), ("wake", "request")]
        assert sum(h.od.wake_seconds["a-0"].counts) == 1
        assert sum(replica.history.restarts.values()) == 0
        assert [task for _, _, task in mode.asked] == ["sleep", "wake_up"]
    scenario(tmp_path, body)


def test_a_start_that_overtakes_a_sleep_wakes_it_once_asleep(tmp_path):
    async def body(h: OnDemandWorld, mode: FakeSleepMode) -> None:
        pid = await serving(h)
        h.od.sleep("a", "operator")
        await h.w.settle(0.1)
        h.od.wake("a", "operator")  # while the engine is still going to sleep
        await h.w.until(lambda: len(mode.asked) == 2 and h.state("a-0") is S.READY,
                        what="asleep, then awake again")
        assert h.w.replica("a-0").pid == pid
        assert [task for _, _, task in mode.asked] == ["sleep", "wake_up"]
    scenario(tmp_path, body)


def test_a_sleep_that_overtakes_a_wake_sleeps_in_place_again(tmp_path):
    async def body(h: OnDemandWorld, mode: FakeSleepMode) -> None:
        pid = await serving(h)
        h.od.sleep("a", "operator")
        await h.w.until(lambda: h.w.replica("a-0").asleep_in_place, what="asleep in place")
        h.od.wake("a", "operator")
        await h.w.settle(WAKE_S / 2)
        h.od.sleep("a", "operator")  # while the engine is still waking up
        await h.w.until(lambda: len(mode.asked) == 3 and h.w.replica("a-0").asleep_in_place,
                        what="awake, then asleep in place again")
        assert h.w.replica("a-0").pid == pid and h.w.spawns("a-0") == 1
        assert [task for _, _, task in mode.asked] == ["sleep", "wake_up", "sleep"]
    scenario(tmp_path, body)


def test_a_refused_sleep_stops_the_process_and_a_refused_wake_restarts_it(tmp_path):
    async def body(h: OnDemandWorld, mode: FakeSleepMode) -> None:
        first = await serving(h)
        mode.refuse = {"sleep"}
        h.od.sleep("a", "operator")
        await h.w.until(lambda: h.state("a-0") is S.ASLEEP and h.w.replica("a-0").pid is None,
                        what="asleep by a stop")
        assert h.w.states_of("a-0")[-2:] == ["STOPPING", "ASLEEP"]
        lease = await h.request("a")  # woken by a start, as sleep_mode stop would be
        second = lease.replica.pid
        assert second != first
        h.done(lease)
        mode.refuse = {"wake_up"}
        h.od.sleep("a", "operator")
        await h.w.until(lambda: h.w.replica("a-0").asleep_in_place, what="asleep in place")
        lease = await h.request("a")  # the wake is refused: a fresh process serves it
        assert lease.replica.pid not in (first, second)
        h.done(lease)
        assert h.w.spawns("a-0") == 3
    scenario(tmp_path, body)
