"""Engines on demand: asleep when idle, awake on a request, swapped within a memory budget.

An engine group with `idle_timeout` is on demand. Its replicas past `min_replicas` start asleep
(ASLEEP: no process, not down, not a restart), and once the group has had no request in flight
or waiting for `idle_timeout`, they go to sleep again (sleep_mode stop: the process is stopped
as `enginectl stop` would, SIGTERM, stop_timeout, SIGKILL; level1/level2: vLLM's sleep mode,
the process kept, supervisor.routing.sleepmode). A request for a model with nothing awake wakes
it (through the fork server: a fresh incarnation, READY as at any start; or out of vLLM's sleep
mode) and waits in the gateway, bounded by `wake_timeout`, then flows as usual; a burst that
finds every awake replica full wakes the rest of the group.

`supervisor.memory_budget` bounds what the engines hold together, per pool (the host's memory
for engines without GPUs, each GPU's for the others), by each replica's `memory_limit` or else
the most it was measured to hold while awake. A wake that does not fit first puts the least
recently used idle on-demand groups to sleep (never one with a request in flight or waiting,
never a group without idle_timeout, never below a group's min_replicas) and wakes once their
memory is free; a model that could never fit is told at once, naming the budget.

Sleeps and wakes are counted per engine (`engined_engine_wakes_total{engine,reason}`, the wake
time histogram `engined_engine_wake_seconds`) and told as events (`sleep`, `wake`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Container, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from engined.supervisor.histogram import Histogram
from engined.supervisor.lifecycle.clock import Clock
from engined.supervisor.lifecycle.fleet import Fleet
from engined.supervisor.lifecycle.notices import StateChange
from engined.supervisor.lifecycle.replica import Desired, Replica
from engined.supervisor.lifecycle.state import EngineState
from engined.supervisor.routing.replicas import Router
from engined.supervisor.routing.routes import Waking

log = logging.getLogger("engined.ondemand")

# where a process's memory is free again (a wake waiting for it goes on)
_AT_REST = (EngineState.ASLEEP, EngineState.STOPPED, EngineState.BACKOFF, EngineState.FAILED)
TICK_S = 1.0  # how often idleness, load and the budget are looked at
WAKE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
Pool = str  # "host", or "gpu:N"
# (pids) -> {pid: (resident bytes of its tree, {gpu index: bytes on it})}
Measure = Callable[[list[int]], Awaitable[dict[int, tuple[int, dict[int, int]]]]]


def _bytes(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


class MemoryBudget:
    """What the engines hold per pool, against supervisor.memory_budget."""

    def __init__(self, fleet: Fleet, measure: Measure | None = None) -> None:
        self.fleet, self.measure = fleet, measure
        self.held: dict[str, dict[Pool, int]] = {}  # replica -> the most it measured, per pool

    @property
    def limits(self) -> tuple[int | None, int | None]:
        b = self.fleet.spec.supervisor.memory_budget
        return b.host, b.gpu

    def pools(self, replica: Replica) -> dict[Pool, int]:
        """What it holds (or will hold when awake), per pool: its memory_limit, else the most
        it was measured to hold, else 0 (not known yet: learnt once it is READY)."""
        spec, seen = replica.spec, self.held.get(replica.name, {})
        names = [f"gpu:{g}" for g in spec.gpus] or ["host"]
        if replica.asleep_in_place:  # level 1 keeps the weights in host memory, level 2 none
            names = [p for p in names if p == "host" and spec.sleep_level == 1]
        return {p: spec.memory_limit if spec.memory_limit is not None else seen.get(p, 0)
                for p in names}

    def room(self, pool: Pool) -> int | None:
        host, gpu = self.limits
        return host if pool == "host" else gpu

    @staticmethod
    def holds(replica: Replica) -> bool:
        """It has a process, or is about to (waking, in a backoff that respawns)."""
        return replica.current is not None or (
            replica.wanted and replica.state not in (EngineState.FAILED, EngineState.STOPPED))

    def used(self, pool: Pool) -> tuple[int, int]:
        """(held in `pool`, of which by replicas already going to sleep)."""
        used = leaving = 0
        for replica in self.fleet.replicas.values():
            if self.holds(replica):
                n = self.pools(replica).get(pool, 0)
                used += n
                leaving += n if replica.desired is Desired.ASLEEP else 0
        return used, leaving

    def report(self) -> list[tuple[Pool, int | None, int]]:
        """(pool, its budget, held in it) for every pool an engine is in."""
        pools = sorted({p for r in self.fleet.replicas.values() for p in self.pools(r)})
        return [(p, self.room(p), self.used(p)[0]) for p in pools]

    def need(self, members: Iterable[Replica]) -> collections.Counter[Pool]:
        """What `members` hold together (or will, awake), per pool."""
        need: collections.Counter[Pool] = collections.Counter()
        for replica in members:
            need.update(self.pools(replica))
        return need

    def never_fits(self, members: list[Replica]) -> str | None:
        """Why `members` could not wake even with every other engine asleep (None: they
        could)."""
        for pool, n in self.need(members).items():
            room = self.room(pool)
            if room is not None and n > room:
                name = members[0].spec.served_model_name or members[0].spec.group
                return (f"the model '{name}' needs {_bytes(n)} and memory_budget."
                        f"{pool.split(':')[0]} is {_bytes(room)}: it can never wake")
        return None

    async def sample(self) -> None:
        if self.measure is None:
            return
        ready = {r.pid: r for r in self.fleet.replicas.values()
                 if r.state is EngineState.READY and r.pid is not None}
        for pid, (rss, gpus) in (await self.measure(list(ready))).items():
            replica = ready.get(pid)
            if replica is None:
                continue
            seen = self.held.setdefault(replica.name, {})
            got = {f"gpu:{g}": n for g, n in gpus.items()} if replica.spec.gpus \
                else {"host": rss}
            for pool, n in got.items():
                seen[pool] = max(seen.get(pool, 0), n)


@dataclass
class Room:
    """What a wake needs of the budget: the replicas to put to sleep first, and why it cannot
    wake yet (None: it fits now)."""

    victims: list[Replica] = field(default_factory=list)
    blocked: str | None = None
    freeing: bool = False  # it waits only for engines going to sleep (else for busy ones)


def sleepable(members: list[Replica]) -> list[Replica]:
    """The group's awake replicas that may sleep (never below its min_replicas)."""
    floor = members[0].spec.min_replicas
    return [r for r in members if r.spec.rank >= floor and r.wanted]


class Swap:
    """Which idle on-demand groups make room for a wake (a plan: OnDemand carries it out): the
    least recently used first (the last request that came or ended), never one with a request
    in flight or waiting, one waking, one without idle_timeout, nor a group's min_replicas; a
    data-parallel gang whole. Nothing is put to sleep for a wake that would still not fit."""

    def __init__(self, budget: MemoryBudget, router: Router,
                 groups: Callable[[], dict[str, list[Replica]]], waking: Container[str]) -> None:
        self.budget, self.router, self.groups, self.waking = budget, router, groups, waking

    def busy(self, group: str, members: Iterable[Replica]) -> bool:
        """A request in flight on it, or admitted and waiting for it."""
        return self.router.queued[group] > 0 or any(self.router.load(r) for r in members)

    def candidates(self, pool: Pool, keep: Container[str]) -> Iterator[list[Replica]]:
        """Each idle group's replicas that would sleep to free memory in `pool`, least
        recently used first."""
        groups = self.groups()
        for group in sorted(groups, key=lambda g: self.router.used.get(g, 0.0)):
            members = groups[group]
            if group in keep or not members[0].spec.on_demand or self.busy(group, members) \
                    or any(r.name in self.waking for r in members):
                continue
            sleepers = sleepable(members)
            held = [r for r in sleepers if pool in self.budget.pools(r)]
            if held:  # a gang sleeps whole, whatever pool its ranks hold memory in
                yield sleepers if members[0].spec.data_parallel else held

    def frees(self, replicas: Iterable[Replica], pool: Pool) -> int:
        return sum(self.budget.pools(r).get(pool, 0) for r in replicas)

    def victims(self, pool: Pool, short: int, keep: Container[str],
                chosen: list[Replica]) -> int:
        """Add to `chosen` what frees `short` bytes in `pool`; returns what is still short."""
        for sleepers in self.candidates(pool, keep):
            if short <= 0:
                break
            new = [r for r in sleepers if r not in chosen]
            chosen += new
            short -= self.frees(new, pool)
        return short

    def plan(self, group: str, waking: list[Replica]) -> Room:
        """What `waking` (sleeping replicas of `group`) needs to wake."""
        never = self.budget.never_fits(waking)
        if never is not None:
            return Room(blocked=never)
        need = self.budget.need(waking)
        chosen: list[Replica] = []
        full: set[Pool] = set()  # pools it fits in only once what is leaving has left
        for pool, n in sorted(need.items()):
            limit = self.budget.room(pool)
            used, leaving = self.budget.used(pool)
            if limit is None or used + n <= limit:
                continue
            full.add(pool)
            short = used - leaving + n - limit - self.frees(chosen, pool)
            if self.victims(pool, short, {group}, chosen) > 0:
                return Room(blocked=f"{_bytes(n)} more does not fit in memory_budget."
                                    f"{pool.split(':')[0]} {_bytes(limit)} ({_bytes(used)} "
                                    f"held by engines busy or not on demand)")
        going = [*chosen, *(r for r in waking if r.current is not None
                            and not r.asleep_in_place)] + [
            r for r in self.budget.fleet.replicas.values()
            if r.desired is Desired.ASLEEP and r.current is not None and not r.asleep_in_place
            and r not in waking
            and full & set(self.budget.pools(r))]
        if not going:
            return Room()
        whose = "its" if len(going) == 1 else "their"
        return Room(chosen, f"waiting for {', '.join(r.name for r in going)} to go to sleep "
                            f"and free {whose} memory", True)


class OnDemand:
    def __init__(self, fleet: Fleet, router: Router, clock: Clock,
                 measure: Measure | None = None) -> None:
        self.fleet, self.router, self.clock = fleet, router, clock
        self.budget = MemoryBudget(fleet, measure)
        self.wakes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.sleeps: collections.Counter[tuple[str, str]] = collections.Counter()
        self.wake_seconds: dict[str, Histogram] = {}
        self.why_asleep: dict[str, str] = {}  # replica -> why it sleeps (status)
        self._waking: dict[str, tuple[float, str]] = {}  # replica -> (asked at, reason)
        self._blocked: dict[str, str] = {}  # group -> why its wake waits (the budget)
        self.stuck: set[str] = set()  # groups whose wake waits for busy engines, not a sleep
        # group -> the reason of a wake that waits for engines going to sleep: carried out
        # when they are gone (an operator's or a burst's wake has no request to ask again)
        self._pending: dict[str, str] = {}
        self.swap = Swap(self.budget, router, self.groups, self._waking)

    # --- what the fleet is made of ------------------------------------------------------------
    def groups(self) -> dict[str, list[Replica]]:
        out: dict[str, list[Replica]] = {}
        for replica in self.fleet.replicas.values():
            if not replica.standby:
                out.setdefault(replica.spec.group, []).append(replica)
        return out

    # --- waking -------------------------------------------------------------------------------
    def for_request(self, group: str) -> Waking | None:
        """A request found no replica of `group` to serve it: wake what sleeps. None when
        nothing of the group sleeps or wakes (the request waits as it always did)."""
        members = self.groups().get(group, [])
        if not any(r.desired is Desired.ASLEEP or r.name in self._waking for r in members):
            return None
        spec = members[0].spec
        # hopeless: nothing of it awake, and not even the least it can wake (one replica, a
        # whole gang) would ever fit
        unit = members if spec.data_parallel else \
            [r for r in members if r.desired is Desired.ASLEEP][:1]
        hopeless = None if any(r.wanted for r in members) else self.budget.never_fits(unit)
        if hopeless is None:
            self.wake(group, "request")
        deadline = self.clock.monotonic() + spec.wake_timeout_s
        name = spec.served_model_name or group

        def why() -> str:
            blocked = self._blocked.get(group)
            return (f"the model '{name}' is asleep and did not wake within its wake_timeout "
                    f"({spec.wake_timeout_s:g}s): " + (blocked or "it is still starting"))
        def retry() -> None:  # nothing of it woke yet (the budget, a sleep still stopping)
            if not any(r.wanted for r in self.groups().get(group, [])):
                self.wake(group, "request", quiet=True)
        return Waking(deadline, why, hopeless, retry)

    def wake(self, name: str, reason: str, quiet: bool = False) -> list[Replica]:
        """Wake the sleeping replicas of a group (or one replica, or `all`) that fit in the
        budget, putting idle ones to sleep to make room; returns those woken now."""
        woken = []
        for group, members in self._by_group(name).items():
            asleep = [r for r in members if r.desired is Desired.ASLEEP]
            if not asleep:
                self._pending.pop(group, None)
                continue
            chosen, room = self._fit(group, members, asleep)
            self.sleep_replicas(room.victims, "budget")
            if room.blocked is not None:
                self._hold(group, room, reason, quiet)
                continue
            self._blocked.pop(group, None)
            self.stuck.discard(group)
            self._pending.pop(group, None)
            self._start(group, chosen, reason)
            woken += chosen
        return woken

    def _fit(self, group: str, members: list[Replica],
             asleep: list[Replica]) -> tuple[list[Replica], Room]:
        """Which sleeping replicas wake, and what they need: a gang whole; of a plain group as
        many as can wake now or once idle ones sleep (one at least: each fits, --check says)."""
        if members[0].spec.data_parallel:
            return asleep, self.swap.plan(group, asleep)
        for k in range(len(asleep), 0, -1):
            room = self.swap.plan(group, asleep[:k])
            if room.blocked is None or room.freeing:
                break
        return asleep[:k], room

    def _hold(self, group: str, room: Room, reason: str, quiet: bool) -> None:
        """A wake that cannot happen now: why (status, the 503), and whether it is retried."""
        assert room.blocked is not None
        if self._blocked.get(group) != room.blocked and not quiet:
            log.warning("[ondemand] %s waits to wake: %s", group, room.blocked)
        self._blocked[group] = room.blocked
        if room.freeing:
            self.stuck.discard(group)
            self._pending[group] = reason
        else:  # only busy engines could make room: an operator is told at once
            self.stuck.add(group)
            self._pending.pop(group, None)

    def _start(self, group: str, asleep: list[Replica], reason: str) -> None:
        now = self.clock.monotonic()
        for replica in asleep:
            self._waking[replica.name] = (now, reason)
            self.why_asleep.pop(replica.name, None)
        self.router.used[group] = now
        log.info("[ondemand] waking %s (%s)", ", ".join(r.name for r in asleep), reason)
        self.fleet.groups[group].start(asleep)

    def _retry_pending(self) -> None:
        for group, reason in list(self._pending.items()):
            self.wake(group, reason, quiet=True)

    def _by_group(self, name: str) -> dict[str, list[Replica]]:
        out: dict[str, list[Replica]] = {}
        for replica in self.fleet.affected(name):
            out.setdefault(replica.spec.group, []).append(replica)
        return out

    # --- sleeping -----------------------------------------------------------------------------
    def sleep(self, name: str, reason: str = "operator") -> list[Replica]:
        """Put a replica, a group or `all` to sleep (an operator's: below min_replicas too)."""
        affected = self.fleet.affected(name)
        for group in {r.spec.group for r in affected}:
            self._pending.pop(group, None)  # a wake waiting for memory is called off
        replicas = [r for r in affected if r.desired is not Desired.ASLEEP]
        self.sleep_replicas(replicas, reason)
        return replicas

    def sleep_replicas(self, replicas: list[Replica], reason: str) -> None:
        for replica in replicas:
            self.why_asleep[replica.name] = reason
            self._waking.pop(replica.name, None)
            replica.sleep()
        if replicas:
            log.info("[ondemand] %s going to sleep (%s)", ", ".join(r.name for r in replicas),
                     reason)

    # --- what happens by itself ---------------------------------------------------------------
    def on_state(self, change: StateChange) -> dict[str, Any]:
        """A replica changed state: a sleep or a wake happened (counted here, where its event
        is told: a sleep that a start overtook before it was ASLEEP is neither), a wake ended
        (its time observed); returns the event's extra fields (`event: sleep|wake`, why)."""
        view, name = change.view, change.view.name
        if self._pending and view.state in _AT_REST:  # memory came free: waiting wakes go on
            asyncio.get_running_loop().call_soon(self._retry_pending)
        if view.state is EngineState.ASLEEP:
            reason = self.why_asleep.get(name, "start")
            self.sleeps[(name, reason)] += 1
            return {"event": "sleep", "reason": reason}
        extra: dict[str, Any] = {}
        if change.old is EngineState.ASLEEP and view.state not in (EngineState.STOPPED,
                                                                   EngineState.STOPPING):
            # woken here, or by anyone else (`enginectl start`: an operator's); out of vLLM's
            # sleep mode it is READY at once
            _, reason = self._waking.setdefault(name, (self.clock.monotonic(), "operator"))
            self.wakes[(name, reason)] += 1
            extra = {"event": "wake", "reason": reason}
        if name in self._waking and view.state in (EngineState.READY, EngineState.FAILED,
                                                   EngineState.STOPPED):
            asked, _ = self._waking.pop(name)
            if view.state is EngineState.READY:
                hist = self.wake_seconds.setdefault(name, Histogram(WAKE_BUCKETS))
                hist.observe(self.clock.monotonic() - asked)
        return extra

    async def run(self) -> None:
        """Every TICK_S: idle groups to sleep, full ones woken whole, the budget kept."""
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - on-demand supervision must not end
                log.exception("[bug] on-demand tick failed; resuming")

    async def tick(self) -> None:
        now = self.clock.monotonic()
        for group, members in self.groups().items():
            spec = members[0].spec
            if not spec.on_demand:
                continue
            if self._full(group, members):  # with nothing serving, requests wait for it
                serving = any(r.serving() is not None for r in members)
                self.wake(group, "load" if serving else "request", quiet=True)
            last = self.router.used.setdefault(group, now)
            if self.swap.busy(group, members) or now - last < (spec.idle_timeout_s or 0.0):
                continue
            idle = [r for r in sleepable(members) if r.state is EngineState.READY]
            if spec.data_parallel and len(idle) < len(members):
                continue  # a gang sleeps whole, once every rank is READY
            self.sleep_replicas(idle, "idle")
        self._retry_pending()
        if any(self.budget.limits):
            await self.budget.sample()
            self._keep_budget()

    def _full(self, group: str, members: list[Replica]) -> bool:
        """Requests wait that the awake replicas have no room for, and some replica sleeps."""
        if not any(r.desired is Desired.ASLEEP for r in members):
            return False
        room = sum(r.spec.max_batch_size for r in members if r.serving() is not None)
        return self.router.queued[group] > room

    def _keep_budget(self) -> None:
        """Over budget (a model measured more than was known when it woke): idle groups sleep."""
        pools = {p for r in self.fleet.replicas.values() for p in self.budget.pools(r)}
        for pool in pools:
            room = self.budget.room(pool)
            if room is None:
                continue
            used, leaving = self.budget.used(pool)
            if used - leaving > room:
                waking = {r.spec.group for r in self.fleet.replicas.values()
                          if r.name in self._waking}
                victims: list[Replica] = []
                self.swap.victims(pool, used - leaving - room, waking, victims)
                self.sleep_replicas(victims, "budget")

    def budget_report(self) -> list[tuple[Pool, int | None, int]]:
        return self.budget.report()

    def blocked_by(self, name: str) -> str | None:
        """Why a replica's wake waits (the memory budget), if it does."""
        replica = self.fleet.replicas.get(name)
        return self._blocked.get(replica.spec.group) if replica is not None else None

    def stuck_waking(self, name: str) -> bool:
        """Its wake waits for memory that only busy or resident engines hold."""
        replica = self.fleet.replicas.get(name)
        return replica is not None and replica.desired is Desired.ASLEEP \
            and replica.spec.group in self.stuck

    def status_of(self, name: str) -> dict[str, Any] | None:
        """What status says of a replica on demand (None: it is not)."""
        replica = self.fleet.replicas.get(name)
        if replica is None or not replica.spec.on_demand and replica.desired is not Desired.ASLEEP:
            return None
        spec = replica.spec
        return {"idle_timeout_s": spec.idle_timeout_s, "min_replicas": spec.min_replicas,
                "sleep_mode": spec.sleep_mode, "in_place": replica.asleep_in_place,
                "reason": self.why_asleep.get(name, "start")
                if replica.desired is Desired.ASLEEP else None,
                "held_bytes": sum(self.budget.pools(replica).values()) or None,
                "wakes": sum(n for (engine, _), n in self.wakes.items() if engine == name)}


__all__ = ["OnDemand"]
