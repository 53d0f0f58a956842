"""The daemon's object graph, built in one place and in dependency order, and its servers.

`Services.build` makes every service, hands each its dependencies, and wires the notifications
(supervisor.notices) from the lifecycle to whoever reacts to them:

    state change  -> the event log (GET /v1/events), the router (requests waiting for a
                     replica), systemd's STATUS= line
    incarnation lost -> the engine channels and the gateway's upstream client (the requests on
                     it fail now and move)

`serve` starts the three servers: the control socket, the TCP endpoint (/metrics, /health,
/livez, /readyz) and, when `supervisor.gateway` names an address, the OpenAI-compatible gateway.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from engined.supervisor.control.api import ControlContext, make_app
from engined.supervisor.control.events import EventLog, transition
from engined.supervisor.gateway.app import Gateway
from engined.supervisor.gateway.lora import Lora
from engined.supervisor.gateway.upstream import Upstream
from engined.supervisor.host.exits import ChildWatcher
from engined.supervisor.host.fdreserve import FdReserve
from engined.supervisor.host.forkclient import ForkServerLauncher
from engined.supervisor.host.guardctl import GuardControl
from engined.supervisor.host.launcher import ExecLauncher, expose_engine_package
from engined.supervisor.host.oom import OomWitness
from engined.supervisor.host.reaper import Reaper
from engined.supervisor.host.runtime import StartupError
from engined.supervisor.ipc import EngineChannels
from engined.supervisor.lifecycle.clock import SystemClock
from engined.supervisor.lifecycle.fleet import Fleet
from engined.supervisor.lifecycle.loopmonitor import LoopMonitor
from engined.supervisor.lifecycle.notices import Notices, StateChange
from engined.supervisor.lifecycle.probe import ProbeClient
from engined.supervisor.lifecycle.replica import AddressBook, Replica, ReplicaDeps
from engined.supervisor.lifecycle.state import EngineState
from engined.supervisor.lifecycle.view import EngineView
from engined.supervisor.logs import StdoutLines
from engined.supervisor.observe.monitoring import MonitoringEndpoint
from engined.supervisor.observe.sampler import Sampler
from engined.supervisor.observe.systemd import Notifier
from engined.supervisor.routing.adapters import AdapterBook
from engined.supervisor.routing.ondemand import OnDemand
from engined.supervisor.routing.replicas import Router
from engined.supervisor.routing.routes import Routes
from engined.supervisor.routing.sleepmode import SleepMode
from engined.supervisor.spec.model import ClientLimits, FleetSpec, SupervisorSpec
from engined.supervisor.webserver import ApiKey, CappedRunner, listening, make_runner

log = logging.getLogger("engined")

# Open connections per HTTP server: enough for operators (`logs -f` followers included) and for
# Prometheus and probes; past it a connection is closed on accept (supervisor.webserver).
MAX_CONTROL_CONNECTIONS = 256
MAX_HTTP_CONNECTIONS = 64


@dataclass(frozen=True)
class Paths:
    config: str  # the spec file, absolute
    runtime_dir: Path
    log_dir: Path

    def control_socket(self, spec: FleetSpec) -> Path:
        return Path(spec.supervisor.control_socket or self.runtime_dir / "control.sock")


@dataclass(frozen=True)
class Services:
    clock: SystemClock
    monitor: LoopMonitor
    notifier: Notifier
    sampler: Sampler
    probes: ProbeClient
    watcher: ChildWatcher
    reaper: Reaper
    guard: GuardControl
    budget: FdReserve
    launcher: ForkServerLauncher
    channels: EngineChannels
    router: Router
    fleet: Fleet
    events: EventLog
    control: ControlContext
    upstream: Upstream
    gateway: Gateway | None
    ondemand: OnDemand
    changed: asyncio.Event  # set when what the state snapshot holds changed
    # what each HTTP server did to its clients (webserver: shed, refused, timed out), by server
    clients: dict[str, collections.Counter[str]] = dataclasses.field(default_factory=dict)
    notices: Notices = dataclasses.field(default_factory=Notices)  # the replicas' own
    stdout: StdoutLines | None = None  # supervisor.engine_logs: stdout
    # supervisor.replica_ports: port -> the serving replica it is the own port of
    replica_ports: dict[int, str] = dataclasses.field(default_factory=dict)
    # supervisor.control_tcp's bearer token (required: nobody gets in without one)
    control_token: ApiKey = dataclasses.field(
        default_factory=lambda: ApiKey(None, "control_token_file", required=True))
    # what the gateway routes over: the router (the fleet's replicas), or a cluster gateway's
    # nodes (supervisor.cluster.services)
    routes: Routes = dataclasses.field(kw_only=True)
    lora: Lora = dataclasses.field(kw_only=True)  # LoRA adapters: the gateway's and replays

    @classmethod
    def build(cls, spec: FleetSpec, paths: Paths, nofile: int | None,
              reload: Callable[[], Awaitable[dict]]) -> Services:
        """Every service, in dependency order (call on the running loop)."""
        loop, sup = asyncio.get_running_loop(), spec.supervisor
        clock, notices, addresses = SystemClock(), Notices(), AddressBook()
        changed = asyncio.Event()  # what the state snapshot holds changed (supervisor.recovery)
        monitor = LoopMonitor(clock, grace_s=sup.heartbeat_interval_s)
        sampler, probes, notifier = Sampler(), ProbeClient(), Notifier()
        watcher = ChildWatcher()  # every child's pidfd; the reaper reaps only others
        reaper = Reaper(lambda: watcher.pids, lambda: watcher.holds > 0)
        watcher.on_release = reaper.reap_orphans
        # `fleet` is bound below: these run only once it exists
        budget = FdReserve(lambda: fleet.starting())
        channels = EngineChannels(str(paths.runtime_dir), lambda msg: fleet.on_message(msg))
        router = Router(lambda: fleet.replicas.values(), clock.monotonic)
        execs = ExecLauncher(loop, expose_engine_package(paths.runtime_dir / "python"),
                             budget=budget, nofile=nofile, watcher=watcher)
        execs.orphan_timeout_s = sup.orphan_timeout_s
        launcher = ForkServerLauncher(execs, paths.log_dir)
        stdout = StdoutLines() if sup.engine_logs == "stdout" else None
        upstream = Upstream()
        book = AdapterBook(lambda: ((g, members[0].adapters)
                                    for g, members in fleet.spec.groups().items()),
                           spec_key=lambda: fleet.spec)
        book.changed, router.adapters = changed.set, book
        deps = ReplicaDeps(
            loop=loop, clock=clock, launcher=launcher, log_dir=paths.log_dir,
            control_endpoint=channels.control_endpoint,
            request_endpoint=channels.request_endpoint,
            heartbeat_interval_s=sup.heartbeat_interval_s,
            heartbeat_timeout_s=sup.heartbeat_timeout_s, monitor=monitor, notices=notices,
            addresses=addresses, reaper=reaper, nvml=sampler.nvml, oom=OomWitness(),
            log_max_bytes=sup.log_max_bytes, log_backups=sup.log_backups, probes=probes,
            in_flight=router.in_flight, counted=changed.set, stdout=stdout,
            adapters=book.of_group, in_place=SleepMode(channels, upstream, clock, router.in_flight))
        fleet = Fleet(spec, lambda engine, owner: Replica(engine, deps, owner), clock, router,
                      addresses)
        events = EventLog()
        ondemand = OnDemand(fleet, router, clock, measure=lambda pids: measure(sampler, pids))
        router.waker = ondemand.for_request
        control = ControlContext(fleet, router, channels, sampler, events, paths.config,
                                 reload=reload, fork_servers=launcher.describe, ondemand=ondemand)
        routes = cls.gateway_routes(spec, router, upstream, clock)
        lora = Lora(routes, book, channels, upstream, router.lives if routes is router else None)
        gateway = (Gateway(routes, channels, upstream, ApiKey(sup.api_key_file),
                           clock.monotonic, on_counted=changed.set, lora=lora)
                   if sup.gateway is not None else None)

        def on_state(change: StateChange) -> None:
            events.publish({**transition(change.view, change.old.value),
                            **ondemand.on_state(change)})
            if change.view.state is EngineState.READY:
                replay_adapters(fleet, lora, change.view)
            notifier.status(status_line(fleet))

        events.on_publish = changed.set
        notices.state.subscribe(on_state)
        notices.state.subscribe(router.on_state)
        notices.lost.subscribe(channels.on_lost)
        notices.lost.subscribe(upstream.on_lost)
        notices.lost.subscribe(lambda lost: book.gone(lost.address))
        guard = GuardControl(watcher, paths.runtime_dir, sup.orphan_timeout_s)
        watcher.on_change.append(lambda pid, alive: changed.set())  # the snapshot is due
        return cls(clock, monitor, notifier, sampler, probes, watcher, reaper, guard, budget,
                   launcher, channels, router, fleet, events, control, upstream, gateway,
                   ondemand, changed, notices=notices, stdout=stdout, routes=routes, lora=lora)

    # --- what a cluster gateway does its own way (supervisor.cluster.services) ---------------
    @classmethod
    def gateway_routes(cls, spec: FleetSpec, router: Router, upstream: Upstream,
                       clock: SystemClock) -> Routes:
        """What the gateway routes over: the fleet's replicas."""
        return router

    def background(self) -> dict[str, Coroutine[Any, Any, None]]:
        """What runs beside the fleet until shutdown, by name: on-demand engines' sleeps and
        the memory budget (a reload may add either)."""
        return {"ondemand": self.ondemand.run()}

    def reload_routes(self, spec: FleetSpec) -> None:
        """A reload: the routes follow the fleet's replicas by themselves."""

    def drain_budget_s(self) -> float:
        """How long a shutdown lets the gateway's requests finish: the longest stop_timeout."""
        return max((r.spec.stop_timeout_s for r in self.fleet.replicas.values()), default=0.0)

    def readiness(self) -> tuple[int, dict[str, Any]]:
        """/readyz: the fleet's."""
        return self.fleet.view().readiness()

    def node_states(self) -> list[tuple[str, bool]]:
        """engined_cluster_node_up: (node, whether it takes requests); no node here."""
        return []

    async def serve(self, spec: FleetSpec, paths: Paths,
                    inherited: dict[str, int] | None = None) -> dict[str, CappedRunner]:
        """The control socket, the TCP endpoint and the gateway, serving (by key: control,
        http, gateway). `inherited`: listening sockets handed across an upgrade, by key."""
        given = inherited or {}
        runners = {"control": await self._serve_control(paths.control_socket(spec),
                                                        given.get("control"))}
        sup = spec.supervisor
        if sup.control_tcp is not None:
            runners["control_tcp"] = await self._serve_control_tcp(sup, given.get("control_tcp"))
        if sup.http is not None:
            endpoint = MonitoringEndpoint(self.fleet, self.channels, self.sampler, self.monitor,
                                          self.gateway.stats if self.gateway else None,
                                          lambda: self.control.handover_info(),
                                          lambda: self.clients, lambda: self.replica_ports,
                                          self.readiness, self.node_states, self.ondemand)
            runners["http"] = await self._serve_tcp(endpoint.make_app(), sup.http,
                                                    MAX_HTTP_CONNECTIONS, "HTTP", "http",
                                                    given.get("http"), sup.clients)
            log.info("[http] serving /metrics /health /livez /readyz on %s:%d", *sup.http)
        if self.gateway is not None and sup.gateway is not None:
            runners["gateway"] = await self._serve_tcp(self.gateway.make_app(), sup.gateway,
                                                       sup.clients.max_connections,
                                                       "the gateway", "gateway",
                                                       given.get("gateway"), sup.clients)
            log.info("[gateway] serving the OpenAI API (/v1/completions, /v1/chat/completions, "
                     "/v1/responses, /v1/models, /tokenize, /detokenize) on %s:%d%s",
                     *sup.gateway,
                     " (bearer token required)" if sup.api_key_file else "")
            if sup.replica_ports is not None:
                runners.update(await self._serve_replicas(spec, sup.gateway[0],
                                                          sup.replica_ports))
        return runners

    async def _serve_replicas(self, spec: FleetSpec, host: str,
                              base: int) -> dict[str, CappedRunner]:
        """supervisor.replica_ports: each serving replica, in spec order, on a port of its own
        (the replicas the spec has at start: ports follow a reload's new replicas only at the
        next start of engined)."""
        assert self.gateway is not None
        sup, runners = spec.supervisor, {}
        serving = [e.name for e in spec.engines if not e.standby]
        for port, name in enumerate(serving, start=base):
            runners[f"replica:{name}"] = await self._serve_tcp(
                self.gateway.make_app(pinned=name), (host, port), sup.clients.max_connections,
                f"replica {name}", "replica_ports", None, sup.clients)
            self.replica_ports[port] = name
        log.info("[gateway] replicas on their own ports %s:%d..%d (%s)", host, base,
                 base + len(serving) - 1, ", ".join(serving))
        return runners

    async def _serve_control_tcp(self, sup: SupervisorSpec, fd: int | None) -> CappedRunner:
        """supervisor.control_tcp: the control API with a bearer token, TLS when configured."""
        assert sup.control_tcp is not None
        token = self.control_token
        token.reload(sup.control_token_file)
        if token.token is None:
            raise StartupError(f"control_tcp: no token in control_token_file "
                               f"{sup.control_token_file} (unreadable or empty)")
        context = None
        if sup.control_tls_cert is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            try:
                context.load_cert_chain(sup.control_tls_cert, sup.control_tls_key)
            except (OSError, ssl.SSLError) as exc:
                raise StartupError(f"control_tls_cert/control_tls_key: {exc}") from None
        runner = await self._serve_tcp(make_app(self.control, token), sup.control_tcp,
                                       MAX_CONTROL_CONNECTIONS, "the control API",
                                       "control_tcp", fd, sup.clients, context)
        log.info("[control] listening on %s:%d%s (bearer token required)", *sup.control_tcp,
                 " with TLS" if context else "")
        return runner

    async def _serve_control(self, path: Path, fd: int | None) -> CappedRunner:
        runner = make_runner(make_app(self.control), MAX_CONTROL_CONNECTIONS,
                             self.budget.may_accept,
                             stats=self.clients.setdefault("control", collections.Counter()))
        await runner.setup()
        if fd is not None:  # handed over by the engined this one replaced: still bound
            await web.SockSite(runner, listening(fd)).start()
            log.info("[control] listening on %s (handed over)", path)
            return runner
        path.unlink(missing_ok=True)  # stale from a dead daemon; we hold the lock
        old_umask = os.umask(0o177)  # the socket is born 0600: no window with looser modes
        try:
            await web.UnixSite(runner, str(path)).start()
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        log.info("[control] listening on %s", path)
        return runner

    async def _serve_tcp(self, app: web.Application, address: tuple[str, int],
                         max_connections: int, what: str, key: str,
                         fd: int | None, limits: ClientLimits,
                         ssl_context: ssl.SSLContext | None = None) -> CappedRunner:
        runner = make_runner(app, max_connections, self.budget.may_accept, limits,
                             self.clients.setdefault(key, collections.Counter()))
        await runner.setup()
        if fd is not None:
            await web.SockSite(runner, listening(fd), ssl_context=ssl_context).start()
            return runner
        try:
            await web.TCPSite(runner, address[0], address[1], reuse_address=True,
                              ssl_context=ssl_context).start()
        except OSError as exc:
            await runner.cleanup()
            raise StartupError(f"cannot serve {what} on {address[0]}:{address[1]} "
                               f"(supervisor.{key}): {exc.strerror or exc}") from None
        return runner

    async def close(self) -> None:
        """After the fleet has stopped: the fork servers, the guard, the clients and the engine
        channels."""
        self.monitor.stop()
        await self.launcher.close()
        await self.guard.close()
        await self.probes.close()
        await self.upstream.close()
        await self.channels.close()
        self.notifier.close()


def replay_adapters(fleet: Fleet, lora: Lora, view: EngineView) -> None:
    """A replica became READY: what it holds is what its READY said; the adapters its group
    serves that it lacks are loaded into it in the background (routing.adapters)."""
    replica = fleet.replicas.get(view.name)
    inc = replica.current if replica is not None else None
    if inc is None:
        return
    ready = view.ready
    lora.book.ready(inc.address, ready.adapters if ready is not None else [])
    if any(not lora.book.holds(inc.address, n) for n in lora.book.of_group(view.group)):
        lora.replay_soon(view.group, (inc.address, ("127.0.0.1", inc.port or 0), view.command))


async def measure(sampler: Sampler, pids: list[int]) -> dict[int, tuple[int, dict[int, int]]]:
    """What each engine's process tree holds: resident bytes, and bytes per GPU (NVML)."""
    sample = await sampler.sample(pids)
    out = {}
    for pid, tree in sample.trees.items():
        gpus = {d.index: n for d in sample.gpus if (n := tree.gpu_bytes(d)) is not None}
        out[pid] = (tree.rss_bytes, gpus)
    return out


def status_line(fleet: Fleet) -> str:
    """systemd's STATUS=."""
    ready, wanted = fleet.counts()
    return f"{ready}/{wanted} engines ready"

