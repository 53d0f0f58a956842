"""The old code's and the new code's sides of an upgrade in place (supervisor.handover has the
state's capture and restore; this is the sequence): check the installed engined, hold new work,
drain, hand over, exec; and, in the exec'd process, adopt, re-attach, accept again."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from typing import Any, Protocol

from engined.supervisor import __version__
from engined.supervisor.host.reaper import children_of
from engined.supervisor.host.runtime import RuntimeLock
from engined.supervisor.services import Paths, Services, status_line
from engined.supervisor.spec import GpuLookup, load_fleet
from engined.supervisor.spec.model import FleetSpec, SpecError
from engined.supervisor.spec.reload import plan_reload
from engined.supervisor.upgrade import handover, recovery, snapshot
from engined.supervisor.webserver import CappedRunner

log = logging.getLogger("engined")

HANDOVER_FILE = "handover.json"  # the snapshot an exec'd engined resumes from
SETTLE_S = 30.0  # engines starting or stopping may take this long before an upgrade goes on


class Host(Protocol):
    """What an upgrade works on: the daemon (supervisor.daemon)."""

    services: Services
    paths: Paths
    spec: FleetSpec
    runners: dict[str, CappedRunner]
    lock: RuntimeLock | None
    argv: list[str]
    resumed: snapshot.Snapshot | None
    reload_lock: asyncio.Lock
    gpus: GpuLookup


class InPlace:
    """A daemon's upgrades in place: what it was handed (`resumed`), and the next hand-over."""

    def __init__(self, daemon: Host) -> None:
        self.d = daemon
        self.handover_s: float | None = None  # the last hand-over's gap, seen by the new code
        self._pending: dict[Any, Any] = {}  # adopted replicas -> incarnations, not READY yet
        self._adopted: list[str] = []  # the replicas whose processes were adopted
        self.abandoned = 0  # hand-overs begun and abandoned by this code (enginectl reports it)
        self.last_error: str | None = None
        self.recovered = False  # this engined adopted the engines of one that died

    def info(self) -> dict[str, Any]:
        """Status: hand-overs so far (the daemon's generation), the last one's gap and what
        ran before it."""
        resumed = self.d.resumed
        return {"handovers": self.handovers,
                "handover_s": round(self.handover_s, 4) if self.handover_s is not None else None,
                "upgraded_from": resumed.engined if resumed is not None else None,
                "recovered_from": resumed.pid if resumed is not None and self.recovered
                else None,
                "handover_cut": resumed.counters.handover_cut if resumed is not None else 0,
                "upgrade_abandoned": self.abandoned, "upgrade_error": self.last_error}

    async def upgrade(self, reply: tuple[asyncio.Future, asyncio.Event, float] | None) -> None:
        future, answered, settle_s = reply if reply is not None else (None, None, SETTLE_S)
        s = self.d.services
        async with self.d.reload_lock:
            try:
                await self._settle(settle_s)
                await self._check_new_code()
            except handover.HandoverRejected as exc:
                log.error("[upgrade] refused: %s", exc)
                if future is not None and not future.done():
                    future.set_exception(exc)
                return
            log.info("[upgrade] the new code accepts the spec: handing over %d engines",
                     len(s.fleet.replicas))
            if future is not None and not future.done():
                future.set_result({"upgrading": True, "from": __version__, "pid": os.getpid(),
                                   "handovers": self.handovers, "abandoned": self.abandoned})
                if answered is not None:  # the client has its answer before the exec
                    try:
                        await asyncio.wait_for(answered.wait(), 2.0)
                    except asyncio.TimeoutError:
                        pass
            s.notifier.reloading()
            started = time.monotonic()  # the gap begins: nothing more is accepted
            held = {key: runner.hold() for key, runner in self.d.runners.items()}
            cut = await self._drain_for_upgrade()
            try:  # an engine that died meanwhile is restarting: it settles first
                await self._settle(SETTLE_S)
            except handover.HandoverRejected as exc:
                self.abandoned += 1
                self.last_error = f"the hand-over was abandoned, engined goes on as it was: {exc}"
                log.error("[upgrade] %s", self.last_error)
                await self._serve_again(held)
                return
            self._exec(held, cut, started)

    async def _check_new_code(self) -> None:
        """The installed engined imports and accepts the current spec (`engined --check`)."""
        argv = [sys.executable, "-m", "engined.supervisor.daemon", "--check", "-c",
                self.d.paths.config]
        code, output = await handover.run_check(argv, self.d.services.watcher)
        if code != 0:
            raise handover.HandoverRejected(
                f"the installed engined does not accept the running spec (exit {code}); "
                f"nothing changed:\n{output.strip()[-2000:]}")
        try:  # the new code reads the file: it must be the spec that runs
            on_disk = load_fleet(self.d.paths.config, gpus=self.d.gpus)
        except SpecError as exc:
            raise handover.HandoverRejected(f"invalid fleet spec, nothing changed:\n{exc}") \
                from None
        plan = plan_reload(self.d.spec, on_disk).summary()
        if any(plan[key] for key in ("added", "removed", "changed", "restart_required")):
            raise handover.HandoverRejected(
                f"{self.d.paths.config} changed since it was loaded (added {plan['added']}, "
                f"removed {plan['removed']}, changed {plan['changed']}, needs a restart "
                f"{plan['restart_required']}): `enginectl reload` first, or put it back; "
                f"nothing changed")

    async def _drain_for_upgrade(self) -> int:
        """New work waits in the backlogs; every request being served finishes (bounded by the
        longest stop_timeout), each answer closing its connection. Returns how many requests
        the bound cut."""
        budget = max((r.spec.stop_timeout_s for r in self.d.services.fleet.replicas.values()),
                     default=0.0)
        deadline = time.monotonic() + budget
        while True:
            await asyncio.sleep(0.005)  # connections accepted just before are set up first
            busy = sum(runner.busy() for runner in self.d.runners.values())
            if busy == 0:
                return 0
            if time.monotonic() >= deadline:
                log.warning("[upgrade] %d request(s) still running after %.0fs: cut by the "
                            "hand-over", busy, budget)
                return busy

    async def _settle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                handover.check_handover(self.d.services.fleet.replicas.values())
                return
            except handover.HandoverRejected:
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.05)

    async def _serve_again(self, held: dict[str, int]) -> None:
        for key, fd in held.items():
            if fd >= 0:
                await self.d.runners[key].accept_again(fd)
        self.d.services.launcher.closing = False
        self.d.services.notifier.ready(status_line(self.d.services.fleet))

    def _exec(self, held: dict[str, int], cut: int, started: float) -> None:
        """The point of no return: the state to disk, the descriptors kept, exec."""
        s = self.d.services
        guard_pid, guard_fd = s.guard.hand_over()
        connections = {key: runner.idle_connections() for key, runner in self.d.runners.items()}
        fds = snapshot.Fds(lock=self.d.lock.fd if self.d.lock else None, guard_pid=guard_pid,
                           guard_fd=guard_fd, control=held.get("control"),
                           http=held.get("http"), gateway=held.get("gateway"),
                           connections=connections)
        mine = children_of(os.getpid())  # adopted after a crash: not ours, their pidfds go on
        strangers = {pid: fd for pid, fd in s.watcher.pidfds.items() if pid not in mine}
        saved = handover.capture(
            s.fleet.replicas.values(), s.clock.monotonic(), strangers,
            handovers=self.handovers + 1,
            reloads=s.control.generation, events=list(s.events.recent),
            events_total=s.events.total, counters=self._counters(cut), fds=fds,
            handover_started=time.time() - (time.monotonic() - started),
            fork_servers=s.launcher.hand_over(), adapters=s.lora.book.loaded)
        keep = [fds.lock, guard_fd, *held.values(),
                *(fd for fds_ in connections.values() for fd in fds_),
                *(server["channel_fd"] for server in saved.fork_servers)] + [
            fd for r in saved.replicas if r.process is not None
            for fd in (r.process.output_fd, r.process.pidfd)]
        path = self.d.paths.runtime_dir / HANDOVER_FILE  # not state.json: its keeper writes that
        snapshot.write(path, saved)
        s.channels.close_now()  # engines reconnect to the new code's sockets by themselves
        handover.keep_across_exec(fd for fd in keep if fd is not None and fd >= 0)
        argv = [sys.executable, "-m", "engined.supervisor.daemon", *self.d.argv]
        log.info("[upgrade] exec %s (%d engines handed over)", " ".join(argv),
                 sum(1 for r in saved.replicas if r.process is not None))
        logging.shutdown()
        os.execve(sys.executable, argv, {**os.environ, handover.ENV_HANDOVER: str(path)})

    def capture_now(self) -> snapshot.Snapshot:
        """The state as it is, for the snapshot kept current on disk (supervisor.recovery)."""
        s = self.d.services
        return handover.capture(
            s.fleet.replicas.values(), s.clock.monotonic(), handovers=self.handovers,
            reloads=s.control.generation, events=list(s.events.recent),
            events_total=s.events.total, counters=self._counters(0),
            adapters=s.lora.book.loaded)

    def _counters(self, cut: int) -> snapshot.Counters:
        s = self.d.services
        stats = s.gateway.stats if s.gateway is not None else None
        return snapshot.Counters(
            gateway_requests=[(m, o, n) for (m, o), n in stats.requests.items()] if stats
            else [],
            gateway_migrations=dict(stats.migrations) if stats else {},
            ipc_dropped=dict(s.channels.dropped),
            handover_cut=(self.d.resumed.counters.handover_cut if self.d.resumed else 0) + cut)

    @property
    def handovers(self) -> int:
        return self.d.resumed.handovers if self.d.resumed is not None else 0

    def adopt(self, saved: snapshot.Snapshot, claimer: recovery.Claimer | None = None) -> None:
        """This process was exec'd by an upgrade (or, with `claimer`, started after engined
        died): every replica's record and live process."""
        s = self.d.services
        now = s.clock.monotonic()
        claim: handover.Claim = handover.exec_claim
        how = "after an upgrade of engined in place"
        if claimer is not None:
            self.recovered = True
            now -= recovery.elapsed_since(saved)  # the snapshot's ages are from its writing
            claim, how = claimer, f"after engined pid {saved.pid} died"
            s.guard.mark(f"{saved.pid}/")
        servers = s.launcher.adopt(saved.fork_servers)
        if servers:
            log.info("[upgrade] fork server(s) %s handed over", ", ".join(map(str, servers)))
        s.lora.book.restore(saved.adapters)  # before any replica READY asks what it lacks
        by_name = {r.name: r for r in saved.replicas}
        for name, replica in s.fleet.replicas.items():
            record = by_name.pop(name, None)
            if record is None:
                continue
            inc = handover.restore(replica, record, s.watcher, now, claim, how)
            if inc is not None:
                self._adopted.append(replica.name)
                if inc.reattaching:
                    self._pending[replica] = inc
                s.guard.mark(inc.token)
        if claimer is not None:
            claimer.leftovers()  # what the guard held that no replica took: killed
            return
        for record in by_name.values():  # no longer in the spec the new code read
            if record.process is not None:
                log.warning("[upgrade] %s (pid %d) is not in the spec any more: stopping it",
                            record.name, record.process.pid)
                handover.stop_orphan(record.process)

    async def resume(self, saved: snapshot.Snapshot) -> None:
        """Then the rest back (events, counters, sockets): accept again once every adopted
        engine is reachable (bounded)."""
        s = self.d.services
        pending = self._pending
        adopted = sorted(self._adopted)
        s.events.restore(saved.events, saved.events_total)
        s.control.generation = saved.reloads
        if s.gateway is not None:
            for model, outcome, count in saved.counters.gateway_requests:
                s.gateway.stats.requests[(str(model), str(outcome))] += int(count)
            s.gateway.stats.migrations.update(saved.counters.gateway_migrations)
        s.channels.dropped.update(saved.counters.ipc_dropped)
        s.fleet.start()
        late = await handover.wait_reattached(pending, s.channels.reachable)
        fds = saved.fds or snapshot.Fds()
        if saved.handover_started:  # from the old code's last accept to the new code's first
            self.handover_s = time.time() - saved.handover_started
        self.d.runners = await s.serve(self.d.spec, self.d.paths, {
            key: fd for key, fd in (("control", fds.control), ("http", fds.http),
                                    ("gateway", fds.gateway)) if fd is not None})
        for key, runner in self.d.runners.items():
            await runner.adopt_connections(fds.connections.get(key, []))
        if self.recovered:
            s.events.publish({"at": round(time.time(), 6), "engine": None, "event": "recovery",
                              "from": saved.engined, "to": __version__, "pid": saved.pid,
                              "handovers": self.handovers, "adopted": adopted, "late": late})
            log.info("[recover] engined %s adopted %d engines of engined pid %d (%s)%s",
                     __version__, len(adopted), saved.pid, saved.engined,
                     f"; not reachable yet: {', '.join(late)}" if late else "")
            return
        s.events.publish({"at": round(time.time(), 6), "engine": None, "event": "upgrade",
                          "from": saved.engined, "to": __version__,
                          "handovers": self.handovers, "handover_s": self.handover_s,
                          "adopted": adopted, "late": late})
        log.info("[upgrade] engined %s (was %s) took over %d engines in %.3fs%s", __version__,
                 saved.engined, len(adopted), self.handover_s or 0.0,
                 f"; not reachable yet: {', '.join(late)}" if late else "")
