"""Timings that end-to-end tests used to bound in wall-clock seconds, pinned exactly here instead
(virtual seconds on a loop whose clock jumps). An end-to-end test on a loaded machine can only
show the order of events; the deadline itself is checked here, where nothing is ever late.

- the systemd watchdog: WATCHDOG=1 every WATCHDOG_USEC / 2, none while the loop is unhealthy
  (tests/e2e/test_systemd.py);
- the second shutdown signal: what is left is SIGKILLed at that moment, not at stop_timeout
  (tests/e2e/test_daemon.py);
- a stop while loading: the child's own exit ends it, no stop_timeout wait
  (tests/e2e/test_supervision.py);
- the gateway: no routable replica means 503 exactly at the request's deadline, and a replica
  that becomes READY before it is taken (tests/e2e/test_gateway.py).

The lifecycle's other deadlines (backoff, hang, stall, startup, stop escalation, the cleanup's
stop_timeout) are pinned in tests/lifecycle/test_replica.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import pytest

from engined.supervisor.lifecycle.state import EngineState as S
from engined.supervisor.observe.systemd import Notifier
from engined.supervisor.routing.routes import NoReplica
from lifecycle.autojump import run
from lifecycle.fakes import Behaviour, World, scenario

# --- systemd: the watchdog's cadence ----------------------------------------------------------

def test_the_watchdog_beats_every_half_watchdog_usec_and_never_while_unhealthy():
    """A real datagram socket, read on the jumping loop: each WATCHDOG=1 is stamped with the
    virtual time it was sent at (the loop polls ready sockets before every jump)."""
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        name = f"engined-pin-{os.getpid()}-{id(loop)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        listener.bind("\0" + name)
        listener.setblocking(False)
        beats: list[float] = []
        t0 = loop.time()

        def receive() -> None:
            while True:
                try:
                    data = listener.recv(4096)
                except BlockingIOError:
                    return
                if b"WATCHDOG=1" in data.split(b"\n"):
                    beats.append(loop.time() - t0)

        loop.add_reader(listener.fileno(), receive)
        notifier = Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "400000"})
        # the loop is wedged (LoopMonitor.healthy() false) from 2.0 s until 3.0 s
        task = loop.create_task(notifier.watchdog(
            lambda: not 2.0 - 1e-9 <= loop.time() - t0 < 3.0 - 1e-9))
        try:
            await asyncio.sleep(4.05)
        finally:
            task.cancel()
            loop.remove_reader(listener.fileno())
            listener.close()
            notifier.close()
        return beats

    beats = run(main)
    expected = [k * 0.2 for k in range(21) if not 2.0 - 1e-9 <= k * 0.2 < 3.0 - 1e-9]
    assert beats == pytest.approx(expected, abs=1e-6)


# --- shutdown: the second signal --------------------------------------------------------------

def test_a_second_shutdown_signal_kills_what_is_left_at_that_moment(tmp_path):
    async def body(w: World) -> None:
        for name in ("a-0", "a-1"):
            w.launcher.behaviours[name] = Behaviour(on_sigterm="ignore")
        await w.start("a-0", "a-1")
        children = [w.child(n) for n in ("a-0", "a-1")]
        began = w.clock.monotonic()
        shutdown = asyncio.ensure_future(w.fleet.shutdown())
        await w.settle(3.0)
        assert all(c.alive and c.signals[:1] == [signal.SIGTERM] for c in children)
        w.fleet.kill_all_now()  # what the daemon does on a second SIGTERM/SIGINT
        await shutdown
        assert w.clock.monotonic() - began == pytest.approx(3.0, abs=1e-6)
        for child in children:
            assert not child.alive
            assert child.signalled_at[signal.SIGKILL] - began == pytest.approx(3.0, abs=1e-6)
        assert [w.replica(n).view().state for n in ("a-0", "a-1")] == [S.STOPPED, S.STOPPED]

    scenario(tmp_path, [{"name": "a", "replicas": 2, "stop_timeout": "20s"}], body)


# --- a stop while loading ---------------------------------------------------------------------

def test_a_stop_while_loading_ends_at_the_childs_own_exit(tmp_path):
    async def body(w: World) -> None:
        w.launcher.behaviours["a-0"] = Behaviour(on_sigterm="exit", term_delay_s=0.5)
        w.fleet.start()
        await w.settle(1.0)
        child = w.child("a-0")
        assert w.replica("a-0").view().state is S.STARTING  # never READY: still loading
        began = w.clock.monotonic()
        w.fleet.command("stop", "a-0")
        await w.until(lambda: not child.alive)
        assert child.exited_at - began == pytest.approx(0.5, abs=1e-6)
        assert signal.SIGKILL not in child.signals
        await w.settle()
        view = w.replica("a-0").view()
        assert (view.state, view.pid, view.restarts) == (S.STOPPED, None, 0)

    scenario(tmp_path, [{"name": "a", "stop_timeout": "20s", "startup_timeout": "60s"}], body)


# --- the gateway: waiting for a replica, up to the request's deadline -------------------------

def test_no_routable_replica_is_503_exactly_at_the_deadline(tmp_path):
    async def body(w: World) -> None:
        await w.start("a-0")
        w.fleet.command("stop", "a")
        await w.settle()
        began = w.clock.monotonic()
        with pytest.raises(NoReplica, match="could serve the request in time"):
            await w.router.acquire("a", began + 7.0)  # the gateway answers 503 (Retry-After)
        assert w.clock.monotonic() - began == pytest.approx(7.0, abs=1e-6)

    scenario(tmp_path, [{"name": "a"}], body)


def test_a_replica_ready_before_the_deadline_is_taken_then(tmp_path):
    async def body(w: World) -> None:
        await w.start("a-0")
        w.fleet.command("stop", "a")
        await w.settle()
        began = w.clock.monotonic()
        waiting = asyncio.ensure_future(w.router.acquire("a", began + 7.0))
        await w.settle(2.0)
        assert not waiting.done()
        w.fleet.command("start", "a")
        await w.settle()
        w.ready("a-0")  # READY is a state change: the waiting request looks again at once
        w.pulse("a-0")
        lease = await waiting
        assert lease.replica.name == "a-0" and w.router.load(lease.replica) == 1
        assert w.clock.monotonic() - began == pytest.approx(2.0, abs=1e-6)

    scenario(tmp_path, [{"name": "a"}], body)
