"""A fake launcher behind the Launcher protocol, fake children that obey scripted behaviours, and
`World`: a Fleet of real Replicas and groups over them, on a loop whose clock jumps.

The lifecycle code under test is the real one (supervisor.replica, .groups, .fleet, .policy); only
the process is fake. A fake child has a real pipe for its output (the replica's log capture runs
for real) and exits when the test says so or when a signal it does not ignore arrives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import yaml

from engined.engine import protocol as proto
from engined.supervisor.host.exits import ExitRecord, ExitStatus
from engined.supervisor.host.launcher import Child
from engined.supervisor.lifecycle.fleet import Fleet
from engined.supervisor.lifecycle.loopmonitor import LoopMonitor
from engined.supervisor.lifecycle.notices import Notices
from engined.supervisor.lifecycle.replica import AddressBook, Replica, ReplicaDeps
from engined.supervisor.lifecycle.state import EngineState
from engined.supervisor.routing.replicas import Router
from engined.supervisor.spec import EngineSpec, FleetSpec, parse_fleet
from lifecycle.autojump import VirtualClock, run

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0


@dataclass
class Behaviour:
    """How a fake child answers signals."""

    on_sigterm: str = "exit"  # "exit" (after term_delay_s, code 143) or "ignore"
    term_delay_s: float = 0.0
    cpu_seconds: float = 0.5


class FakeChild(Child):
    def __init__(self, loop: asyncio.AbstractEventLoop, clock: VirtualClock, pid: int,
                 config: proto.EngineConfig, behaviour: Behaviour) -> None:
        read_fd, self.write_fd = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(read_fd, False)
        super().__init__(pid, read_fd, loop.create_future(), clock.monotonic())
        self.loop, self.clock, self.config, self.behaviour = loop, clock, config, behaviour
        self.signals: list[int] = []
        self.signalled_at: dict[int, float] = {}  # signal -> virtual time it was first sent

    def signal_group(self, sig: int) -> bool:
        if not self.alive:
            return False
        self.signals.append(sig)
        self.signalled_at.setdefault(sig, self.clock.monotonic())
        if sig == signal.SIGKILL:
            self.loop.call_soon(self.exit, None, signal.SIGKILL)
        elif sig == signal.SIGTERM and self.behaviour.on_sigterm == "exit":
            self.loop.call_later(self.behaviour.term_delay_s, self.exit, 143)
        return True

    def write(self, text: str) -> None:
        """Output on the child's stdout/stderr pipe."""
        os.write(self.write_fd, text.encode())

    @property
    def exited_at(self) -> float:
        return self.exited.result().at_monotonic

    def exit(self, code: int | None = 0, sig: int | None = None) -> None:
        if not self.alive:
            return
        os.close(self.write_fd)
        status = ExitStatus(signal=sig) if sig is not None else ExitStatus(code=code)
        self.exited.set_result(ExitRecord(status, self.clock.monotonic(), self.clock.wall(),
                                          self.behaviour.cpu_seconds))


class FakeLauncher:
    def __init__(self, loop: asyncio.AbstractEventLoop, clock: VirtualClock) -> None:
        self.loop, self.clock = loop, clock
        self.behaviours: dict[str, Behaviour] = {}  # replica name -> behaviour of its children
        self.children: dict[str, list[FakeChild]] = {}
        self.spawn_errors: dict[str, list[OSError]] = {}  # raised by the next spawns, in order
        self.spawn_delay_s = 0.0
        self.spawn_delays: dict[str, float] = {}  # per replica name
        self._pids = iter(range(40_000, 1 << 22))

    async def start(self, spec: EngineSpec, config: proto.EngineConfig) -> Child:
        errors = self.spawn_errors.get(config.name)
        if errors:
            raise errors.pop(0)
        delay = self.spawn_delays.get(config.name, self.spawn_delay_s)
        if delay:  # a fork server's round trip: the child may run before we know it
            await asyncio.sleep(delay)
        child = FakeChild(self.loop, self.clock, next(self._pids), config,
                          self.behaviours.get(config.name, Behaviour()))
        self.children.setdefault(config.name, []).append(child)
        return child


@dataclass
class Transition:
    at: float
    name: str
    old: EngineState
    new: EngineState


@dataclass
class World:
    """A fleet on fake children. Build it inside a running AutojumpLoop (`await World.build`)."""

    fleet: Fleet
    router: Router
    launcher: FakeLauncher
    clock: VirtualClock
    notices: Notices
    transitions: list[Transition] = field(default_factory=list)
    lost: list[tuple[str, int, str]] = field(default_factory=list)  # incarnations lost
    pulses: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    @classmethod
    async def build(cls, tmp: Path, engines: list[dict[str, Any]],
                    supervisor: dict[str, Any] | None = None,
                    defaults: dict[str, Any] | None = None, in_place: Any = None) -> World:
        """`in_place`: the replicas' sleep in place (ReplicaDeps.in_place), if any."""
        loop = asyncio.get_running_loop()
        clock = VirtualClock(loop)
        spec = make_spec(engines, supervisor, defaults)
        launcher = FakeLauncher(loop, clock)
        notices, addresses = Notices(), AddressBook()
        router = Router(lambda: fleet.replicas.values(), clock.monotonic)
        deps = ReplicaDeps(
            loop=loop, clock=clock, launcher=launcher, log_dir=tmp,
            control_endpoint="ipc:///nonexistent/c", request_endpoint="ipc:///nonexistent/r",
            heartbeat_interval_s=spec.supervisor.heartbeat_interval_s,
            heartbeat_timeout_s=spec.supervisor.heartbeat_timeout_s,
            monitor=LoopMonitor(clock, grace_s=spec.supervisor.heartbeat_interval_s),
            notices=notices, addresses=addresses, rng=random.Random(0),
            in_flight=router.in_flight, in_place=in_place)
        fleet = Fleet(spec, lambda engine, owner: Replica(engine, deps, owner), clock, router,
                      addresses, rng=random.Random(0))
        world = cls(fleet, router, launcher, clock, notices)
        notices.state.subscribe(router.on_state)  # as the daemon wires it (supervisor.services)
        notices.lost.subscribe(lambda lost: world.lost.append((*lost.address, lost.why)))
        notices.state.subscribe(lambda change: world.transitions.append(
            Transition(clock.monotonic(), change.view.name, change.old, change.view.state)))
        return world

    # --- driving -----------------------------------------------------------------------------
    def replica(self, name: str) -> Replica:
        return self.fleet.replicas[name]

    def child(self, name: str) -> FakeChild:
        return self.launcher.children[name][-1]

    def spawns(self, name: str) -> int:
        return len(self.launcher.children.get(name, []))

    def state(self, name: str) -> EngineState:
        return self.replica(name).view().state

    def send(self, msg: proto.ChildMessage) -> str | None:
        return self.fleet.on_message(msg)

    def ready(self, name: str) -> None:
        child = self.child(name)
        assert self.send(proto.Ready(name, child.config.incarnation, 1.0, "cpu",
                                     child.config.model, "none")) is None

    def heartbeat(self, name: str, *, busy: bool = False,
                  last_iteration_at: float | None = None) -> str | None:
        child = self.child(name)
        stamp = self.clock.monotonic() if last_iteration_at is None else last_iteration_at
        return self.send(proto.Heartbeat(name, child.config.incarnation, 1, stamp,
                                         waiting=1 if busy else 0, running=0))

    def pulse(self, name: str, *, busy: bool = False, frozen_loop_at: float | None = None,
              every_s: float = HEARTBEAT_INTERVAL_S) -> None:
        """Heartbeat `name` every `every_s` while its current child lives (a healthy engine);
        `frozen_loop_at`: the busy loop stopped progressing then (a stall)."""
        async def beat() -> None:
            child = self.child(name)
            while child.alive:
                self.heartbeat(name, busy=busy, last_iteration_at=frozen_loop_at)
                await asyncio.sleep(every_s)
        self.stop_pulse(name)
        self.pulses[name] = asyncio.get_running_loop().create_task(beat())

    def stop_pulse(self, name: str) -> None:
        task = self.pulses.pop(name, None)
        if task is not None:
            task.cancel()

    async def settle(self, seconds: float = 0.0) -> None:
        """Let the loop run for `seconds` of virtual time (and every callback due by then)."""
        await asyncio.sleep(seconds)
        for _ in range(20):  # exit callbacks, task wake-ups: a few hops each
            await asyncio.sleep(0)

    async def until(self, predicate: Any, timeout_s: float = 3600.0, what: str = "") -> float:
        """Virtual seconds until `predicate()` holds; AssertionError past `timeout_s`."""
        began = self.clock.monotonic()
        while not predicate():
            if self.clock.monotonic() - began > timeout_s:
                raise AssertionError(f"not within {timeout_s:g}s: {what or predicate}")
            await asyncio.sleep(0.001)
        return self.clock.monotonic() - began

    async def start(self, *names: str) -> None:
        """Start supervising; READY (with heartbeats) for every name given."""
        self.fleet.start()
        await self.settle()
        for name in names:
            self.ready(name)
            self.pulse(name)
        await self.settle()

    async def close(self) -> None:
        for name in list(self.pulses):
            self.stop_pulse(name)
        for replica in self.fleet.replicas.values():
            for child in self.launcher.children.get(replica.name, []):
                child.exit(0)
        await self.settle()
        await asyncio.gather(*(r.close() for r in self.fleet.replicas.values()))

    def states_of(self, name: str) -> list[str]:
        return [t.new.value for t in self.transitions if t.name == name]


def scenario(tmp_path: Path, engines: list[dict[str, Any]],
             body: Callable[[World], Awaitable[None]], **kwargs: Any) -> None:
    """Run `body` on a World of `engines` (World.build's keyword arguments in `kwargs`) on a
    loop whose clock jumps, and close the world whatever happens."""
    async def main() -> None:
        world = await World.build(tmp_path, engines, **kwargs)
        try:
            await body(world)
        finally:
            await world.close()
    run(main)


def make_spec(engines: list[dict[str, Any]], supervisor: dict[str, Any] | None = None,
              defaults: dict[str, Any] | None = None) -> FleetSpec:
    sup = {"http": "off", "heartbeat_interval": f"{HEARTBEAT_INTERVAL_S}s",
           "heartbeat_timeout": f"{HEARTBEAT_TIMEOUT_S}s", **(supervisor or {})}
    doc: dict[str, Any] = {"version": 1, "supervisor": sup}
    if defaults:
        doc["defaults"] = defaults
    doc["engines"] = [{"replicas": 1, **({} if "command" in e else {"model": "builtin:echo"}), **e}
                      for e in engines]
    return parse_fleet(yaml.safe_dump(doc, sort_keys=False), "<lifecycle test>")


def replace_spec(spec: FleetSpec, **changes: Any) -> FleetSpec:
    return dataclasses.replace(spec, **changes)
