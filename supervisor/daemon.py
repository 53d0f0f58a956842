"""`engined`: the daemon's entry point. Builds the object graph in one place and runs the loop.

One asyncio event loop owns all state. Signal handlers only enqueue a command; SIGTERM/SIGINT,
SIGHUP and control requests all enter through `Daemon.dispatch`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import enum
import functools
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from engined.engine.contract import (
    CONTROL_SOCKET_NAME,
    EXIT_CONFIG,
    EXIT_FAILURE,
    EXIT_OK,
    REQUEST_SOCKET_NAME,
    set_process_title,
)
from engined.supervisor import __version__
from engined.supervisor.cluster.services import ClusterServices
from engined.supervisor.host import scratch
from engined.supervisor.host.fdreserve import raise_nofile_limit
from engined.supervisor.host.gpus import visible_gpus
from engined.supervisor.host.reaper import become_subreaper
from engined.supervisor.host.runtime import (
    RuntimeLock,
    StartupError,
    prepare_runtime_dir,
    resolve_log_dir,
    resolve_runtime_dir,
)
from engined.supervisor.lifecycle.notices import StateChange
from engined.supervisor.lifecycle.state import EngineState
from engined.supervisor.services import Paths, Services, status_line
from engined.supervisor.spec import GpuLookup, format_fleet, host_warnings, load_fleet, no_gpus
from engined.supervisor.spec.model import FleetSpec, SpecError
from engined.supervisor.spec.reload import LIVE_SUPERVISOR_KEYS, ReloadRejected, plan_reload
from engined.supervisor.upgrade import handover, recovery, snapshot
from engined.supervisor.upgrade.inplace import InPlace
from engined.supervisor.webserver import CappedRunner

log = logging.getLogger("engined")
DEFAULT_CONFIG = "/etc/engined/fleet.yaml"


class DaemonCommand(enum.Enum):
    SHUTDOWN = "shutdown"
    RELOAD = "reload"
    UPGRADE = "upgrade"


class Daemon:
    """Runs the services: the command loop (signals and control requests), reload, shutdown."""

    def __init__(self, spec: FleetSpec, paths: Paths, services: Services) -> None:
        self.spec, self.paths, self.services = spec, paths, services
        self.argv: list[str] = []  # engined's own arguments, for an upgrade's exec
        self.gpus: GpuLookup = no_gpus  # this host's GPUs for `gpus: auto`, read once at start
        self.lock: RuntimeLock | None = None
        self.resumed: snapshot.Snapshot | None = None  # the hand-over this run began with
        self.claimer: recovery.Claimer | None = None  # set when resumed after engined died
        self.keeper: recovery.Keeper | None = None  # <runtime_dir>/state.json, kept current
        self.kept_roots: set[int] = set()  # dead daemons whose scratch roots adopted engines use
        self.exit_code = EXIT_OK  # EXIT_FAILURE: supervisor.exit_on_failed saw an engine FAILED
        self.runners: dict[str, CappedRunner] = {}
        self.in_place = InPlace(self)  # upgrades (supervisor.upgrade)
        self.commands: asyncio.Queue[tuple[DaemonCommand, Any]] = asyncio.Queue()
        self.reload_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    @classmethod
    async def create(cls, spec: FleetSpec, paths: Paths) -> Daemon:
        """Build everything on the running loop, in one place (supervisor.services)."""
        old_soft, soft, hard = raise_nofile_limit()
        log.info("[start] file descriptors: soft limit %d raised to %d (hard %d); engines get "
                 "%d", old_soft, soft, hard, old_soft)
        daemon: Daemon
        kind = Services if spec.upstreams is None else ClusterServices  # its gateway's routes
        services = kind.build(spec, paths, old_soft, lambda: daemon.request_reload())
        daemon = cls(spec, paths, services)
        services.control.upgrade = daemon.request_upgrade
        services.control.handover_info = daemon.in_place.info
        return daemon

    def _on_state(self, change: StateChange) -> None:
        """supervisor.exit_on_failed: an engine parked FAILED ends engined with exit 1, so that
        the kubelet's (or systemd's) own restart and backoff take over the whole pod."""
        view = change.view
        if view.state is EngineState.FAILED and self.exit_code == EXIT_OK:
            log.error("[shutdown] %s is FAILED (%s) and supervisor.exit_on_failed is set: "
                      "stopping every engine, then exiting 1", view.name, view.fail_reason)
            self.exit_code = EXIT_FAILURE
            self.dispatch(DaemonCommand.SHUTDOWN)

    def dispatch(self, command: DaemonCommand, reply: Any = None) -> None:
        """The one entry for signals (via the loop's signal handlers) and control requests."""
        self.commands.put_nowait((command, reply))

    async def request_upgrade(self, answered: asyncio.Event, settle_s: float) -> dict:
        """`POST /v1/upgrade`: the new code is checked, then this returns (the caller answers
        its client and sets `answered`) and the hand-over goes on."""
        reply: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self.dispatch(DaemonCommand.UPGRADE, (reply, answered, settle_s))
        return await reply

    async def request_reload(self) -> dict:
        """`POST /v1/reload`: the same command SIGHUP enqueues, with a reply."""
        reply: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self.dispatch(DaemonCommand.RELOAD, reply)
        return await reply

    async def run(self) -> int:
        loop, s = asyncio.get_running_loop(), self.services
        become_subreaper()
        if self.resumed is not None:  # before anything can reap them: watch what we keep
            self.in_place.adopt(self.resumed, self.claimer)
        s.reaper.install(loop)
        s.reaper.reap_orphans()  # what exited while no code of ours ran (an upgrade's exec)
        self.kept_roots = self._adopted_roots()  # removed at our shutdown, not swept now
        await asyncio.to_thread(scratch.sweep_stale, self.kept_roots)
        fds = self.resumed.fds if self.resumed is not None else None
        if fds is not None and fds.guard_pid is not None and fds.guard_fd is not None:
            s.guard.adopt(fds.guard_pid, fds.guard_fd)
        else:
            s.guard.keep()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.dispatch, DaemonCommand.SHUTDOWN)
        loop.add_signal_handler(signal.SIGHUP, self.dispatch, DaemonCommand.RELOAD)
        loop.add_signal_handler(signal.SIGUSR2, self.dispatch, DaemonCommand.UPGRADE)
        if self.spec.supervisor.exit_on_failed:
            s.notices.state.subscribe(self._on_state)
        s.channels.start()
        s.monitor.start()
        resumed = self.resumed
        if resumed is None:
            self.runners = await s.serve(self.spec, self.paths)
            s.fleet.start()
        else:
            await self.in_place.resume(resumed)
        for name, job in s.background().items():
            self._spawn_task(job, name)
        s.notifier.ready(status_line(s.fleet))
        self._spawn_task(s.notifier.watchdog(s.monitor.healthy), "watchdog")
        keeper = self.keeper = recovery.Keeper(snapshot.path_in(self.paths.runtime_dir),
                                               self.in_place.capture_now, s.changed)
        await keeper.write_now()
        self._spawn_task(keeper.run(), "snapshot")
        log.info("[start] engined %s pid %d: %d engines from %s", __version__, os.getpid(),
                 len(s.fleet.replicas), self.paths.config)
        try:
            await self._command_loop()
        finally:
            await self._shutdown(list(self.runners.values()))
        return self.exit_code

    def _adopted_roots(self) -> set[int]:
        """The daemons whose scratch roots adopted engines still use (their TMPDIRs)."""
        out = set()
        for replica in self.services.fleet.replicas.values():
            inc = replica.current
            head = inc.token.partition("/")[0] if inc is not None else ""
            if head.isdigit() and int(head) != os.getpid():
                out.add(int(head))
        return out

    def _spawn_task(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def remove_sockets(self) -> None:
        """After a clean shutdown, still holding the runtime lock (nobody else can have bound
        them): the control socket and the engines' ZeroMQ ipc sockets."""
        runtime_dir = self.paths.runtime_dir
        for path in (self.paths.control_socket(self.spec), runtime_dir / CONTROL_SOCKET_NAME,
                     runtime_dir / REQUEST_SOCKET_NAME):
            try:
                path.unlink()
            except OSError:
                pass

    async def _command_loop(self) -> None:
        while True:
            command, reply = await self.commands.get()
            if command is DaemonCommand.SHUTDOWN:
                return
            if command is DaemonCommand.RELOAD:
                # A task, so a shutdown signal is seen while a reload stops removed engines.
                self._spawn_task(self._reload(reply), "reload")
            if command is DaemonCommand.UPGRADE:
                self._spawn_task(self.in_place.upgrade(reply), "upgrade")

    async def _reload(self, reply: asyncio.Future | None) -> None:
        s = self.services
        async with self.reload_lock:
            s.notifier.reloading()
            try:
                new = load_fleet(self.paths.config, gpus=self.gpus)
            except SpecError as exc:
                log.error("[reload] invalid spec, nothing changed:\n%s", exc)
                s.notifier.ready(status_line(s.fleet))
                if reply is not None and not reply.done():
                    reply.set_exception(
                        ReloadRejected(f"invalid fleet spec, nothing changed:\n{exc}"))
                return
            if (new.upstreams is None) != (self.spec.upstreams is None):
                why = ("a cluster gateway (upstreams:) and a fleet of engines are not reloaded "
                       "into one another: restart engined")
                log.error("[reload] %s; nothing changed", why)
                s.notifier.ready(status_line(s.fleet))
                if reply is not None and not reply.done():
                    reply.set_exception(ReloadRejected(why))
                return
            plan = plan_reload(self.spec, new)
            # Supervisor-level keys are not applied live: keep the running ones, so the
            # difference is reported again until engined is restarted.
            live = {key: getattr(new.supervisor, key) for key in LIVE_SUPERVISOR_KEYS}
            self.spec = dataclasses.replace(
                new, supervisor=dataclasses.replace(self.spec.supervisor, **live))
            if s.gateway is not None:
                s.gateway.api_key.reload(self.spec.supervisor.api_key_file)
            if self.spec.supervisor.control_token_file is not None:
                s.control_token.reload(self.spec.supervisor.control_token_file)
            s.reload_routes(self.spec)  # a cluster gateway's new node list
            s.fleet.apply(self.spec, plan)
            s.control.generation += 1
            summary = plan.summary()
            log.info("[reload] generation %d: added %s, removed %s, changed %s, %d unchanged%s",
                     s.control.generation, summary["added"], summary["removed"],
                     summary["changed"], len(summary["unchanged"]),
                     f"; needs a restart to apply: {summary['restart_required']}"
                     if summary["restart_required"] else "")
            s.notifier.ready(status_line(s.fleet))
            if reply is not None and not reply.done():
                reply.set_result(summary)

    async def _shutdown(self, runners: list[web.AppRunner]) -> None:
        s = self.services
        if self.keeper is not None:  # the state kept is the fleet's before the shutdown's stops
            self.keeper.closed = True
        s.notifier.stopping()
        s.fleet.stopping = True  # /readyz says 503 from now on, before the drain
        log.info("[shutdown] stopping %d engines", len(s.fleet.replicas))
        started = time.monotonic()
        second_signal = asyncio.ensure_future(self._second_shutdown_signal())
        try:
            if s.gateway is not None:  # drain: accept nothing new, finish what runs
                s.router.closing = s.gateway.router.closing = True
                budget = s.drain_budget_s()
                if not await s.gateway.drained(budget):
                    log.warning("[shutdown] %d gateway request(s) still running after %.0fs",
                                s.gateway.active, budget)
            await s.fleet.shutdown()
        finally:
            second_signal.cancel()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for runner in runners:
            await runner.cleanup()
        await s.close()
        if self.keeper is not None:
            await self.keeper.close()
        snapshot.path_in(self.paths.runtime_dir).unlink(missing_ok=True)  # nothing to adopt
        for pid in {None, *self.kept_roots}:
            await asyncio.to_thread(scratch.remove_root, pid)
        if s.stdout is not None:  # engine_logs: stdout: the last lines out before we exit
            await asyncio.to_thread(s.stdout.flush)
        log.info("[shutdown] done in %.2fs", time.monotonic() - started)

    async def _second_shutdown_signal(self) -> None:
        """While stopping gracefully, a second SIGTERM/SIGINT kills what is left at once."""
        while True:
            command, reply = await self.commands.get()
            if command is DaemonCommand.SHUTDOWN:
                log.warning("[shutdown] second signal: killing remaining engines now")
                self.services.fleet.kill_all_now()
            elif reply is not None:
                future = reply[0] if isinstance(reply, tuple) else reply
                if not future.done():
                    future.set_exception(ReloadRejected("engined is shutting down"))


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="engined",
                                     description="Supervise a fleet of ML engine-core processes.")
    parser.add_argument("-c", "--config", default=os.environ.get("ENGINED_CONFIG_FILE",
                                                                 DEFAULT_CONFIG),
                        help=f"fleet spec (YAML); default {DEFAULT_CONFIG}")
    parser.add_argument("--check", action="store_true",
                        help="validate the spec, print the resolved fleet and exit (0 or 78)")
    parser.add_argument("--stop-orphans", action="store_true",
                        help="stop the engines a dead engined left for adoption (on its "
                             "runtime directory) now, and exit: a stop, not a restart")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--version", action="version", version=f"engined {__version__}")
    return parser.parse_args(argv)


def own_argv(args: argparse.Namespace) -> list[str]:
    """engined's arguments as the exec of an upgrade passes them again."""
    return ["-c", os.path.abspath(args.config), "--log-level", args.log_level]


def seal_inherited_fds() -> list[int]:
    """Descriptors whoever started us left open (a shell's, a CI runner's) are ours to keep but
    no child's: mark them close-on-exec (posix_spawn cannot close them in the child). systemd's
    socket-activation descriptors (LISTEN_FDS, from fd 3) are left alone. Returns those sealed."""
    keep = set(range(3, 3 + int(os.environ.get("LISTEN_FDS", "0") or 0))) \
        if os.environ.get("LISTEN_PID") == str(os.getpid()) else set()
    sealed = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd < 3 or fd in keep:
            continue
        try:
            if os.get_inheritable(fd):
                os.set_inheritable(fd, False)
                sealed.append(fd)
        except OSError:
            continue  # the directory listing's own descriptor, closed by now
    return sealed


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    gpus = functools.cache(visible_gpus)  # `gpus: auto`: read once, when a spec asks for it
    try:
        spec = load_fleet(args.config, gpus=gpus)
    except SpecError as exc:
        print(f"engined: invalid fleet spec:\n{exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.check:
        for warning in host_warnings(spec):
            print(f"engined: warning: {warning}", file=sys.stderr)
        try:
            print(format_fleet(spec))
            if gpus.cache_info().currsize:  # an engine asked for `gpus: auto`: what was found
                found, source = gpus()
                print(f"gpus: auto: {len(found)} GPU(s) visible to engined on this host "
                      f"({source}): {','.join(map(str, found)) or 'none, the CPU'}")
        except BrokenPipeError:  # `engined --check | head`
            pass
        return EXIT_OK
    if args.stop_orphans:
        print(f"engined: {recovery.stop_orphans(resolve_runtime_dir(spec.supervisor.runtime_dir))}")
        return EXIT_OK
    set_process_title(f"engined: supervisor ({Path(args.config).name})", "engined")
    seal_inherited_fds()
    runtime_dir = resolve_runtime_dir(spec.supervisor.runtime_dir)
    lock = RuntimeLock(runtime_dir)
    resumed = handover.take(runtime_dir)
    claimer: recovery.Claimer | None = None
    try:
        prepare_runtime_dir(runtime_dir)
        if resumed is not None and resumed.fds is not None and resumed.fds.lock is not None:
            lock.fd = resumed.fds.lock  # still held: an flock belongs to the open file
        else:
            lock.acquire()
            # The lock is ours, so the engined before us is gone: what it left, we adopt.
            resumed = recovery.load(runtime_dir)
            orphans = recovery.claim(runtime_dir)
            if resumed is not None:
                resumed.handovers += 1
                claimer = recovery.Claimer(orphans, resumed.pid)
            elif orphans:
                recovery.Claimer(orphans, 0).leftovers()
    except (StartupError, OSError) as exc:
        print(f"engined: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    paths = Paths(os.path.abspath(args.config), runtime_dir,
                  resolve_log_dir(spec.supervisor.log_dir, runtime_dir))
    code = EXIT_FAILURE
    daemon: Daemon | None = None

    async def run() -> int:
        nonlocal daemon
        daemon = await Daemon.create(spec, paths)
        daemon.argv, daemon.lock, daemon.resumed = own_argv(args), lock, resumed
        daemon.gpus = gpus
        daemon.claimer = claimer
        return await daemon.run()

    try:
        code = asyncio.run(run())
        return code
    except StartupError as exc:
        print(f"engined: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        if code == EXIT_OK and daemon is not None:  # a clean exit leaves no socket behind
            daemon.remove_sockets()
        lock.release(unlink=code == EXIT_OK)


if __name__ == "__main__":
    sys.exit(main())
