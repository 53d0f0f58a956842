"""The lifecycle tier: real replicas, groups and fleet on fake children, on a loop whose clock
jumps. Every deadline is checked exactly (virtual seconds), and the whole file runs in well under
a second: stop escalation, restarts, backoff, the start limit, hang / stall / startup detection,
the cleanup grace, operator commands racing exits, data-parallel gangs, reload and shutdown."""

from __future__ import annotations

import asyncio
import signal

import pytest

from engined.engine import protocol as proto
from engined.supervisor.lifecycle.state import EngineState as S
from engined.supervisor.spec.reload import plan_reload
from lifecycle.fakes import HEARTBEAT_TIMEOUT_S, Behaviour, World, make_spec, scenario

NO_JITTER = {"backoff": {"initial": "1s", "max": "30s", "factor": 2, "jitter": 0,
                         "reset_after": "60s"},
             "start_limit": {"burst": 4, "interval": "120s"}}



# --- stop: SIGTERM, stop_timeout, SIGKILL -----------------------------------------------------

@pytest.mark.parametrize("behaviour, stop_timeout_s, took_s, killed", [
    (Behaviour(on_sigterm="ignore"), 30.0, 30.0, True),
    (Behaviour(on_sigterm="ignore"), 2.0, 2.0, True),
    (Behaviour(on_sigterm="exit", term_delay_s=0.0), 30.0, 0.0, False),
    (Behaviour(on_sigterm="exit", term_delay_s=12.5), 30.0, 12.5, False),
    (Behaviour(on_sigterm="exit", term_delay_s=31.0), 30.0, 30.0, True),
])
def test_stop_escalates_to_sigkill_exactly_at_stop_timeout(tmp_path, behaviour, stop_timeout_s,
                                                             took_s, killed):
    async def body(w: World) -> None:
        w.launcher.behaviours["a-0"] = behaviour
        await w.start("a-0")
        child = w.child("a-0")
        began = w.clock.monotonic()
        w.fleet.command("stop", "a")
        await w.until(lambda: not child.alive)
        assert child.exited_at - began == pytest.approx(took_s, abs=1e-6)
        assert (signal.SIGKILL in child.signals) is killed
        assert child.signals[:2] == [signal.SIGTERM, signal.SIGCONT]  # SIGCONT: a SIGSTOPped child
        await w.settle()
        view = w.replica("a-0").view()
        assert (view.state, view.wanted, view.pid, view.restarts) == (S.STOPPED, False, None, 0)
        assert w.states_of("a-0") == ["STARTING", "READY", "STOPPING", "STOPPED"]
        assert w.lost == [("a-0", 1, "was stopped")]

    scenario(tmp_path, [{"name": "a", "stop_timeout": f"{stop_timeout_s}s"}], body)


def test_shutdown_stops_everything_under_one_shared_deadline(tmp_path):
    async def body(w: World) -> None:
        for name in ("a-0", "a-1", "b-0"):
            w.launcher.behaviours[name] = Behaviour(on_sigterm="ignore")
        await w.start("a-0", "a-1", "b-0")
        children = [w.child(n) for n in ("a-0", "a-1", "b-0")]
        began = w.clock.monotonic()
        await w.fleet.shutdown()
        # one deadline for all (the longest stop_timeout), not one after the other
        assert w.clock.monotonic() - began == pytest.approx(20.0, abs=1e-6)
        assert all(not c.alive and c.signals[-1] == signal.SIGKILL for c in children)

    scenario(tmp_path, [{"name": "a", "replicas": 2, "stop_timeout": "5s"},
                        {"name": "b", "stop_timeout": "20s"}], body)


def test_a_shutdown_during_a_spawn_waits_for_its_child_and_stops_it(tmp_path):
    """A replica whose spawn is in flight (a fork server's round trip) has no pid yet, but it is
    not down: the shutdown waits for the child the spawn brings and stops it, rather than close
    the replica under its spawn (which left the child unwatched, or, when the spawn's answer
    and the close's cancellation met, a worker that never ended and a daemon that never
    exited)."""
    async def body(w: World) -> None:
        await w.start("a-0")
        w.launcher.spawn_delays["a-0"] = 1.0
        first = w.child("a-0")
        first.exit(None, signal.SIGKILL)  # the first restart is immediate: a spawn begins
        await w.settle(0.5)
        assert w.spawns("a-0") == 1 and w.replica("a-0").view().pid is None  # in flight
        await asyncio.wait_for(w.fleet.shutdown(), 60)
        assert w.spawns("a-0") == 2, "the spawn in flight came to its end"
        second = w.child("a-0")
        assert not second.alive and second.signals[0] == signal.SIGTERM, second.signals
        assert w.state("a-0") is S.STOPPED and w.replica("a-0").view().pid is None

    scenario(tmp_path, [{"name": "a"}], body)


# --- restarts, backoff, start limit -----------------------------------------------------------

def test_crash_loop_restarts_at_once_then_backs_off_then_fails(tmp_path):
    async def body(w: World) -> None:
        w.fleet.start()
        seen = 0
        while w.state("a-0") is not S.FAILED:
            await w.until(lambda seen=seen: w.spawns("a-0") > seen)
            seen += 1
            w.child("a-0").exit(1)
            await w.settle()
        children = w.launcher.children["a-0"]
        gaps = [b.spawned_at - a.exited_at for a, b in zip(children, children[1:])]
        assert gaps == pytest.approx([0.0, 1.0, 2.0, 4.0])  # immediate, then initial * factor^k
        view = w.replica("a-0").view()
        assert "start limit hit: 5 failures within 120s (burst 4)" in view.fail_reason
        assert (view.incarnation, view.restarts_of("exit"), view.pid) == (5, 4, None)
        await w.settle(3600)
        assert w.spawns("a-0") == 5  # FAILED stays down
        # `start` gives it a fresh start limit
        w.fleet.command("start", "a-0")
        await w.settle()
        assert w.spawns("a-0") == 6 and w.state("a-0") is S.STARTING
        assert w.replica("a-0").view().fail_reason == ""

    scenario(tmp_path, [{"name": "a"}], body, defaults=NO_JITTER)


def test_backoff_shows_restart_at_and_a_stop_cancels_it(tmp_path):
    async def body(w: World) -> None:
        w.fleet.start()
        await w.settle()
        w.child("a-0").exit(1)
        await w.settle()
        assert w.spawns("a-0") == 2  # the first failure restarts at once
        w.child("a-0").exit(1)
        await w.settle()
        view = w.replica("a-0").view()
        assert view.state is S.BACKOFF
        assert view.restart_at == pytest.approx(w.clock.wall() + 1.0)
        w.fleet.command("stop", "a-0")
        await w.settle(3600)
        view = w.replica("a-0").view()
        assert (view.state, view.restart_at, w.spawns("a-0")) == (S.STOPPED, None, 2)

    scenario(tmp_path, [{"name": "a"}], body, defaults=NO_JITTER)


def test_a_stable_run_resets_the_backoff(tmp_path):
    async def body(w: World) -> None:
        await w.start("a-0")
        for k in range(3):  # three quick failures: 0, 1, 2 s of backoff
            w.child("a-0").exit(1)
            await w.until(lambda k=k: w.spawns("a-0") == k + 2)
        w.ready("a-0")
        w.pulse("a-0")
        await w.settle(60.0)  # reset_after of READY
        w.child("a-0").exit(1)
        await w.settle()
        assert w.state("a-0") is S.STARTING  # immediate again: the streak was forgotten
        assert w.replica("a-0").view().restarts_of("exit") == 4

    scenario(tmp_path, [{"name": "a"}], body, defaults=NO_JITTER)


@pytest.mark.parametrize("exit_code, restart, state, respawned", [
    (0, "always", S.STARTING, True),
    (0, "on-failure", S.STOPPED, False),
    (1, "on-failure", S.STARTING, True),
    (1, "never", S.FAILED, False),
    (78, "always", S.FAILED, False),  # invalid config: never a restart loop
])
def test_exit_codes_and_restart_policies(tmp_path, exit_code, restart, state, respawned):
    async def body(w: World) -> None:
        await w.start("a-0")
        w.child("a-0").exit(exit_code)
        await w.settle()
        assert w.state("a-0") is state
        assert w.spawns("a-0") == (2 if respawned else 1)

    scenario(tmp_path, [{"name": "a", "restart": restart}], body)


def test_operator_restart_counts_manual_and_waits_for_the_old_child(tmp_path):
    async def body(w: World) -> None:
        w.launcher.behaviours["a-0"] = Behaviour(term_delay_s=3.0)
        await w.start("a-0")
        old = w.child("a-0")
        w.fleet.command("restart", "a-0")
        await w.settle(2.9)
        assert w.spawns("a-0") == 1  # never two incarnations at once
        await w.settle(0.2)
        assert not old.alive and w.spawns("a-0") == 2
        view = w.replica("a-0").view()
        assert (view.state, view.restarts_by_reason, view.last_exit) == (
            S.STARTING, (("manual", 1),), None)  # a requested exit is not a "last exit"

    scenario(tmp_path, [{"name": "a"}], body)


def test_start_while_stopping_brings_it_back_after_the_exit(tmp_path):
    async def body(w: World) -> None:
        w.launcher.behaviours["a-0"] = Behaviour(term_delay_s=5.0)
        await w.start("a-0")
        w.fleet.command("stop", "a-0")
        await w.settle(1.0)
        w.fleet.command("start", "a-0")
        await w.settle(1.0)
        assert w.spawns("a-0") == 1 and w.state("a-0") is S.STOPPING
        await w.settle(3.1)
        assert w.spawns("a-0") == 2 and w.state("a-0") is S.STARTING

    scenario(tmp_path, [{"name": "a"}], body)


# --- liveness: hang, stall, startup timeout, cleanup grace ------------------------------------

def test_hang_is_declared_exactly_heartbeat_timeout_after_the_last_heartbeat(tmp_path):
    async def body(w: World) -> None:
        await w.start("a-0")
        await w.settle(5.5)
        w.stop_pulse("a-0")  # frozen from here on: SIGSTOP, or the GIL held
        w.heartbeat("a-0")  # the last one
        last_at, child = w.clock.monotonic(), w.child("a-0")
        await w.until(lambda: signal.SIGKILL in child.signals)
        assert child.signalled_at[signal.SIGKILL] - last_at == pytest.approx(HEARTBEAT_TIMEOUT_S,
                                                                             abs=1e-6)
        await w.settle()
        view = w.replica("a-0").view()
        assert view.last_exit is not None and view.last_exit.reason == "hang"
        assert view.last_exit.signal == "SIGKILL"
        assert "out of memory" not in view.last_exit.description
        assert w.state("a-0") is S.STARTING and view.restarts_by_reason == (("hang", 1),)
        assert w.lost[-1] == ("a-0", 1, "hung (no heartbeat)")

    scenario(tmp_path, [{"name": "a"}], body)


@pytest.mark.parametrize("busy, frozen, stall_timeout_s, killed_after_s", [
    (True, True, 60.0, 60.0),  # work queued, the loop stopped: a stall after stall_timeout
    (True, True, 1.0, 1.0),  # ... however short stall_timeout is
    # an idle engine's loop that stopped coming round (it wakes every 0.5 s): a stall after
    # max(stall_timeout, 15 s): the floor when stall_timeout is shorter (the documented 15 s;
    # the engine side of it, heartbeats going on while the idle loop's stamp stops, is
    # tests/process/test_engine_child.py's, the whole wait end to end the slow tier's)
    (False, True, 60.0, 60.0),
    (False, True, 1.0, 15.0),
    (True, False, 60.0, None),  # busy and progressing
])
def test_stall_needs_work_queued_and_no_loop_progress(tmp_path, busy, frozen, stall_timeout_s,
                                                      killed_after_s):
    async def body(w: World) -> None:
        await w.start("a-0")
        frozen_at = w.clock.monotonic()
        w.pulse("a-0", busy=busy, frozen_loop_at=frozen_at if frozen else None)
        child = w.child("a-0")
        await w.settle(300.0) if killed_after_s is None else await w.until(
            lambda: signal.SIGKILL in child.signals)
        if killed_after_s is None:
            assert child.alive and w.state("a-0") is S.READY
        else:  # judged at the first heartbeat-or-deadline wake-up after frozen + stall_timeout
            assert child.signalled_at[signal.SIGKILL] - frozen_at == pytest.approx(
                killed_after_s, abs=1e-6)
            await w.settle()
            assert w.replica("a-0").view().last_exit.reason == "stall"

    scenario(tmp_path, [{"name": "a", "stall_timeout": f"{stall_timeout_s:g}s"}], body)


def test_startup_timeout_bounds_spawn_to_ready(tmp_path):
    async def body(w: World) -> None:
        w.fleet.start()
        await w.settle()
        child = w.child("a-0")
        await w.until(lambda: signal.SIGKILL in child.signals)
        assert child.signalled_at[signal.SIGKILL] - child.spawned_at == pytest.approx(45.0,
                                                                                      abs=1e-6)
        await w.settle()
        assert w.replica("a-0").view().last_exit.reason == "startup_timeout"

    scenario(tmp_path, [{"name": "a", "startup_timeout": "45s"}], body)


def test_a_child_that_announced_its_cleanup_gets_stop_timeout_not_a_hang(tmp_path):
    async def body(w: World) -> None:
        await w.start("a-0")
        child = w.child("a-0")
        w.stop_pulse("a-0")
        assert w.send(proto.Progress("a-0", 1, proto.PHASE_CLEANUP, "exception")) is None
        await w.settle(HEARTBEAT_TIMEOUT_S + 5.0)
        assert child.alive and signal.SIGKILL not in child.signals  # still in its cleanup
        child.exit(1)
        await w.settle()
        assert w.replica("a-0").view().last_exit.reason == "exit"

    scenario(tmp_path, [{"name": "a", "stop_timeout": "30s"}], body)


def test_a_cleanup_that_never_ends_is_killed_after_stop_timeout(tmp_path):
    async def body(w: World) -> None:
        await w.start("a-0")
        child = w.child("a-0")
        w.stop_pulse("a-0")
        announced = w.clock.monotonic()
        w.send(proto.Progress("a-0", 1, proto.PHASE_CLEANUP, "exception"))
        await w.until(lambda: signal.SIGKILL in child.signals)
        assert child.signalled_at[signal.SIGKILL] - announced == pytest.approx(30.0, abs=1e-6)

    scenario(tmp_path, [{"name": "a", "stop_timeout": "30s"}], body)


# --- messages ---------------------------------------------------------------------------------

def test_messages_from_other_incarnations_change_nothing(tmp_path):
    async def body(w: World) -> None:
        await w.start("a-0")
        w.child("a-0").exit(1)
        await w.settle()  # incarnation 2 is STARTING
        assert w.send(proto.Ready("a-0", 1, 1.0, "cpu", "x", "none")) == "stale"
        assert w.send(proto.Heartbeat("a-0", 3, 1, 0.0, 9, 9)) == "stale"
        assert w.send(proto.Ready("nosuch-0", 1, 1.0, "cpu", "x", "none")) == "unknown_engine"
        assert w.state("a-0") is S.STARTING
        # a late cleanup report of incarnation 1 is kept (it changes no state)
        assert w.send(proto.Goodbye("a-0", 1, "exception", {"model_freed": 1.0})) is None
        assert w.replica("a-0").view().last_cleanup == {"model_freed": 1.0, "incarnation": 1.0}
        # a loading phase that arrives after READY (another socket) does not go back in time
        w.ready("a-0")
        w.send(proto.Progress("a-0", 2, "warmup", ""))
        assert w.replica("a-0").view().phase == "serving"

    scenario(tmp_path, [{"name": "a"}], body)


def test_output_is_captured_and_kept_with_the_exit(tmp_path):
    async def body(w: World) -> None:
        await w.start("a-0")
        w.child("a-0").write("loading\nTraceback: boom\n")
        await w.settle()
        w.child("a-0").exit(1)
        await w.settle()
        tail = w.replica("a-0").view().last_exit.log_tail
        assert tail[-3:] == ("loading", "Traceback: boom", tail[-1])
        assert "exited: exit 1" in tail[-1]
        assert "Traceback: boom" in (tmp_path / "a-0.log").read_text()

    scenario(tmp_path, [{"name": "a"}], body)


# --- data-parallel gangs ----------------------------------------------------------------------

DP = {"name": "dp", "replicas": 2, "data_parallel": True}


def test_a_failed_rank_stops_its_peers_and_the_gang_restarts_once(tmp_path):
    async def body(w: World) -> None:
        await w.start("dp-0", "dp-1")
        first = w.child("dp-0").config.rendezvous
        w.child("dp-0").exit(1)
        await w.settle()
        peer = w.launcher.children["dp-1"][0]
        assert peer.signals[:1] == [signal.SIGTERM]
        await w.settle()  # the peer exits 143; then ONE decision for the group
        assert w.spawns("dp-0") == w.spawns("dp-1") == 2
        views = {n: w.replica(n).view() for n in ("dp-0", "dp-1")}
        assert views["dp-0"].restarts_by_reason == (("exit", 1),)
        assert views["dp-1"].restarts_by_reason == (("group", 1),)
        assert views["dp-1"].last_exit.reason == "group"
        again = {w.child(n).config.rendezvous for n in ("dp-0", "dp-1")}
        assert len(again) == 1 and first not in again  # a fresh rendezvous for both

    scenario(tmp_path, [DP], body)


def test_the_gang_waits_for_a_peer_that_ignores_sigterm(tmp_path):
    async def body(w: World) -> None:
        w.launcher.behaviours["dp-1"] = Behaviour(on_sigterm="ignore")
        await w.start("dp-0", "dp-1")
        w.child("dp-0").exit(1)
        await w.settle(9.9)
        assert w.spawns("dp-0") == 1 and w.state("dp-0") is S.BACKOFF  # held for its group
        await w.settle(0.2)
        assert signal.SIGKILL in w.launcher.children["dp-1"][0].signals
        assert w.spawns("dp-0") == w.spawns("dp-1") == 2

    scenario(tmp_path, [{**DP, "stop_timeout": "10s"}], body)


def test_gang_failures_count_once_against_the_start_limit(tmp_path):
    async def body(w: World) -> None:
        w.fleet.start()
        for k in range(5):
            await w.until(lambda k=k: w.spawns("dp-0") == w.spawns("dp-1") == k + 1)
            peer = w.child("dp-0")
            w.child("dp-1").exit(1)
            await w.until(lambda peer=peer: not peer.alive)
            await w.settle()
        views = [w.replica(n).view() for n in ("dp-0", "dp-1")]
        assert [v.state for v in views] == [S.FAILED, S.FAILED]
        assert "start limit hit: 5 failures" in views[0].fail_reason
        # operator start: the whole gang, a fresh limit
        w.fleet.command("start", "dp-1")
        await w.settle()
        assert w.spawns("dp-0") == w.spawns("dp-1") == 6

    scenario(tmp_path, [DP], body, defaults={**NO_JITTER, "backoff": {"initial": "0s",
                                                                    "max": "0s", "jitter": 0}})


def test_a_second_rank_failing_while_the_gang_stops_counts_as_group(tmp_path):
    async def body(w: World) -> None:
        w.launcher.behaviours["dp-1"] = Behaviour(on_sigterm="ignore")
        await w.start("dp-0", "dp-1")
        w.child("dp-0").exit(1)
        await w.settle(1.0)
        w.child("dp-1").exit(3)  # failed on its own while being stopped
        await w.settle()
        assert w.replica("dp-1").view().restarts_by_reason == (("group", 1),)
        assert w.replica("dp-0").view().restarts_by_reason == (("exit", 1),)

    scenario(tmp_path, [DP], body)


def test_stopping_one_rank_stops_the_gang(tmp_path):
    async def body(w: World) -> None:
        await w.start("dp-0", "dp-1")
        affected = w.fleet.command("stop", "dp-1")
        assert sorted(r.name for r in affected) == ["dp-0", "dp-1"]
        await w.settle()
        assert [w.state(n) for n in ("dp-0", "dp-1")] == [S.STOPPED, S.STOPPED]
        assert all(r.view().restarts == 0 for r in affected)

    scenario(tmp_path, [DP], body)


# --- reload -----------------------------------------------------------------------------------

def test_reload_touches_only_what_changed(tmp_path):
    async def body(w: World) -> None:
        await w.start("a-0", "a-1", "b-0", "c-0")
        old = w.fleet.spec
        new = make_spec([{"name": "a", "replicas": 3},  # a-2 added, a-0/a-1 unchanged
                         {"name": "b", "max_batch_size": 4},  # changed
                         {"name": "d"}])  # c removed, d added
        plan = plan_reload(old, new)
        pids = {n: w.child(n).pid for n in ("a-0", "a-1")}
        w.fleet.apply(new, plan)
        await w.settle()
        assert {n: w.child(n).pid for n in ("a-0", "a-1")} == pids
        assert w.spawns("b-0") == 2 and w.replica("b-0").view().restarts_by_reason == (
            ("reload", 1),)
        assert w.spawns("a-2") == 1 and w.spawns("d-0") == 1
        assert "c-0" not in w.fleet.replicas and not w.launcher.children["c-0"][0].alive
        assert list(w.fleet.replicas) == ["a-0", "a-1", "a-2", "b-0", "d-0"]

    scenario(tmp_path, [{"name": "a", "replicas": 2}, {"name": "b"}, {"name": "c"}], body)


def test_reload_that_resizes_a_gang_restarts_it_as_a_whole(tmp_path):
    async def body(w: World) -> None:
        await w.start("dp-0", "dp-1")
        new = make_spec([{**DP, "replicas": 3}])
        w.fleet.apply(new, plan_reload(w.fleet.spec, new))
        await w.settle()
        assert [w.spawns(n) for n in ("dp-0", "dp-1", "dp-2")] == [2, 2, 1]
        assert {w.child(n).config.replicas for n in ("dp-0", "dp-1", "dp-2")} == {3}
        assert len({w.child(n).config.rendezvous for n in ("dp-0", "dp-1", "dp-2")}) == 1
        assert w.replica("dp-2").view().restarts == 0

    scenario(tmp_path, [DP], body)


# --- random interleavings ---------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(20))
def test_random_interleavings_keep_the_invariants(tmp_path, seed):
    """Operator commands, crashes, READYs and time passing in random order: no illegal
    transition, never two live children for one replica, STOPPED/FAILED hold no process."""
    import random

    async def body(w: World) -> None:
        rng = random.Random(seed)
        w.fleet.start()
        names = ["a-0", "a-1", "dp-0", "dp-1"]
        for _ in range(200):
            name = rng.choice(names)
            op = rng.choice(["stop", "start", "restart", "crash", "ready", "wait", "wait"])
            if op in ("stop", "start", "restart"):
                w.fleet.command(op, rng.choice([name, name.split("-")[0], "all"]))
            elif op == "crash" and w.launcher.children.get(name):
                w.child(name).exit(rng.choice([0, 1, 78]), None)
            elif op == "ready" and w.launcher.children.get(name) and w.child(name).alive:
                w.ready(name)
            else:
                await w.settle(rng.choice([0.0, 0.5, 3.0, 40.0]))
            for n in names:
                alive = [c for c in w.launcher.children.get(n, []) if c.alive]
                assert len(alive) <= 1, (n, alive)
                assert w.replica(n).supervising, n  # no exception ended its coroutine
                view = w.replica(n).view()
                if view.state in (S.STOPPED, S.FAILED, S.BACKOFF):
                    await w.settle()  # the exit callback runs on the next turn
        # and it can always be brought back
        await w.settle()  # the last crash's exit is handled first (an exit 78 means FAILED)
        w.fleet.command("start", "all")
        for _ in range(30):
            await w.settle(1.0)
            for n in names:
                if w.state(n) is S.STARTING and w.child(n).alive:
                    w.ready(n)
                    w.pulse(n)
        assert {n: w.state(n) for n in names} == {n: S.READY for n in names}

    scenario(tmp_path, [{"name": "a", "replicas": 2}, DP], body,
             defaults={"startup_timeout": "30s", "backoff": {"initial": "1s", "max": "4s"}})


# --- the daemon's own pauses ------------------------------------------------------------------

def _freeze(seconds: float) -> None:
    """engined does not run for `seconds` (SIGSTOP, a VM pause): time passes, nothing runs."""
    loop = asyncio.get_running_loop()
    loop.now += seconds  # type: ignore[attr-defined]  # the AutojumpLoop's clock


def test_a_pause_of_the_daemon_itself_is_never_blamed_on_engines(tmp_path):
    async def body(w: World) -> None:
        await w.start("a-0", "a-1")
        children = {n: w.child(n) for n in ("a-0", "a-1")}
        for name in children:
            w.stop_pulse(name)
            w.heartbeat(name)
        _freeze(2.5 * HEARTBEAT_TIMEOUT_S)
        await asyncio.sleep(0)  # the overdue deadlines fire first, before anything is read...
        for name in children:
            w.pulse(name)  # ...then the heartbeats that queued meanwhile
        await w.settle(60.0)
        assert all(c.alive and not c.signals for c in children.values())
        assert [w.replica(n).view().restarts for n in children] == [0, 0]
        monitor = w.replica("a-0").deps.monitor
        assert monitor.stalled_seconds_total >= 1.5 * HEARTBEAT_TIMEOUT_S
        # an engine that really froze is still caught one timeout after its last heartbeat
        w.stop_pulse("a-0")
        w.heartbeat("a-0")
        last = w.clock.monotonic()
        await w.until(lambda: signal.SIGKILL in children["a-0"].signals)
        took = children["a-0"].signalled_at[signal.SIGKILL] - last
        assert took == pytest.approx(HEARTBEAT_TIMEOUT_S, abs=1e-6)
        assert children["a-1"].alive

    scenario(tmp_path, [{"name": "a", "replicas": 2}], body)


def test_no_verdict_until_a_heartbeat_interval_after_the_pause(tmp_path):
    async def body(w: World) -> None:
        await w.start("a-0")
        child = w.child("a-0")
        w.stop_pulse("a-0")
        w.heartbeat("a-0")
        _freeze(3 * HEARTBEAT_TIMEOUT_S)
        resumed = w.clock.monotonic()
        await w.until(lambda: signal.SIGKILL in child.signals)
        # nothing arrived after the pause either: hang, but judged only once the grace (one
        # heartbeat interval) passed and the extended deadline was reached
        assert child.signalled_at[signal.SIGKILL] >= resumed + 1.0 - 1e-6
        await w.settle()
        assert w.replica("a-0").view().last_exit.reason == "hang"

    scenario(tmp_path, [{"name": "a"}], body)


def test_a_shutdown_during_a_slow_stop_brings_its_sigkill_forward(tmp_path):
    """A restart is stopping a child that ignores SIGTERM (stop_timeout 30 s); a shutdown with a
    5 s shared deadline comes 1 s later: the SIGKILL comes at the shutdown's deadline."""
    async def body(w: World) -> None:
        w.launcher.behaviours["a-0"] = Behaviour(on_sigterm="ignore")
        await w.start("a-0")
        child = w.child("a-0")
        w.fleet.command("restart", "a-0", all_at_once=True)
        await w.settle(1.0)
        assert child.signals[:1] == [signal.SIGTERM]
        began = w.clock.monotonic()
        await w.fleet.shutdown(deadline_s=5.0)
        assert child.signalled_at[signal.SIGKILL] - began == pytest.approx(5.0, abs=1e-6)
        assert w.spawns("a-0") == 1  # the restart never happened: it was stopped for good

    scenario(tmp_path, [{"name": "a", "stop_timeout": "30s"}], body)
