"""`engined`: the daemon's entry point. Builds the object graph in one place and runs the loop.

One asyncio event loop owns all state. Signal handlers only enqueue a command; SIGTERM/SIGINT,
SIGHUP and control requests all enter through `Daemon.dispatch`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import enum
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from engined.engine.contract import (
    CONTROL_SOCKET_NAME,
    EXIT_CONFIG,
    EXIT_FAILURE,
    EXIT_OK,
    REQUEST_SOCKET_NAME,
    set_process_title,
)
from engined.supervisor import __version__, scratch
from engined.supervisor.clock import SystemClock
from engined.supervisor.control import ControlContext, make_app
from engined.supervisor.events import transition
from engined.supervisor.fleet import Fleet
from engined.supervisor.forkserver import ForkServerLauncher
from engined.supervisor.gateway.app import ApiKey, Gateway
from engined.supervisor.gateway.router import Router
from engined.supervisor.groups import Owner
from engined.supervisor.http import MetricsEndpoint
from engined.supervisor.ipc import EngineChannels
from engined.supervisor.launcher import ChildWatcher, ExecLauncher, expose_engine_package
from engined.supervisor.loop import LoopMonitor
from engined.supervisor.oom import OomWitness
from engined.supervisor.probe import ProbeClient
from engined.supervisor.reaper import Guard, Reaper, become_subreaper
from engined.supervisor.reload import LIVE_SUPERVISOR_KEYS, ReloadRejected, plan_reload
from engined.supervisor.replica import Replica, ReplicaDeps
from engined.supervisor.resources import FdBudget, raise_nofile_limit
from engined.supervisor.runtime import (
    RuntimeError_,
    RuntimeLock,
    prepare_runtime_dir,
    resolve_log_dir,
    resolve_runtime_dir,
)
from engined.supervisor.sampler import Sampler
from engined.supervisor.spec import (
    EngineSpec,
    FleetSpec,
    SpecError,
    format_fleet,
    host_warnings,
    load_fleet,
)
from engined.supervisor.state import EngineState
from engined.supervisor.systemd import Notifier
from engined.supervisor.webserver import make_runner

log = logging.getLogger("engined")
DEFAULT_CONFIG = "/etc/engined/fleet.yaml"
# Open connections per HTTP server: enough for operators (`logs -f` followers included) and for
# Prometheus and probes; past it a connection is closed on accept (supervisor.webserver).
MAX_CONTROL_CONNECTIONS = 256
MAX_HTTP_CONNECTIONS = 64
MAX_GATEWAY_CONNECTIONS = 1024  # clients of the OpenAI API (within the fd reserve)


class DaemonCommand(enum.Enum):
    SHUTDOWN = "shutdown"
    RELOAD = "reload"


class Daemon:
    def __init__(self, spec: FleetSpec, config_path: str, runtime_dir: Path,
                 log_dir: Path) -> None:
        self.spec = spec
        self.config_path = config_path
        self.runtime_dir = runtime_dir
        self.log_dir = log_dir
        self.commands: asyncio.Queue[tuple[DaemonCommand, asyncio.Future | None]] = \
            asyncio.Queue()
        self.clock = SystemClock()
        self.fleet: Fleet | None = None
        self.channels: EngineChannels | None = None
        self.control: ControlContext | None = None
        self.sampler = Sampler()
        self.monitor = LoopMonitor(self.clock, grace_s=spec.supervisor.heartbeat_interval_s)
        self.budget = FdBudget(self._starting_children)
        self.probes = ProbeClient()  # command engines' HTTP probes and progress reads
        self.nofile: int | None = None  # the soft limit engined started with (children's)
        self.watcher = ChildWatcher()  # every child's pidfd; the reaper reaps only others
        self.reaper = Reaper(lambda: self.watcher.pids, lambda: self.watcher.holds > 0)
        self.watcher.on_release = self.reaper.reap_orphans
        self.launcher: ForkServerLauncher | None = None
        self.guard = Guard(self.watcher)
        self._stopping = False
        self.gateway: Gateway | None = None
        self.notifier = Notifier()
        self.runners: list[web.AppRunner] = []
        self._reload_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    def dispatch(self, command: DaemonCommand, reply: asyncio.Future | None = None) -> None:
        """The one entry for signals (via the loop's signal handlers) and control requests."""
        self.commands.put_nowait((command, reply))

    async def request_reload(self) -> dict:
        """`POST /v1/reload`: the same command SIGHUP enqueues, with a reply."""
        reply: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self.dispatch(DaemonCommand.RELOAD, reply)
        return await reply

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        old_soft, soft, hard = raise_nofile_limit()
        self.nofile = old_soft
        log.info("[start] file descriptors: soft limit %d raised to %d (hard %d); engines get "
                 "%d", old_soft, soft, hard, old_soft)
        become_subreaper()
        self.reaper.install(loop)
        await asyncio.to_thread(scratch.sweep_stale)
        self._start_guard()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.dispatch, DaemonCommand.SHUTDOWN)
        loop.add_signal_handler(signal.SIGHUP, self.dispatch, DaemonCommand.RELOAD)
        self.channels = EngineChannels(str(self.runtime_dir), self._on_message)
        self.fleet = Fleet(self.spec, self._replica_factory(loop), self.clock,
                           in_flight=self.channels.in_flight)
        self.channels.start()
        self.monitor.start()
        self.runners = [await self._serve_control(), *await self._serve_http(),
                        *await self._serve_gateway()]
        self.fleet.start()
        self.notifier.ready(self._status_line())
        self._spawn_task(self.notifier.watchdog(self.monitor.healthy), "watchdog")
        log.info("[start] engined %s pid %d: %d engines from %s", __version__, os.getpid(),
                 len(self.fleet.replicas), self.config_path)
        try:
            await self._command_loop()
        finally:
            await self._shutdown()
        return EXIT_OK

    def _spawn_task(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start_guard(self) -> None:
        """The guard outlives a SIGKILLed daemon and kills what it left; a dead one is replaced."""
        try:
            pid = self.guard.start()
        except OSError as exc:
            log.error("[guard] cannot start the guard (%s); retrying in 5s", exc)
            asyncio.get_running_loop().call_later(5.0, self._start_guard)
            return
        log.info("[guard] pid %d watches for engined's death", pid)
        assert self.guard.exited is not None
        self.guard.exited.add_done_callback(self._guard_exited)

    def _guard_exited(self, future: asyncio.Future[Any]) -> None:
        if self._stopping or future.cancelled():
            return
        log.warning("[guard] pid %s exited (%s): starting a new one", self.guard.pid,
                    future.result().status.describe())
        self._start_guard()

    def _starting_children(self) -> int:
        """Children that still have their ZeroMQ connections to open (the fd reserve)."""
        if self.fleet is None:
            return 0
        return sum(1 for r in self.fleet.replicas.values() if r.state is EngineState.STARTING)

    def _on_message(self, msg: Any) -> str | None:
        return self.fleet.on_message(msg) if self.fleet else "unknown_engine"

    def _status_line(self) -> str:
        ready, wanted = self.fleet.counts() if self.fleet else (0, 0)
        return f"{ready}/{wanted} engines ready"

    def _on_state(self, name: str, old: EngineState, new: EngineState) -> None:
        self.notifier.status(self._status_line())
        replica = (self.fleet.replicas.get(name) or self.fleet.retiring.get(name)
                   if self.fleet is not None else None)
        if self.control is not None and replica is not None:
            self.control.events.publish(transition(replica.view(), old.value))
        if self.gateway is not None:
            self.gateway.router.changed()

    def _engine_exited(self, name: str, incarnation: int, why: str) -> None:
        """Fail the requests still on that incarnation now, not at their timeout."""
        if self.channels is not None:
            self.channels.fail_engine(name, incarnation, why)
        if self.gateway is not None:
            self.gateway.relay.upstream.fail(name, incarnation, why)

    def _replica_factory(self, loop: asyncio.AbstractEventLoop
                         ) -> Callable[[EngineSpec, Owner], Replica]:
        assert self.channels is not None
        channels = self.channels
        pythonpath = expose_engine_package(self.runtime_dir / "python")
        self.launcher = ForkServerLauncher(
            ExecLauncher(loop, pythonpath, budget=self.budget, nofile=self.nofile,
                         watcher=self.watcher), self.log_dir)
        deps = ReplicaDeps(
            loop=loop, clock=self.clock, launcher=self.launcher,
            log_dir=self.log_dir, control_endpoint=channels.control_endpoint,
            request_endpoint=channels.request_endpoint,
            heartbeat_interval_s=self.spec.supervisor.heartbeat_interval_s,
            heartbeat_timeout_s=self.spec.supervisor.heartbeat_timeout_s,
            on_exit=self._engine_exited,
            on_state=self._on_state, monitor=self.monitor, reaper=self.reaper,
            nvml=self.sampler.nvml, probes=self.probes, oom=OomWitness(),
            log_max_bytes=self.spec.supervisor.log_max_bytes,
            log_backups=self.spec.supervisor.log_backups,
            in_flight=lambda name: self.gateway.router.in_flight(name) if self.gateway else 0)
        return lambda engine, owner: Replica(engine, deps, owner)

    async def _serve_control(self) -> web.AppRunner:
        assert self.fleet is not None and self.channels is not None
        self.control = ControlContext(self.fleet, self.channels, self.sampler, self.config_path,
                                      reload=self.request_reload)
        if self.launcher is not None:
            self.control.fork_servers = self.launcher.describe
        runner = make_runner(make_app(self.control), MAX_CONTROL_CONNECTIONS,
                             self.budget.may_accept)
        await runner.setup()
        path = self.control_socket_path
        path.unlink(missing_ok=True)  # stale from a dead daemon; we hold the lock
        old_umask = os.umask(0o177)  # the socket is born 0600: no window with looser modes
        try:
            await web.UnixSite(runner, str(path)).start()
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        log.info("[control] listening on %s", path)
        return runner

    @property
    def control_socket_path(self) -> Path:
        return Path(self.spec.supervisor.control_socket or self.runtime_dir / "control.sock")

    def remove_control_socket(self) -> None:
        """After a clean shutdown, still holding the runtime lock (nobody else can have bound
        them): the control socket and the engines' ZeroMQ ipc sockets."""
        for path in (self.control_socket_path, self.runtime_dir / CONTROL_SOCKET_NAME,
                     self.runtime_dir / REQUEST_SOCKET_NAME):
            try:
                path.unlink()
            except OSError:
                pass

    async def _serve_http(self) -> list[web.AppRunner]:
        """The TCP endpoint for Prometheus and probes; `http: off` disables it."""
        assert self.fleet is not None and self.channels is not None
        address = self.spec.supervisor.http
        if address is None:
            return []
        endpoint = MetricsEndpoint(self.fleet, self.channels, self.sampler, self.monitor,
                                   lambda: self.gateway)
        runner = make_runner(endpoint.make_app(), MAX_HTTP_CONNECTIONS, self.budget.may_accept)
        await runner.setup()
        try:
            await web.TCPSite(runner, address[0], address[1], reuse_address=True).start()
        except OSError as exc:
            await runner.cleanup()
            raise RuntimeError_(f"cannot serve HTTP on {address[0]}:{address[1]} "
                                f"(supervisor.http): {exc.strerror or exc}") from None
        log.info("[http] serving /metrics /health /livez /readyz on %s:%d", *address)
        return [runner]

    async def _serve_gateway(self) -> list[web.AppRunner]:
        """The OpenAI-compatible API; off unless `supervisor.gateway` names an address."""
        assert self.fleet is not None and self.channels is not None
        address = self.spec.supervisor.gateway
        if address is None:
            return []
        router = Router(self.fleet, self.spec.supervisor.heartbeat_interval_s,
                        self.clock.monotonic)
        self.gateway = Gateway(router, self.channels, ApiKey(self.spec.supervisor.api_key_file),
                               self.clock.monotonic)
        runner = make_runner(self.gateway.make_app(), MAX_GATEWAY_CONNECTIONS,
                             self.budget.may_accept)
        await runner.setup()
        try:
            await web.TCPSite(runner, address[0], address[1], reuse_address=True).start()
        except OSError as exc:
            await runner.cleanup()
            raise RuntimeError_(f"cannot serve the gateway on {address[0]}:{address[1]} "
                                f"(supervisor.gateway): {exc.strerror or exc}") from None
        log.info("[gateway] serving the OpenAI API (/v1/completions, /v1/chat/completions, "
                 "/v1/models) on %s:%d%s", *address,
                 " (bearer token required)" if self.spec.supervisor.api_key_file else "")
        return [runner]

    async def _command_loop(self) -> None:
        while True:
            command, reply = await self.commands.get()
            if command is DaemonCommand.SHUTDOWN:
                return
            if command is DaemonCommand.RELOAD:
                # A task, so a shutdown signal is seen while a reload stops removed engines.
                self._spawn_task(self._reload(reply), "reload")

    async def _reload(self, reply: asyncio.Future | None) -> None:
        assert self.fleet is not None and self.control is not None
        async with self._reload_lock:
            self.notifier.reloading()
            try:
                new = load_fleet(self.config_path)
            except SpecError as exc:
                log.error("[reload] invalid spec, nothing changed:\n%s", exc)
                self.notifier.ready(self._status_line())
                if reply is not None and not reply.done():
                    reply.set_exception(
                        ReloadRejected(f"invalid fleet spec, nothing changed:\n{exc}"))
                return
            plan = plan_reload(self.spec, new)
            # Supervisor-level keys are not applied live: keep the running ones, so the
            # difference is reported again until engined is restarted.
            live = {key: getattr(new.supervisor, key) for key in LIVE_SUPERVISOR_KEYS}
            self.spec = dataclasses.replace(
                new, supervisor=dataclasses.replace(self.spec.supervisor, **live))
            if self.gateway is not None:
                self.gateway.api_key.reload(self.spec.supervisor.api_key_file)
            self.fleet.apply(self.spec, plan)
            self.control.generation += 1
            summary = plan.summary()
            log.info("[reload] generation %d: added %s, removed %s, changed %s, %d unchanged%s",
                     self.control.generation, summary["added"], summary["removed"],
                     summary["changed"], len(summary["unchanged"]),
                     f"; needs a restart to apply: {summary['restart_required']}"
                     if summary["restart_required"] else "")
            self.notifier.ready(self._status_line())
            if reply is not None and not reply.done():
                reply.set_result(summary)

    async def _shutdown(self) -> None:
        assert self.fleet is not None and self.channels is not None
        self.notifier.stopping()
        log.info("[shutdown] stopping %d engines", len(self.fleet.replicas))
        started = time.monotonic()
        second_signal = asyncio.ensure_future(self._second_shutdown_signal())
        try:
            if self.gateway is not None:  # drain: accept nothing new, finish what runs
                self.gateway.router.closing = True
                budget = max((r.spec.stop_timeout_s for r in self.fleet.replicas.values()),
                             default=0.0)
                if not await self.gateway.drained(budget):
                    log.warning("[shutdown] %d gateway request(s) still running after %.0fs",
                                self.gateway.active, budget)
            await self.fleet.shutdown()
        finally:
            second_signal.cancel()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for runner in self.runners:
            await runner.cleanup()
        self.monitor.stop()
        self._stopping = True
        if self.launcher is not None:
            await self.launcher.close()
        await self.guard.close()
        await asyncio.to_thread(scratch.remove_root)
        await self.probes.close()
        if self.gateway is not None:
            await self.gateway.relay.upstream.close()
        await self.channels.close()
        self.notifier.close()
        log.info("[shutdown] done in %.2fs", time.monotonic() - started)

    async def _second_shutdown_signal(self) -> None:
        """While stopping gracefully, a second SIGTERM/SIGINT kills what is left at once."""
        assert self.fleet is not None
        while True:
            command, reply = await self.commands.get()
            if command is DaemonCommand.SHUTDOWN:
                log.warning("[shutdown] second signal: killing remaining engines now")
                self.fleet.kill_all_now()
            elif reply is not None and not reply.done():
                reply.set_exception(ReloadRejected("engined is shutting down"))


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="engined",
                                     description="Supervise a fleet of ML engine-core processes.")
    parser.add_argument("-c", "--config", default=os.environ.get("ENGINED_CONFIG_FILE",
                                                                 DEFAULT_CONFIG),
                        help=f"fleet spec (YAML); default {DEFAULT_CONFIG}")
    parser.add_argument("--check", action="store_true",
                        help="validate the spec, print the resolved fleet and exit (0 or 78)")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--version", action="version", version=f"engined {__version__}")
    return parser.parse_args(argv)


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
    try:
        spec = load_fleet(args.config)
    except SpecError as exc:
        print(f"engined: invalid fleet spec:\n{exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.check:
        for warning in host_warnings(spec):
            print(f"engined: warning: {warning}", file=sys.stderr)
        try:
            print(format_fleet(spec))
        except BrokenPipeError:  # `engined --check | head`
            pass
        return EXIT_OK
    set_process_title(f"engined: supervisor ({Path(args.config).name})", "engined")
    seal_inherited_fds()
    runtime_dir = resolve_runtime_dir(spec.supervisor.runtime_dir)
    lock = RuntimeLock(runtime_dir)
    try:
        prepare_runtime_dir(runtime_dir)
        lock.acquire()
    except (RuntimeError_, OSError) as exc:
        print(f"engined: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    log_dir = resolve_log_dir(spec.supervisor.log_dir, runtime_dir)
    code = EXIT_FAILURE
    daemon = Daemon(spec, os.path.abspath(args.config), runtime_dir, log_dir)
    try:
        code = asyncio.run(daemon.run())
        return code
    except RuntimeError_ as exc:
        print(f"engined: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        if code == EXIT_OK:  # a clean exit leaves no socket or lock file behind
            daemon.remove_control_socket()
        lock.release(unlink=code == EXIT_OK)


if __name__ == "__main__":
    sys.exit(main())
