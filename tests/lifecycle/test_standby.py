"""The lifecycle tier for warm standbys (fake children, a jumping clock): promotion at the
instant a serving replica dies, what health and readiness count, a promoted child's liveness
and messages under its new name, and a standby's own failures."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from engined.engine import protocol as proto
from engined.supervisor.lifecycle.state import EngineState as S
from lifecycle.autojump import run
from lifecycle.fakes import HEARTBEAT_TIMEOUT_S, World
from lifecycle.fakes import scenario as run_world

GROUP = {"name": "a", "standby": 1, "backoff": {"initial": "1s", "jitter": 0}}


def scenario(tmp_path: Path, body) -> None:
    run_world(tmp_path, [GROUP], body)


def test_promotion_is_immediate_and_health_counts_serving_replicas_only(tmp_path):
    async def body(w: World) -> None:
        await w.start("a-0", "a-standby-0")
        view = w.fleet.view()
        assert view.counts() == (1, 1) and view.standbys() == (1, 1)
        code, health = view.health()
        assert code == 200 and health["standby"] == {"ready": 1, "expected": 1}, health
        spare = w.child("a-standby-0")
        died_at = w.clock.monotonic()
        w.stop_pulse("a-0")
        w.child("a-0").exit(None, signal.SIGKILL)
        await w.settle()
        a0 = w.replica("a-0").view()
        assert (a0.state, a0.pid, a0.incarnation) == (S.READY, spare.pid, 2)
        assert a0.restarts_of("signal") == 1 and a0.since >= died_at
        assert w.states_of("a-0")[-2:] == ["STARTING", "READY"]
        # the spare builds a new child at once; meanwhile the fleet serves in full
        assert w.spawns("a-standby-0") == 2
        assert w.replica("a-standby-0").view().state is S.STARTING
        view = w.fleet.view()
        assert view.health()[0] == 200 and view.standbys() == (0, 1)
        assert view.readiness()[0] == 200

        # the promoted child speaks as a-standby-0 incarnation 1: its heartbeats are a-0's
        w.stop_pulse("a-standby-0")
        beat = proto.Heartbeat("a-standby-0", 1, 7, w.clock.monotonic(), waiting=0, running=0)
        assert w.send(beat) is None
        assert w.replica("a-0").view().heartbeat == beat
        # and its silence is a-0's hang (no heartbeat for heartbeat_timeout)
        await w.settle(HEARTBEAT_TIMEOUT_S + 1)
        assert signal.SIGKILL in spare.signals or signal.SIGTERM in spare.signals
    scenario(tmp_path, body)


def test_no_ready_standby_means_an_ordinary_restart(tmp_path):
    async def body(w: World) -> None:
        await w.start("a-0")  # the spare never reports READY
        first_spare = w.child("a-standby-0")
        w.stop_pulse("a-0")
        w.child("a-0").exit(1)
        await w.settle()  # the first failure restarts at once (then backoff)
        assert w.replica("a-0").view().state is S.STARTING
        assert w.spawns("a-0") == 2 and w.child("a-standby-0") is first_spare
    scenario(tmp_path, body)


def test_a_dying_standby_is_restarted_by_its_own_policy(tmp_path):
    async def body(w: World) -> None:
        await w.start("a-0", "a-standby-0")
        w.stop_pulse("a-standby-0")
        w.child("a-standby-0").exit(None, signal.SIGKILL)
        await w.settle()
        assert w.replica("a-standby-0").view().state is S.STARTING
        assert w.spawns("a-standby-0") == 2
        assert w.replica("a-0").view().incarnation == 1  # nobody was promoted
    scenario(tmp_path, body)


def test_what_a_child_says_before_its_spawn_returns_is_kept(tmp_path):
    """A forked engine runs (and may be READY) before the fork server's answer arrives."""
    async def main() -> None:
        w = await World.build(tmp_path, [{"name": "b"}])
        try:
            w.launcher.spawn_delay_s = 0.5
            w.fleet.start()
            await w.settle(0.1)
            assert w.spawns("b-0") == 0  # the spawn is still in flight
            assert w.send(proto.Hello("b-0", 1, 123)) is None
            assert w.send(proto.Ready("b-0", 1, 0.01, "cpu", "builtin:echo", "none")) is None
            await w.settle(0.5)
            view = w.replica("b-0").view()
            assert (view.state, view.incarnation) == (S.READY, 1), view
        finally:
            await w.close()
    run(main)


def test_a_gang_waits_for_a_rank_whose_spawn_is_in_flight(tmp_path):
    """A peer fails while a rank's (fork-server) spawn is still in flight: that rank is not
    "down" yet; its new child is stopped the moment it exists, and the gang decides once."""
    async def main() -> None:
        w = await World.build(tmp_path, [{"name": "dp", "replicas": 2, "data_parallel": True,
                                          "backoff": {"initial": "1s", "jitter": 0}}])
        try:
            w.launcher.spawn_delays = {"dp-0": 0.5}  # dp-1 spawns at once
            w.fleet.start()
            await w.settle(0.6)
            assert w.spawns("dp-0") == w.spawns("dp-1") == 1
            w.child("dp-1").exit(1)  # the gang stops dp-0 and restarts both at once
            await w.settle(0.1)
            assert w.spawns("dp-0") == 1 and w.spawns("dp-1") == 2
            w.child("dp-1").exit(1)  # dp-0's spawn is still in flight
            await w.settle()
            assert not w.replica("dp-0").settled  # spawning: not down
            assert w.spawns("dp-1") == 2  # no decision yet: the gang waits for dp-0
            await w.settle(0.5)  # dp-0's child now exists: stopped at once for its peer
            first_round = w.child("dp-0")
            assert signal.SIGTERM in first_round.signals
            await w.settle(5)
            assert w.spawns("dp-0") == w.spawns("dp-1") == 3  # one decision per round
        finally:
            await w.close()
    run(main)


# --- promotion while the spare is exiting -----------------------------------------------------

def test_a_spare_in_its_cleanup_is_not_promoted(tmp_path):
    """A standby that announced its cleanup (it is exiting on its own: an external SIGTERM, an
    exception) is READY for a moment longer, but promoting it would hand the serving replica a
    child about to exit: the replica restarts as usual, and the spare's exit is its own."""
    async def body(w: World) -> None:
        await w.start("a-0", "a-standby-0")
        spare = w.child("a-standby-0")
        assert w.send(proto.Progress("a-standby-0", 1, proto.PHASE_CLEANUP)) is None
        w.stop_pulse("a-0")
        w.child("a-0").exit(1)
        await w.settle()
        a0 = w.replica("a-0").view()
        assert (a0.state, a0.incarnation, a0.restarts_of("exit")) == (S.STARTING, 2, 1), a0
        assert a0.pid == w.child("a-0").pid != spare.pid
        spare.exit(143)  # its cleanup ends: the standby's own failure, restarted by its policy
        await w.settle()
        assert w.replica("a-0").view().restarts == 1
        standby = w.replica("a-standby-0").view()
        assert standby.restarts_of("signal") == 1 and w.spawns("a-standby-0") == 2
    scenario(tmp_path, body)


def test_a_spare_that_exits_with_the_replica_it_would_replace_is_not_promoted(tmp_path):
    """Both children die in the same instant (a node-wide event): neither is promoted into the
    other; each restarts under its own policy, once."""
    async def body(w: World) -> None:
        await w.start("a-0", "a-standby-0")
        for name in ("a-0", "a-standby-0"):
            w.stop_pulse(name)
        spare = w.child("a-standby-0")
        w.child("a-0").exit(None, signal.SIGKILL)
        spare.exit(None, signal.SIGKILL)
        await w.settle()
        a0, standby = w.replica("a-0").view(), w.replica("a-standby-0").view()
        assert a0.pid == w.child("a-0").pid and a0.pid != spare.pid
        assert (a0.incarnation, a0.restarts_of("signal")) == (2, 1), a0
        assert (standby.incarnation, standby.restarts_of("signal")) == (2, 1), standby
        assert w.spawns("a-0") == w.spawns("a-standby-0") == 2
    scenario(tmp_path, body)


def test_a_promoted_child_that_exits_at_once_is_reported_once_by_its_new_replica(tmp_path):
    """The spare's child exits right after it was promoted, before anything else ran: its exit
    is the serving replica's (one restart decision, counted once, its requests failed under the
    address they were sent to); the standby only builds a new spare."""
    async def body(w: World) -> None:
        await w.start("a-0", "a-standby-0")
        spare = w.child("a-standby-0")
        w.stop_pulse("a-0")
        w.child("a-0").exit(1)
        # the replica's exit is handled (the spare is promoted) on the next loop turns; the
        # promoted child dies one turn later, before its watchers have run again
        for _ in range(3):
            await asyncio.sleep(0)
        assert w.replica("a-0").view().pid == spare.pid
        w.stop_pulse("a-standby-0")
        spare.exit(None, signal.SIGKILL)
        await w.settle(1.0)  # its second failure in a row waits backoff.initial
        a0 = w.replica("a-0").view()
        assert a0.restarts_of("exit") == 1 and a0.restarts_of("signal") == 1, a0
        assert a0.last_exit is not None and a0.last_exit.signal == "SIGKILL"
        assert ("a-standby-0", 1, "exited") in w.lost  # the promoted child's own address
        standby = w.replica("a-standby-0").view()
        assert standby.restarts == 0 and standby.state is S.STARTING
        assert w.spawns("a-standby-0") == 2  # the new spare, nothing more
        assert (a0.state, a0.incarnation, w.spawns("a-0")) == (S.STARTING, 3, 2)
    scenario(tmp_path, body)
