"""A replica's worker: the one coroutine that starts, watches and reports its processes.

Kubernetes' kubelet runs a worker per pod that syncs what runs with what should; this is that for
one replica. Commands (supervisor.replica) only write the replica's `Intent` and wake the worker;
the worker spawns an `Incarnation` when a spawn is due, watches it until it exits (liveness
through its strategy, a requested stop escalated SIGTERM -> stop_timeout -> SIGKILL), reports
the exit to the replica's owner, and clears what the incarnation left behind before the next
spawn. A promoted standby's incarnation is watched by the worker of the replica it joined.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from engined.supervisor.host import scratch
from engined.supervisor.host.gpus import wait_gpu_released
from engined.supervisor.host.launcher import Child, owner_token
from engined.supervisor.lifecycle.incarnation import Incarnation
from engined.supervisor.lifecycle.notices import Lost
from engined.supervisor.lifecycle.policy import check_liveness, reached
from engined.supervisor.lifecycle.replica import Command, Replica
from engined.supervisor.lifecycle.state import EngineState, Reason
from engined.supervisor.logs import PipeReader

log = logging.getLogger("engined.engine")


def supervise(replica: Replica) -> None:
    """Start the replica's worker (it runs until the replica is closed)."""
    # a fresh replica starts now; one handed over by an upgrade keeps its process, its
    # backoff or its FAILED park (supervisor.handover)
    if replica.current is None and replica.intent.spawn_due is None and replica.wanted \
            and replica.state is EngineState.STOPPED:
        replica.intent.spawn_due = replica.clock.monotonic()
    replica.watched(replica.deps.loop.create_task(ReplicaWorker(replica).run(),
                                                  name=f"engine:{replica.name}"))


class ReplicaWorker:
    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.deps, self.clock, self.intent = replica.deps, replica.clock, replica.intent
        self._in_place: asyncio.Task[None] | None = None  # a sleep or wake in vLLM's mode

    async def run(self) -> None:
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                if self._in_place is not None:  # the replica is closed: its sleep or wake too
                    self._in_place.cancel()
                raise
            except Exception:  # noqa: BLE001 - supervision of an engine must never end
                log.exception("[bug] %s: internal error in its supervision, resuming in 1s",
                              self.replica.name)
                await asyncio.sleep(1.0)

    async def _step(self) -> None:
        inc = self.replica.current
        if inc is None:
            due, now = self.intent.spawn_due, self.clock.monotonic()
            if due is None or not reached(now, due) or not self.replica.wanted:
                await self._sleep(due)
                return
            self.intent.spawn_due = None
            inc = await self._spawn()
            if inc is None:
                return
        if inc.attached and await self._watch(inc):
            await self._clear_leftovers(inc)

    async def _sleep(self, until: float | None) -> None:
        self.intent.wakeup.clear()
        try:
            timeout_s = None if until is None else max(0.0, until - self.clock.monotonic())
            await asyncio.wait_for(self.intent.wakeup.wait(), timeout_s)
        except asyncio.TimeoutError:
            self.deps.monitor.note(until or 0.0, self.clock.monotonic())

    # --- spawn ---------------------------------------------------------------------------------
    async def _spawn(self) -> Incarnation | None:
        """Start a process; None (and the owner told) if it could not be started at all."""
        replica, intent = self.replica, self.intent
        if intent.reason is not None:  # counted per attempt, whether it spawns or not
            replica.history.restarts[intent.reason] += 1
            intent.reason = None
        number = replica.incarnation + 1
        address = (replica.name, number)
        inc = Incarnation(address, owner_token(replica.name, number),
                          self.deps.liveness_for(replica.spec, lambda: inc))
        replica.spawning(inc)
        try:
            child = await self.deps.launcher.start(replica.spec, replica.child_config(number))
        except OSError as exc:
            replica.spawn_failed()
            command, intent.command = intent.command, None
            scratch.remove(inc.token)  # made for it: unused
            replica.owner.on_spawn_failed(replica, replica.history.spawn_failed(exc, self.clock))
            if not replica.wanted and command is not None:
                replica.set_state(replica.at_rest)  # asked to stop (or sleep) meanwhile: it is
            return None
        except BaseException:
            replica.spawn_failed()
            raise
        early = inc.attach(child, PipeReader(self.deps.loop, child.output_fd, replica.log),
                           replica.log.lines_total)
        replica.spawned(number)
        replica.log.note(f"spawned pid {child.pid} incarnation {number} by {child.launcher}")
        log.info("[spawn] %s pid %d incarnation %d by %s", replica.name, child.pid, number,
                 child.launcher)
        inc.liveness.begin(address, child.port, replica.on_message, intent.wakeup.set)
        for msg in early:  # what it said before its spawn returned, now that it is ours
            replica.on_message(msg)
        return inc

    # --- watch ---------------------------------------------------------------------------------
    async def _watch(self, inc: Incarnation) -> bool:
        """Until its process exits: enforce liveness, carry out stop/restart commands. True
        once its exit is handled here; False if it was handed over (a promoted standby's)."""
        replica, child = self.replica, inc.child
        assert child is not None
        killed_for: Reason | None = None
        requested: Command | None = None
        while child.alive:
            if replica.current is not inc:
                return False  # promoted: another replica's worker watches it from now on
            now = self.clock.monotonic()
            if self.intent.command in (Command.SLEEP, Command.WAKE) and requested is None:
                if self._in_place is None or self._in_place.done():  # one at a time
                    command, self.intent.command = self.intent.command, None
                    self._in_place = self.deps.loop.create_task(
                        self._sleep_or_wake(inc, command), name=f"{command.value}:"
                                                                f"{replica.name}")
            elif self.intent.command is not None and requested is None:
                requested, self.intent.command = self.intent.command, None
                replica.set_state(EngineState.STOPPING)
                log.info("[stop] %s pid %d: SIGTERM to its process group", replica.name,
                         child.pid)
                inc.terminate(now, replica.spec.stop_timeout_s, self.intent.stop_by)
                self.intent.stop_by = None
            next_at: float | None
            if requested is not None or killed_for is not None:
                killed, next_at = inc.escalate(now)
                if killed:
                    log.warning("[stop] %s pid %d did not exit in time: SIGKILL", replica.name,
                                child.pid)
            else:
                killed_for, next_at = self._judge(inc, now)
                if killed_for is not None:
                    self._kill_for(inc, killed_for, now)
                    next_at = inc.term_deadline or now
            await self._wait_exit_or_wake(child, next_at)
        if replica.current is not inc:
            return False  # handed over as it died: its new replica reports the exit
        self._on_exit(inc, killed_for, requested)
        return True

    async def _sleep_or_wake(self, inc: Incarnation, command: Command) -> None:
        """vLLM's sleep mode, beside the watch (its liveness goes on): READY -> ASLEEP once
        drained, or ASLEEP -> READY, the process kept. What fails is left to the process: a
        failed sleep stops it (asleep all the same), a failed wake restarts it."""
        replica, in_place = self.replica, self.deps.in_place
        assert in_place is not None
        act = in_place.sleep if command is Command.SLEEP else in_place.wake
        error = await act(replica.spec, inc)
        if replica.current is not inc or not inc.alive or self.intent.command in (
                Command.STOP, Command.RESTART, Command.PEER_STOP):
            return  # it exited, or is being stopped or restarted meanwhile
        if error is not None:
            then = "stopping it instead" if command is Command.SLEEP else "restarting it"
            log.warning("[ondemand] %s pid %s: %s failed, %s: %s", replica.name, inc.pid,
                        command.value, then, error)
            replica.log.note(f"{command.value} failed, {then}: {error}")
            if command is Command.WAKE or not replica.wanted:
                self.intent.command = Command.RESTART if command is Command.WAKE else \
                    Command.STOP
        elif command is Command.SLEEP:
            inc.asleep = True
            replica.set_state(EngineState.ASLEEP)
            if replica.wanted:  # a start overtook the sleep
                self.intent.command = Command.WAKE
        else:
            inc.asleep = False
            replica.set_state(EngineState.READY)
            if not replica.wanted:  # put to sleep again meanwhile: in place again
                self.intent.command = Command.SLEEP
        self.intent.wakeup.set()

    def _judge(self, inc: Incarnation, now: float) -> tuple[Reason | None, float | None]:
        if inc.liveness.verdict is not None:
            return inc.liveness.verdict_reason, None
        replica = self.replica
        # an adopted incarnation is past its startup: judged by its heartbeats meanwhile
        starting = replica.state is EngineState.STARTING and not inc.reattaching
        facts = inc.facts(starting, replica.spec, self.deps.monitor)
        return check_liveness(now, facts)

    async def _wait_exit_or_wake(self, child: Child, until: float | None) -> None:
        """Until the child exits, a wake-up, or monotonic time `until`. A timer that fires late
        tells the loop monitor: the daemon itself did not run meanwhile."""
        self.intent.wakeup.clear()
        waker: asyncio.Future[Any] = asyncio.ensure_future(self.intent.wakeup.wait())
        timeout_s = None if until is None else max(0.0, until - self.clock.monotonic())
        try:
            await asyncio.wait({child.exited, waker}, timeout=timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waker.cancel()
        if until is not None:
            self.deps.monitor.note(until, self.clock.monotonic())

    def _kill_for(self, inc: Incarnation, reason: Reason, now: float) -> None:
        assert inc.child is not None and inc.vitals is not None
        vitals = inc.vitals
        age = now - (vitals.heartbeat_at or inc.child.spawned_at)
        if reason is Reason.MEMORY:
            hb = vitals.heartbeat
            log.warning("[memory] %s pid %d: holds more than its memory_limit (%d bytes over) "
                        "for %.1fs: SIGKILL to its group", self.replica.name, inc.child.pid,
                        -(hb.memory_headroom or 0) if hb else 0,
                        now - (vitals.over_limit_since or now))
        else:
            what = inc.liveness.missing(reason, vitals.cleanup_at is not None)
            log.warning("[%s] %s pid %d: no %s (last heartbeat %.1fs ago): SIGKILL to its "
                        "group", reason.value, self.replica.name, inc.child.pid, what, age)
        self.replica.set_state(EngineState.STOPPING)
        inc.kill(now)

    # --- exit ----------------------------------------------------------------------------------
    def _on_exit(self, inc: Incarnation, killed_for: Reason | None,
                 requested: Command | None) -> None:
        replica = self.replica
        assert inc.child is not None
        replica.exited(inc)
        inc.ended()
        record = inc.child.exited.result()
        down = replica.history.exited(inc, record, killed_for, requested is not None,
                                      self.deps.oom)
        self.deps.notices.lost.publish(Lost(inc.address, lost_because(down.reason, requested)))
        self.intent.command = None
        if not replica.wanted:
            replica.set_state(replica.at_rest)
            log.info("[stop] %s pid %d %s (%s)", replica.name, down.pid,
                     "asleep" if replica.state is EngineState.ASLEEP else "stopped",
                     record.status.describe())
        elif requested is Command.PEER_STOP:
            replica.history.record_exit(inc, record, Reason.GROUP, record.status.describe())
            replica.owner.on_down(replica, dataclasses.replace(down, reason=Reason.GROUP,
                                                               peer_stop=True))
        elif requested is not None:  # a restart, or a stop overtaken by a start
            self.intent.spawn_due = self.clock.monotonic()
        else:
            replica.history.record_exit(inc, record, down.reason, down.description)
            replica.owner.on_down(replica, down)

    async def _clear_leftovers(self, inc: Incarnation) -> None:
        """Everything the exited incarnation started is gone before its replacement spawns
        (descendants that left its process group included), and so is their GPU memory. Its
        TMPDIR goes right after that spawn: nothing needs it gone sooner."""
        assert inc.child is not None
        replica, dead = self.replica, {inc.child.pid}
        if self.deps.reaper is not None:
            dead |= set(await self.deps.reaper.clear(replica.name, inc.address[1], inc.token,
                                                     inc.child.descendant))
            self.deps.reaper.tidy(replica.name, inc.address[1], inc.token)
        if self.deps.nvml is not None:
            await wait_gpu_released(self.deps.nvml, replica.name, dead, replica.spec.gpus)


def lost_because(reason: Reason, requested: Command | None) -> str:
    """Why requests still on an incarnation failed, for their error text."""
    if requested is Command.STOP:
        return "was stopped"
    if requested is Command.RESTART:
        return "was restarted"
    if requested is Command.PEER_STOP:
        return "was stopped with its data-parallel group"
    return {Reason.HANG: "hung (no heartbeat)", Reason.STALL: "stalled (no loop progress)",
            Reason.MEMORY: "held more than its memory_limit",
            Reason.CANARY: "did not answer a canary request (hung while idle)",
            Reason.STARTUP_TIMEOUT: "did not become READY in time"}.get(reason, "exited")
