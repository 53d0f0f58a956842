"""The routing authority (supervisor.routing) over real replicas on fake children, on a loop whose
clock jumps: who is routable, least-loaded picking, load counted per incarnation (a promoted
standby brings its own), and rolling restarts that wait for every request on a replica, a
command engine's gateway requests included."""

from __future__ import annotations

import asyncio
import signal

import pytest

from engined.engine import protocol as proto
from engined.supervisor.gateway.openai import ApiError, parse_completion
from engined.supervisor.gateway.relay import Done, Piece, Relay
from engined.supervisor.ipc import EngineLost, RequestFailed
from engined.supervisor.lifecycle.state import EngineState as S
from engined.supervisor.routing.routes import NoReplica
from lifecycle.fakes import HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S, World, scenario


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


async def _lost_on_a_lone_replica(w: World, request_timeout_s: float
                                  ) -> tuple[_Channels, asyncio.Future[list[object]]]:
    """a-0 started alone and unreachable; a request relayed to it, which tries it once and
    then waits (1 s later): its channels and the running request."""
    await w.start("a-0")
    channels = _Channels(dead="a-0")
    relay = Relay(w.router, channels, w.clock.monotonic)  # type: ignore[arg-type]
    job = parse_completion({"model": "a", "prompt": "hi", "max_tokens": 2}).first
    run_ = asyncio.ensure_future(_collect(relay.run(
        job, "a", "rid", w.clock.monotonic() + request_timeout_s, 3)))
    await w.settle(1.0)
    assert channels.sent == ["a-0"] and not run_.done()  # one try, then it waits
    return channels, run_


def test_a_lone_replica_judged_alive_after_a_loss_gets_the_request_again(tmp_path):
    """A request lost on a-0 that liveness then judges alive (it heartbeats on, READY, for a
    whole heartbeat_timeout after the loss: the loss was its connection's) goes back to a-0,
    instead of waiting for another replica until its request_timeout."""
    async def body(w: World) -> None:
        channels, run_ = await _lost_on_a_lone_replica(w, request_timeout_s=600)
        channels.dead = ""  # the trouble passes; a-0 never stopped heartbeating
        await w.settle(HEARTBEAT_TIMEOUT_S - 1.5)
        assert channels.sent == ["a-0"] and not run_.done()  # liveness may still be deciding
        await w.settle(1.0)
        out = await run_
        assert channels.sent == ["a-0", "a-0"] and out[-1].moves == 1
        assert w.spawns("a-0") == 1 and w.state("a-0") is S.READY  # nothing was restarted
    scenario(tmp_path, [{"name": "a", "replicas": 1}], body)


class _Unreachable(RequestFailed):
    pass


class _Channels:
    """The engine channels as the relay uses them: sending to `dead` fails at once (its
    incarnation is gone, its exit not handled yet); any other answers the whole prompt."""

    def __init__(self, dead: str) -> None:
        self.dead, self.sent = dead, []

    def open(self, address, request, wake=()):
        self.sent.append(address[0])
        if address[0] == self.dead:
            raise _Unreachable(f"cannot send to {address[0]}:{address[1]}: Host unreachable")
        return _Answer(address, request)


class _Answer:
    def __init__(self, address, request) -> None:
        self.address, self.request, self.done = address, request, False

    async def next(self, timeout_s=None):
        if self.done:
            raise StopAsyncIteration
        self.done = True
        return proto.GenerateResult(self.request.id, self.address[0], self.address[1],
                                    self.request.prompt, finish_reason="stop",
                                    prompt_tokens=2, completion_tokens=2)

    def close(self) -> None:
        pass


def test_a_request_is_never_sent_back_to_an_incarnation_it_was_lost_on(tmp_path):
    """a-0 cannot be reached (its exit not handled yet), stays READY and is the least loaded:
    the request goes to a-1 after one move, not to a-0 again until migration_limit runs out."""
    async def body(w: World) -> None:
        await w.start("a-0", "a-1")
        busy = w.router.pick([w.replica("a-1")])  # a-1 has a request: a-0 is picked first
        assert busy is not None
        channels = _Channels(dead="a-0")
        relay = Relay(w.router, channels, w.clock.monotonic)  # type: ignore[arg-type]
        job = parse_completion({"model": "a", "prompt": "hi", "max_tokens": 2}).first
        out = [item async for item in relay.run(job, "a", "rid", w.clock.monotonic() + 60, 3)]
        assert channels.sent == ["a-0", "a-1"]
        assert isinstance(out[-1], Done) and (out[-1].engine, out[-1].moves) == ("a-1", 1)
    scenario(tmp_path, [{"name": "a", "replicas": 2}], body)


def test_a_lone_unreachable_replica_is_waited_out_not_retried(tmp_path):
    """With nothing else to go to, the request waits for a-0's replacement (its exit handled,
    a new incarnation READY) instead of spending its moves on the dead one in a millisecond."""
    async def body(w: World) -> None:
        channels, run_ = await _lost_on_a_lone_replica(w, request_timeout_s=60)
        channels.dead = ""  # the replacement answers
        w.stop_pulse("a-0")
        w.child("a-0").exit(None, signal.SIGKILL)
        await w.until(lambda: w.spawns("a-0") == 2)
        w.ready("a-0")
        w.pulse("a-0")
        out = await run_
        assert channels.sent == ["a-0", "a-0"] and out[-1].moves == 1
        assert w.replica("a-0").view().incarnation == 2
    scenario(tmp_path, [{"name": "a"}], body)


class _DiesAfter:
    """An engine stream that delivers `tokens` then loses its engine."""

    def __init__(self, address, request, tokens: int) -> None:
        self.address, self.request, self.left = address, request, tokens

    async def next(self, timeout_s=None):
        if self.left == 0:
            raise EngineLost(f"{self.address[0]} exited", self.address[0], "exit")
        self.left -= 1
        return proto.TokenChunk(self.request.id, self.address[0], self.address[1], [104], "h")

    def close(self) -> None:
        pass


class _DyingChannels(_Channels):
    """a-0 loses every request after `tokens` tokens; the others answer it whole."""

    def __init__(self, tokens: int) -> None:
        super().__init__(dead="")
        self.tokens = tokens

    def open(self, address, request, wake=()):
        self.sent.append((address[0], list(request.resume)))
        if address[0] == "a-0":
            return _DiesAfter(address, request, self.tokens)
        return _Answer(address, request)


@pytest.mark.parametrize("tokens", [0, 2])
def test_a_structured_output_stream_moves_only_before_its_first_token(tmp_path, tokens):
    """Under a structured-output grammar (its state lives in the engine), a stream whose engine
    dies before its first token is resent; after it, it ends with a 503 naming why instead of
    continuing under a grammar that would start again. A plain stream moves either way."""
    async def body(w: World) -> None:
        await w.start("a-0", "a-1")
        busy = w.router.pick([w.replica("a-1")])  # a-0 is picked first
        assert busy is not None
        for structured in (True, False):
            channels = _DyingChannels(tokens)
            relay = Relay(w.router, channels, w.clock.monotonic)  # type: ignore[arg-type]
            fields = {"response_format": {"type": "json_object"}} if structured else {}
            job = parse_completion({"model": "a", "prompt": "hi", "max_tokens": 8,
                                    "stream": True, **fields}).first
            run = relay.run(job, "a", "rid", w.clock.monotonic() + 60, 3)
            if structured and tokens:
                with pytest.raises(ApiError) as err:
                    await _collect(run)
                assert (err.value.status, err.value.code) == (503, "cannot_move")
                assert channels.sent == [("a-0", [])]
                continue
            out = await _collect(run)
            assert channels.sent == [("a-0", []), ("a-1", [104] * tokens)]
            assert sum(isinstance(item, Piece) for item in out) == tokens + 1
            assert isinstance(out[-1], Done) and out[-1].moves == 1
    scenario(tmp_path, [{"name": "a", "replicas": 2}], body)


async def _collect(items):
    return [item async for item in items]
