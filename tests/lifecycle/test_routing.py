"""The routing authority (supervisor.routing) over real replicas on fake children, on a loop whose
clock jumps: who is routable, least-loaded picking, load counted per incarnation (a promoted
standby brings its own), and rolling restarts that wait for every request on a replica, a
command engine's gateway requests included."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest

from engined.supervisor.routing import NoReplica
from engined.supervisor.state import EngineState as S
from lifecycle.autojump import run
from lifecycle.fakes import HEARTBEAT_INTERVAL_S, World


def scenario(tmp_path: Path, engines: list[dict[str, Any]],
             body: Callable[[World], Awaitable[None]]) -> None:
    async def main() -> None:
        world = await World.build(tmp_path, engines)
        try:
            await body(world)
        finally:
            await world.close()
    run(main)


def test_least_loaded_first_and_round_robin_among_equals(tmp_path):
    async def body(w: World) -> None:
        await w.start("a-0", "a-1", "a-2")
        replicas = list(w.fleet.replicas.values())
        leases = [w.router.pick(replicas) for _ in range(6)]
        assert all(lease is not None for lease in leases)
        assert sorted(w.router.load(r) for r in replicas) == [2, 2, 2]
        w.router.release(leases[0])  # one replica now has one request less: it is next
        freed = leases[0].replica
        nxt = w.router.pick(replicas)
        assert nxt is not None and nxt.replica is freed
    scenario(tmp_path, [{"name": "a", "replicas": 3}], body)


def test_a_silent_replica_leaves_routing_long_before_it_is_declared_hung(tmp_path):
    async def body(w: World) -> None:
        await w.start("a-0", "a-1")
        w.stop_pulse("a-1")  # frozen: its heartbeats stop
        await w.settle(2 * HEARTBEAT_INTERVAL_S + 0.5)
        assert w.state("a-1") is S.READY  # not yet hung (heartbeat_timeout is 10 s)
        a1 = w.replica("a-1")
        assert w.router.routable(a1) is None and w.router.routable(w.replica("a-0")) is not None
        picks = {w.router.pick(w.fleet.replicas.values()).replica.name for _ in range(4)}
        assert picks == {"a-0"}
    scenario(tmp_path, [{"name": "a", "replicas": 2}], body)


def test_standbys_and_draining_replicas_are_routed_only_when_named(tmp_path):
    async def body(w: World) -> None:
        await w.start("a-0", "a-standby-0")
        a0, spare = w.replica("a-0"), w.replica("a-standby-0")
        assert w.router.routable(spare) is None and w.router.routable(spare, named=True)
        w.router.drain(a0)
        assert w.router.pick([a0, spare]) is None
        soon = w.clock.monotonic() + 5.0
        lease = await w.router.lease_for([a0], "a-0", True, soon)  # generate --engine a-0
        assert lease.replica is a0
        with pytest.raises(NoReplica, match="no engine in 'a' could take the request in time"):
            await w.router.lease_for([a0, spare], "a", False, soon)  # a-0 READY, draining
        assert w.clock.monotonic() == pytest.approx(soon)  # it waited for a-0, in vain
        w.fleet.command("stop", "a-0")
        await w.settle()
        with pytest.raises(NoReplica, match="no READY engine in 'a'"):  # at once
            await w.router.lease_for([a0, spare], "a", False, soon + 60.0)
        assert w.clock.monotonic() == pytest.approx(soon)
    scenario(tmp_path, [{"name": "a", "standby": 1}], body)


def test_a_promoted_standby_brings_its_own_load_and_the_next_spare_starts_at_zero(tmp_path):
    async def body(w: World) -> None:
        await w.start("a-0", "a-standby-0")
        a0, spare = w.replica("a-0"), w.replica("a-standby-0")
        on_spare = await w.router.lease_for([spare], "a-standby-0", True,
                                            w.clock.monotonic())
        on_a0 = w.router.pick([a0])
        assert on_a0 is not None
        w.stop_pulse("a-0")
        w.child("a-0").exit(None, signal.SIGKILL)
        await w.settle()
        assert a0.current is on_spare.incarnation  # promoted, with the request it carries
        assert w.router.load(a0) == 1 and w.router.load(spare) == 0
        w.router.release(on_a0)  # the dead incarnation's request ends: nobody's load changes
        assert w.router.load(a0) == 1
    scenario(tmp_path, [{"name": "a", "standby": 1}], body)


COMMAND_GROUP = {"name": "srv", "replicas": 2, "command": ["server", "--port", "1"],
                 "probe": "off", "stop_timeout": "30s"}


def test_a_rolling_restart_of_a_command_group_waits_for_its_gateway_requests(tmp_path):
    """The gateway's requests to a command engine travel over HTTP, not the engine channels;
    the router counts them all, so the rollout drains a server before it stops it."""
    async def body(w: World) -> None:
        w.fleet.start()
        await w.settle()
        assert w.state("srv-0") is S.READY and w.state("srv-1") is S.READY  # no probe
        srv0 = w.replica("srv-0")
        lease = w.router.pick([srv0])  # a gateway request in flight on srv-0
        assert lease is not None
        first = w.child("srv-0")
        w.fleet.command("restart", "srv")
        await w.settle(20.0)  # long, but within stop_timeout: it waits for the request
        assert first.signals == [] and w.router.routable(srv0) is None  # draining
        released_at = w.clock.monotonic()
        w.router.release(lease)
        await w.until(lambda: not first.alive)
        assert first.signalled_at[signal.SIGTERM] == pytest.approx(released_at, abs=1e-6)
        await w.until(lambda: w.spawns("srv-0") == 2 and w.state("srv-1") is S.READY
                      and w.spawns("srv-1") == 2)
        assert w.replica("srv-0").view().restarts_of("manual") == 1
    scenario(tmp_path, [COMMAND_GROUP], body)


def test_a_request_that_never_ends_holds_a_rollout_at_most_stop_timeout(tmp_path):
    async def body(w: World) -> None:
        w.fleet.start()
        await w.settle()
        assert w.router.pick([w.replica("srv-0")]) is not None  # never released
        first = w.child("srv-0")
        began = w.clock.monotonic()
        w.fleet.command("restart", "srv")
        await w.settle(29.9)
        assert first.signals == []
        await w.settle(0.2)
        assert first.signalled_at[signal.SIGTERM] - began == pytest.approx(30.0, abs=1e-6)
    scenario(tmp_path, [COMMAND_GROUP], body)
