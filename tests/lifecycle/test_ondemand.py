"""The lifecycle tier for engines on demand (routing.ondemand) on fake children and a jumping
clock: replicas past min_replicas start asleep, a request wakes its model and gets a lease once
it is READY, idle_timeout puts it back to sleep (nothing in flight or waiting), a sleep or a wake
is never a restart, and the memory budget swaps models: least recently used idle groups first,
never a busy one, one without idle_timeout or below min_replicas, the wake only once their
processes are gone. Every deadline here is exact (virtual time)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest

from engined.supervisor.lifecycle.notices import StateChange
from engined.supervisor.lifecycle.replica import Desired
from engined.supervisor.lifecycle.state import EngineState as S
from engined.supervisor.routing.ondemand import OnDemand
from engined.supervisor.routing.replicas import ReplicaLease
from engined.supervisor.routing.routes import RECHECK_S, NoReplica
from lifecycle.fakes import Behaviour, World
from lifecycle.fakes import scenario as run_world

GIB = 1 << 30
WAKE_S = 0.25  # a fresh fake child says READY this long after its spawn


class OnDemandWorld:
    """A World with OnDemand wired as the daemon wires it (supervisor.services): the router's
    waker, its state notices (events), and children that become READY by themselves."""

    def __init__(self, w: World) -> None:
        self.w = w
        self.od = OnDemand(w.fleet, w.router, w.clock)
        w.router.waker = self.od.for_request
        self.events: list[tuple[float, str, dict[str, Any]]] = []  # (at, engine, its fields)
        self.auto_ready = True
        # before the router's, as supervisor.services subscribes them (a wake that waits for
        # memory goes on before a waiting request looks again)
        w.notices.state._subscribers.insert(0, self._on_state)

    def _on_state(self, change: StateChange) -> None:
        extra = self.od.on_state(change)
        if extra:
            self.events.append((self.w.clock.monotonic(), change.view.name, extra))
        if change.view.state is S.STARTING and self.auto_ready:
            name, inc = change.view.name, change.view.incarnation
            asyncio.get_running_loop().call_later(WAKE_S, self._ready, name, inc)

    def _ready(self, name: str, incarnation: int) -> None:
        replica = self.w.replica(name)
        if replica.state is S.STARTING and replica.incarnation == incarnation \
                and replica.current is not None and replica.current.alive:
            self.w.ready(name)
            self.w.pulse(name)

    # --- what the gateway does for one request ------------------------------------------------
    async def request(self, group: str, within_s: float = 3600.0) -> ReplicaLease:
        """Admitted, then a lease (the request is in flight until `done`)."""
        self.w.router.admit(group)
        try:
            return await self.w.router.acquire(group, self.now + within_s)
        except BaseException:
            self.w.router.leave(group)
            raise

    def done(self, lease: ReplicaLease) -> None:
        self.w.router.release(lease)
        self.w.router.leave(lease.replica.spec.group)

    async def served(self, group: str) -> float:
        """One request from arrival to its end; returns how long it waited for a lease."""
        began = self.now
        lease = await self.request(group)
        self.done(lease)
        return self.now - began

    # --- looking ----------------------------------------------------------------------------
    @property
    def now(self) -> float:
        return self.w.clock.monotonic()

    def state(self, name: str) -> S:
        return self.w.state(name)

    def kinds(self, name: str) -> list[tuple[str, str]]:
        """(event, reason) of the engine's sleep and wake events, in order."""
        return [(e["event"], e["reason"]) for _, n, e in self.events if n == name]

    async def asleep(self, *names: str) -> None:
        await self.w.until(lambda: all(self.state(n) is S.ASLEEP for n in names),
                           what=f"{names} asleep")


def scenario(tmp_path: Path, engines: list[dict[str, Any]], body: Any, **kwargs: Any) -> None:
    async def wrapped(w: World) -> None:
        await body(OnDemandWorld(w))
    run_world(tmp_path, engines, wrapped, **kwargs)


def on_demand(name: str, **keys: Any) -> dict[str, Any]:
    return {"name": name, "idle_timeout": "60s", "stop_timeout": "30s", **keys}


BUDGET_2G = {"memory_budget": {"host": "2GiB"}}


# --- asleep from the start, awake on a request ------------------------------------------------

def test_replicas_past_min_replicas_start_asleep_and_count_as_ready_not_down(tmp_path):
    async def body(h: OnDemandWorld) -> None:
        h.w.fleet.start()
        await h.w.settle(5)
        assert h.state("a-0") is S.READY and h.state("a-1") is S.ASLEEP
        assert h.w.spawns("a-0") == 1 and h.w.spawns("a-1") == 0
        assert h.w.spawns("b-0") == 0 and h.state("b-0") is S.ASLEEP
        view = h.w.fleet.view()
        assert [e.desired for e in view.engines] == ["run", "asleep", "asleep"]
        assert view.health()[0] == 200, view.health()
        code, ready = view.readiness()
        assert code == 200 and ready["groups"] == {"a": True, "b": True}, ready
        assert h.od.status_of("b-0") == {"idle_timeout_s": 60.0, "min_replicas": 0,
                                         "sleep_mode": "stop", "in_place": False,
                                         "reason": "start", "held_bytes": None, "wakes": 0}
        assert h.od.status_of("a-0")["reason"] is None  # awake (kept: min_replicas)
        assert h.events == []  # nothing went to sleep: it never ran
    scenario(tmp_path, [on_demand("a", replicas=2, min_replicas=1), on_demand("b")], body)


def test_a_request_wakes_its_model_and_gets_a_lease_once_ready(tmp_path):
    async def body(h: OnDemandWorld) -> None:
        await h.w.start()
        began = h.now
        lease = await h.request("b")
        assert h.now - began == pytest.approx(WAKE_S)  # the wake, then the lease at READY
        assert lease.replica.name == "b-0" and h.state("b-0") is S.READY
        assert h.w.states_of("b-0") == ["STARTING", "READY"]
        assert h.kinds("b-0") == [("wake", "request")]
        assert h.od.wakes == {("b-0", "request"): 1}
        hist = h.od.wake_seconds["b-0"]
        assert hist.n == 1 and hist.total == pytest.approx(WAKE_S)
        view = h.w.replica("b-0").view()
        assert view.restarts == 0 and view.incarnation == 1  # a wake is not a restart
        assert h.od.status_of("b-0")["wakes"] == 1
        h.done(lease)
    scenario(tmp_path, [on_demand("b")], body)


def test_idle_timeout_sleeps_only_after_the_idle_time_with_nothing_in_flight(tmp_path):
    async def body(h: OnDemandWorld) -> None:
        await h.w.start()
        lease = await h.request("b")
        await h.w.settle(600)  # a long request: in flight, never idle
        await h.od.tick()
        assert h.state("b-0") is S.READY
        h.done(lease)
        ended = h.now
        await h.w.settle(59.5)
        await h.od.tick()
        assert h.state("b-0") is S.READY  # idle 59.5 s of 60
        h.w.router.admit("b")  # a request admitted, not yet placed: waiting counts as busy
        await h.w.settle(120)
        await h.od.tick()
        assert h.state("b-0") is S.READY
        h.w.router.leave("b")
        left = h.now
        await h.w.settle(60 - (h.now - left) - 0.001)
        await h.od.tick()
        assert h.state("b-0") is S.READY
        await h.w.settle(0.001)
        await h.od.tick()  # exactly idle_timeout after the last request left
        assert h.now - left == pytest.approx(60.0) and h.now - ended > 60
        assert h.w.replica("b-0").desired is Desired.ASLEEP
        await h.asleep("b-0")
        assert h.w.states_of("b-0")[-3:] == ["READY", "STOPPING", "ASLEEP"]
        assert h.kinds("b-0") == [("wake", "request"), ("sleep", "idle")]
        assert h.od.sleeps == {("b-0", "idle"): 1}
        assert h.w.replica("b-0").view().restarts == 0
        assert h.od.status_of("b-0")["reason"] == "idle"
        # and the next request wakes it again: a second incarnation, still no restart
        await h.served("b")
        view = h.w.replica("b-0").view()
        assert (view.incarnation, view.restarts) == (2, 0)
        assert h.od.wakes[("b-0", "request")] == 2 and h.od.wake_seconds["b-0"].n == 2
    scenario(tmp_path, [on_demand("b")], body)


def test_min_replicas_stay_awake_and_a_burst_wakes_the_rest_for_load(tmp_path):
    async def body(h: OnDemandWorld) -> None:
        await h.w.start("l-0")
        leases = [await h.request("l") for _ in range(2)]  # l-0 serves: nothing wakes
        assert h.w.spawns("l-1") == 0
        for _ in range(2):
            h.w.router.admit("l")  # two more wait: 4 admitted > l-0's max_batch_size 2
        await h.od.tick()
        await h.w.settle(1)
        assert h.od.wakes == {("l-1", "load"): 1, ("l-2", "load"): 1}
        assert h.state("l-1") is S.READY and h.state("l-2") is S.READY
        assert h.kinds("l-1") == [("wake", "load")]
        for _ in range(2):
            h.w.router.leave("l")
        for lease in leases:
            h.done(lease)
        await h.w.settle(60)
        await h.od.tick()  # idle: l-1 and l-2 sleep, l-0 (min_replicas) stays
        await h.asleep("l-1", "l-2")
        assert h.state("l-0") is S.READY
        await h.w.settle(600)
        await h.od.tick()
        assert h.state("l-0") is S.READY and h.w.spawns("l-0") == 1
    scenario(tmp_path, [on_demand("l", replicas=3, min_replicas=1, max_batch_size=2)], body)


def test_a_data_parallel_gang_sleeps_only_whole(tmp_path):
    async def body(h: OnDemandWorld) -> None:
        h.auto_ready = False
        await h.w.start()
        h.w.router.admit("dp")
        asked = asyncio.ensure_future(h.w.router.acquire("dp", h.now + 600))
        await h.w.settle(1)
        assert h.state("dp-0") is S.STARTING and h.state("dp-1") is S.STARTING  # woken whole
        h.w.ready("dp-0")
        h.w.pulse("dp-0")
        lease = await asked
        h.w.router.release(lease)
        h.w.router.leave("dp")
        await h.w.settle(120)
        await h.od.tick()  # idle, but dp-1 is not READY: a gang sleeps whole or not at all
        assert h.w.replica("dp-0").wanted and h.w.replica("dp-1").wanted
        h.w.ready("dp-1")
        h.w.pulse("dp-1")
        await h.od.tick()
        await h.asleep("dp-0", "dp-1")
        assert h.od.sleeps == {("dp-0", "idle"): 1, ("dp-1", "idle"): 1}
        assert [h.w.replica(n).view().restarts for n in ("dp-0", "dp-1")] == [0, 0]
        # an operator's sleep of one rank takes its gang
        await h.w.settle(1)
        h.od.wake("dp", "operator")
        await h.w.settle(1)
        h.w.ready("dp-0"), h.w.ready("dp-1")
        assert h.od.sleep("dp-1") and not h.w.replica("dp-0").wanted
        await h.asleep("dp-0", "dp-1")
    scenario(tmp_path, [on_demand("dp", replicas=2, data_parallel=True)], body)


# --- operator sleep and wake -----------------------------------------------------------------

def test_an_operator_sleeps_and_wakes_any_engine(tmp_path):
    async def body(h: OnDemandWorld) -> None:
        await h.w.start("plain-0")
        assert h.od.status_of("plain-0") is None  # not on demand
        slept = h.od.sleep("plain")
        assert [r.name for r in slept] == ["plain-0"]
        await h.asleep("plain-0")
        assert h.kinds("plain-0") == [("sleep", "operator")]
        assert h.od.status_of("plain-0")["reason"] == "operator"
        assert h.od.sleep("plain") == []  # already asleep
        assert h.w.fleet.view().readiness()[0] == 200
        woken = h.od.wake("plain", "operator")
        assert [r.name for r in woken] == ["plain-0"]
        await h.w.until(lambda: h.state("plain-0") is S.READY)
        assert h.kinds("plain-0")[-1] == ("wake", "operator")
        assert h.od.wakes == {("plain-0", "operator"): 1}
        assert h.w.replica("plain-0").view().restarts == 0
        # asleep again, a request wakes it (not on demand: it stays awake after)
        h.od.sleep("plain-0")
        await h.asleep("plain-0")
        await h.served("plain")
        await h.w.settle(3600)
        await h.od.tick()
        assert h.state("plain-0") is S.READY
    scenario(tmp_path, [{"name": "plain"}], body)


# --- the memory budget -----------------------------------------------------------------------

FOUR = [on_demand(n, memory_limit="1GiB") for n in ("w", "x", "y", "z")]


def test_a_wake_that_does_not_fit_evicts_the_least_recently_used_idle_group(tmp_path):
    async def body(h: OnDemandWorld) -> None:
        await h.w.start()
        await h.served("x")
        await h.w.settle(5)
        await h.served("y")
        await h.w.settle(5)
        # x (its last request ended 10 s ago) is older than y (5 s): x goes
        assert h.od.budget.report() == [("host", 2 * GIB, 2 * GIB)]
        await h.served("z")
        assert h.state("y-0") is S.READY and h.state("z-0") is S.READY
        assert h.state("x-0") is S.ASLEEP
        assert h.kinds("x-0") == [("wake", "request"), ("sleep", "budget")]
        assert h.od.status_of("x-0")["reason"] == "budget"
        await h.w.settle(1)
        await h.served("w")  # now y is the least recently used
        assert h.state("y-0") is S.ASLEEP and h.state("z-0") is S.READY
        assert h.od.budget.report() == [("host", 2 * GIB, 2 * GIB)]
        assert all(h.w.replica(n).view().restarts == 0 for n in ("w-0", "x-0", "y-0", "z-0"))
    scenario(tmp_path, FOUR, body, supervisor=BUDGET_2G)


def test_a_wake_waits_until_the_evicted_process_has_exited(tmp_path):
    async def body(h: OnDemandWorld) -> None:
        h.w.launcher.behaviours["x-0"] = Behaviour(term_delay_s=7.0)  # slow to answer SIGTERM
        await h.w.start()
        await h.served("x")
        await h.served("y")
        asked = h.now
        lease = await h.request("z")
        x = h.w.launcher.children["x-0"][0]
        assert x.signalled_at[signal.SIGTERM] == pytest.approx(asked)
        # its memory counts while it is STOPPING: z spawns only once x's process is gone
        assert x.exited_at == pytest.approx(asked + 7.0)
        z = h.w.child("z-0")
        assert z.spawned_at >= x.exited_at
        assert h.now == pytest.approx(x.exited_at + WAKE_S)
        assert h.od.blocked_by("z-0") is None  # woken: nothing blocks it any more
        h.done(lease)
    scenario(tmp_path, FOUR, body, supervisor=BUDGET_2G)


def test_a_group_with_a_request_in_flight_or_waiting_is_never_evicted(tmp_path):
    async def body(h: OnDemandWorld) -> None:
        await h.w.start()
        on_x = await h.request("x")  # x is the least recently used, but busy
        await h.w.settle(5)
        await h.served("y")
        await h.served("z")
        assert h.state("x-0") is S.READY and h.state("y-0") is S.ASLEEP
        h.done(on_x)
        h.w.router.admit("x")  # waiting for a lease counts as busy too
        await h.w.settle(5)
        await h.served("w")  # z is younger than x, but x has a request waiting
        assert h.state("x-0") is S.READY and h.state("z-0") is S.ASLEEP
        h.w.router.leave("x")
    scenario(tmp_path, FOUR, body, supervisor=BUDGET_2G)


def test_eviction_spares_groups_without_idle_timeout_and_min_replicas(tmp_path):
    engines = [{"name": "resident", "memory_limit": "1GiB"},
               on_demand("m", replicas=2, min_replicas=1, memory_limit="1GiB"),
               on_demand("x", memory_limit="1GiB")]

    async def body(h: OnDemandWorld) -> None:
        await h.w.start("resident-0", "m-0")
        for _ in range(3):
            h.w.router.admit("m")  # 3 > m-0's batch: m-1 wakes for load
        await h.od.tick()
        await h.w.until(lambda: h.state("m-1") is S.READY)
        for _ in range(3):
            h.w.router.leave("m")
        assert h.od.budget.report() == [("host", 3 * GIB, 3 * GIB)]
        await h.w.settle(1)
        await h.served("x")  # resident and m-0 are never candidates: m-1 sleeps
        assert h.state("m-1") is S.ASLEEP and h.state("m-0") is S.READY
        assert h.state("resident-0") is S.READY
        assert h.kinds("m-1") == [("wake", "load"), ("sleep", "budget")]
    scenario(tmp_path, engines, body, supervisor={"memory_budget": {"host": "3GiB"}},
             defaults={"max_batch_size": 2})


def test_a_wake_held_back_by_busy_engines_fails_at_wake_timeout_naming_the_budget(tmp_path):
    engines = [{"name": "resident", "memory_limit": "1GiB"},
               on_demand("x", memory_limit="1GiB"),
               on_demand("big", memory_limit="1GiB", wake_timeout="30s",
                         served_model_name="big-model")]

    async def body(h: OnDemandWorld) -> None:
        await h.w.start("resident-0")
        on_x = await h.request("x")  # the only candidate is busy
        began = h.now
        with pytest.raises(NoReplica) as info:
            await h.request("big")
        assert h.now - began == pytest.approx(30.0)  # wake_timeout, exactly
        text = str(info.value)
        assert "'big-model'" in text and "memory_budget.host" in text, text
        assert "wake_timeout (30s)" in text, text
        assert h.w.spawns("big-0") == 0 and h.state("x-0") is S.READY
        # a request that finds x idle before its wake_timeout wakes it
        asked = asyncio.ensure_future(h.request("big"))
        await h.w.settle(10)
        h.done(on_x)
        lease = await asked
        # a waiting request looks again every RECHECK_S (a release is not a state change)
        assert 30 + 10 + WAKE_S <= h.now - began <= 30 + 10 + RECHECK_S + WAKE_S + 1e-6
        assert h.state("x-0") is S.ASLEEP and lease.replica.name == "big-0"
        h.done(lease)
    scenario(tmp_path, engines, body, supervisor=BUDGET_2G)


def test_a_model_that_can_never_fit_is_told_at_once(tmp_path):
    async def body(h: OnDemandWorld) -> None:
        await h.w.start()
        h.od.budget.held["huge-0"] = {"host": 3 * GIB}  # measured while it was awake
        began = h.now
        with pytest.raises(NoReplica) as info:
            await h.request("huge", within_s=600)
        assert h.now == began  # at once, not at wake_timeout
        text = str(info.value)
        assert "'huge'" in text and "memory_budget.host" in text and "3.00 GiB" in text, text
        assert h.w.spawns("huge-0") == 0 and h.state("x-0") is S.ASLEEP
        assert h.w.router.queued["huge"] == 0
    scenario(tmp_path, [on_demand("huge"), on_demand("x", memory_limit="1GiB")], body,
             supervisor=BUDGET_2G)


def test_an_operator_wake_that_must_evict_first_wakes_once_the_memory_is_free(tmp_path):
    async def body(h: OnDemandWorld) -> None:
        h.w.launcher.behaviours["x-0"] = Behaviour(term_delay_s=3.0)
        await h.w.start()
        await h.served("x")
        await h.served("y")
        asked = h.now
        h.od.wake("z", "operator")  # x must sleep first: nobody asks again (no request)
        assert not h.od.stuck_waking("z-0")
        assert h.od.blocked_by("z-0") == "waiting for x-0 to go to sleep and free its memory"
        await h.w.until(lambda: h.state("z-0") is S.READY, timeout_s=60)
        assert h.now == pytest.approx(asked + 3.0 + WAKE_S)
        assert h.kinds("z-0") == [("wake", "operator")]
        assert h.od.blocked_by("z-0") is None
    scenario(tmp_path, FOUR, body, supervisor=BUDGET_2G)


def test_an_operator_wake_that_cannot_fit_fails_at_once(tmp_path):
    engines = [{"name": "resident", "memory_limit": "2GiB"}, on_demand("x", memory_limit="1GiB"),
               on_demand("huge")]

    async def body(h: OnDemandWorld) -> None:
        await h.w.start("resident-0")
        assert h.od.wake("x", "operator") == []
        assert h.od.stuck_waking("x-0")
        assert "memory_budget.host" in (h.od.blocked_by("x-0") or "")
        h.od.budget.held["huge-0"] = {"host": 3 * GIB}
        assert h.od.wake("huge", "operator") == []
        assert h.od.stuck_waking("huge-0")  # never fits: said at once, naming the budget
        assert "memory_budget.host" in (h.od.blocked_by("huge-0") or "")
    scenario(tmp_path, engines, body, supervisor=BUDGET_2G)


def test_a_group_larger_than_the_budget_wakes_the_replicas_that_fit(tmp_path):
    """Two replicas of 1 GiB in a 1.5 GiB budget: --check accepts it (each fits), so a request
    must get one replica, not 'it can never wake'."""
    async def body(h: OnDemandWorld) -> None:
        await h.w.start()
        lease = await h.request("two", within_s=60)
        assert lease.replica.name == "two-0" and h.state("two-1") is S.ASLEEP
        h.done(lease)
    scenario(tmp_path, [on_demand("two", replicas=2, memory_limit="1GiB")], body,
             supervisor={"memory_budget": {"host": "1536MiB"}})


def test_a_request_for_a_restarting_group_is_not_hopeless(tmp_path):
    """two-0 is awake (min_replicas) and restarting; two-1 sleeps and could not fit beside it:
    the request waits for two-0, it is not told that its model can never wake."""
    async def body(h: OnDemandWorld) -> None:
        await h.w.start("two-0")
        h.w.stop_pulse("two-0")
        h.w.child("two-0").exit(1)
        await h.w.settle()
        assert h.state("two-0") is S.STARTING
        lease = await h.request("two", within_s=60)
        assert lease.replica.name == "two-0"
        h.done(lease)
    scenario(tmp_path, [on_demand("two", replicas=2, min_replicas=1, memory_limit="1GiB")],
             body, supervisor={"memory_budget": {"host": "1536MiB"}})


def test_a_wake_during_a_sleep_in_progress_tells_both(tmp_path):
    """No budget: a request comes while its model is still stopping for an idle sleep. The
    sleep ends (ASLEEP, its event), then the wake (its event): events and counters agree."""
    async def body(h: OnDemandWorld) -> None:
        h.w.launcher.behaviours["b-0"] = Behaviour(term_delay_s=2.0)
        await h.w.start()
        await h.served("b")
        await h.w.settle(60)
        await h.od.tick()
        await h.w.settle()
        assert h.state("b-0") is S.STOPPING
        lease = await h.request("b")
        assert h.w.states_of("b-0")[-5:] == ["READY", "STOPPING", "ASLEEP", "STARTING", "READY"]
        assert h.kinds("b-0") == [("wake", "request"), ("sleep", "idle"), ("wake", "request")]
        assert h.od.wakes[("b-0", "request")] == 2 and h.od.sleeps[("b-0", "idle")] == 1
        assert h.w.replica("b-0").view().restarts == 0
        h.done(lease)
    scenario(tmp_path, [on_demand("b")], body)


def test_a_gang_over_the_gpu_budget_sleeps_whole(tmp_path):
    """GPUs are not shared between engines (--check), so the gpu budget is kept against what a
    model measured: a gang's rank 0 measured over it, and the gang sleeps, both ranks (rank 1
    holds nothing in gpu:0, but a rank cannot run alone)."""
    engines = [on_demand("dp", replicas=2, data_parallel=True, gpus=[0, 1], gpus_per_replica=1)]

    async def body(h: OnDemandWorld) -> None:
        await h.w.start()
        await h.served("dp")
        h.od.budget.held["dp-0"] = {"gpu:0": 3 * GIB // 2}
        await h.od.tick()
        await h.asleep("dp-0", "dp-1")
        assert h.od.sleeps == {("dp-0", "budget"): 1, ("dp-1", "budget"): 1}
        assert h.od.budget.report() == [("gpu:0", GIB, 0), ("gpu:1", GIB, 0)]
    scenario(tmp_path, engines, body, supervisor={"memory_budget": {"gpu": "1GiB"}})


def test_nothing_is_evicted_for_a_wake_that_still_would_not_fit(tmp_path):
    engines = [on_demand("x", memory_limit="1GiB"), on_demand("y", memory_limit="1GiB"),
               on_demand("big", memory_limit="2GiB", wake_timeout="10s")]

    async def body(h: OnDemandWorld) -> None:
        await h.w.start()
        await h.served("x")
        on_y = await h.request("y")  # busy: even with x asleep, big would not fit
        with pytest.raises(NoReplica):
            await h.request("big")
        assert h.state("x-0") is S.READY  # not put to sleep for nothing
        h.done(on_y)
    scenario(tmp_path, engines, body, supervisor=BUDGET_2G)


def test_a_tick_that_wakes_a_model_nothing_of_which_serves_counts_a_request_not_load(tmp_path):
    """Requests wait for a model nothing of which is awake (admitted, not yet placed; or held
    back by the budget until the tick finds room): the tick's wake is theirs, `request`.
    `load` says every awake replica was full, and none was awake. (The e2e mix met it: one
    model's wake_seconds counted more wakes than its request and operator wakes.)"""
    async def body(h: OnDemandWorld) -> None:
        await h.w.start()
        h.w.router.admit("b")
        await h.od.tick()
        await h.w.settle(1)
        assert h.state("b-0") is S.READY
        assert h.kinds("b-0") == [("wake", "request")]
        assert h.od.wakes == {("b-0", "request"): 1}
        h.w.router.leave("b")
    scenario(tmp_path, [on_demand("b")], body)


def test_events_and_counters_agree_whoever_wakes_or_stops_a_sleep(tmp_path):
    """`enginectl start` of a sleeping engine is a wake too (event and counter, reason
    operator, timed), and a start that overtakes a sleep still stopping is neither."""
    async def body(h: OnDemandWorld) -> None:
        h.w.launcher.behaviours["b-0"] = Behaviour(term_delay_s=2.0)
        await h.w.start()
        h.w.fleet.command("start", "b")  # asleep from the start: the operator's start wakes it
        await h.w.until(lambda: h.state("b-0") is S.READY)
        assert h.kinds("b-0") == [("wake", "operator")]
        assert h.od.wakes == {("b-0", "operator"): 1} and h.od.wake_seconds["b-0"].n == 1
        h.od.sleep("b")
        await h.w.settle()
        assert h.state("b-0") is S.STOPPING
        h.w.fleet.command("start", "b")  # before it is asleep: it never was
        await h.w.until(lambda: h.state("b-0") is S.READY)
        assert h.w.states_of("b-0")[-3:] == ["STOPPING", "STARTING", "READY"]
        assert h.kinds("b-0") == [("wake", "operator")]
        assert h.od.sleeps == {} and h.od.wakes == {("b-0", "operator"): 1}
        assert h.w.replica("b-0").view().restarts == 0
    scenario(tmp_path, [on_demand("b")], body)


@pytest.mark.xfail(strict=True, reason="lifecycle/view.py: FleetView.readiness counts a group "
                   "as ready when a replica is READY or asleep; one waking is neither, so "
                   "/readyz answers 503 during every wake (a Service drops the pod while its "
                   "requests wait in the gateway for the model)")
def test_readyz_stays_200_while_a_request_wakes_its_model(tmp_path):
    async def body(h: OnDemandWorld) -> None:
        await h.w.start()
        assert h.w.fleet.view().readiness()[0] == 200  # asleep: ready
        asked = asyncio.ensure_future(h.request("b"))
        await h.w.settle(WAKE_S / 2)
        assert h.state("b-0") is S.STARTING
        code = h.w.fleet.view().readiness()[0]
        h.done(await asked)
        assert code == 200
    scenario(tmp_path, [on_demand("b")], body)
