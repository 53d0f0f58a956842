"""The fork-server launcher: engines forked from a preloaded parent instead of a cold interpreter.

One fork server (`python -m engined.engine.forkserver`, see that module) per interpreter, kind
of engine (echo, transformers, vllm) and spec `env`: it imports that stack once, and each spawn
is a fork that goes straight to building its model. The server is started by exec like an
engine, in its own session, watched by its pidfd, marked as the daemon's (the guard kills it
after a daemon SIGKILL). It is started on the first spawn that needs it; that spawn waits for it.

Engines stay the daemon's children: the server double-forks, the intermediate exits, and engined
(a child subreaper) adopts the engine before the server reports its pid. Until the pid is
watched, the reaper holds off (it would otherwise reap an engine that died at once, and its exit
status with it). Everything after the pid is the same as for an exec'd child: the output pipe,
exit by pidfd with status and rusage, signals to its process group.

Exec is used instead, and status says why, where forking is unsafe or unavailable: `launcher:
exec`, vLLM on GPUs (vLLM picks its platform when imported, and on a GPU that means CUDA),
a fork server that could not start, died, or found itself unsafe (it then exits and is replaced
at the next spawn).
"""

from __future__ import annotations

import array
import asyncio
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from engined.engine.contract import ENV_CONFIG, ENV_OWNER
from engined.engine.forkserver import CHANNEL_FD, MAX_MESSAGE, PRELOADS
from engined.engine.protocol import EngineConfig
from engined.supervisor.host.exits import ChildWatcher, ExitRecord
from engined.supervisor.host.launcher import Child, ExecLauncher, child_environment
from engined.supervisor.spec.model import EngineSpec

log = logging.getLogger("engined.forkserver")

FORKSERVER_MODULE = "engined.engine.forkserver"
START_TIMEOUT_S = 300.0  # preloading vLLM on a busy machine
FORK_TIMEOUT_S = 30.0
EXEC = "exec"
FORKSERVER = "forkserver"


class ForkServerError(Exception):
    """The fork server could not start or fork: the spawn goes through exec, saying why."""


def engine_kind(config: EngineConfig) -> str:
    return "echo" if config.model == "builtin:echo" else config.backend


def unforkable(config: EngineConfig) -> str | None:
    """Why this engine must be exec'd whatever the spec says, or None."""
    if engine_kind(config) == "vllm" and config.gpus:
        return "vLLM picks its platform when imported, which initialises CUDA on a GPU"
    if engine_kind(config) not in PRELOADS:
        return f"no preload for backend {config.backend!r}"
    return None


@dataclass(frozen=True)
class ServerKey:
    python: str
    kind: str
    env: tuple[tuple[str, str], ...]  # the spec's env: what the stack saw when it was imported


class ForkServer:
    """One running fork server and its channel (one spawn at a time)."""

    def __init__(self, key: ServerKey, watcher: ChildWatcher, log_path: Path) -> None:
        self.key = key
        self.watcher = watcher
        self.log_path = log_path
        self.pid: int | None = None
        self.exited: asyncio.Future[ExitRecord] | None = None
        self.channel: socket.socket | None = None
        self.info: dict[str, Any] = {}
        self.broken: str | None = None  # why it must not be used again
        self._lock = asyncio.Lock()
        self._ready: asyncio.Future[None] | None = None

    @property
    def alive(self) -> bool:
        return self.exited is not None and not self.exited.done() and self.broken is None

    def start(self, env: Mapping[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [self.key.python, "-m", FORKSERVER_MODULE, *PRELOADS[self.key.kind]]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                         0o644)
        try:
            os.write(log_fd, f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} fork server "
                             f"({self.key.kind}, {self.key.python})\n".encode())
            pid = os.posix_spawn(argv[0], argv, dict(env), setsid=True, file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, log_fd, 1),
                (os.POSIX_SPAWN_DUP2, log_fd, 2),
                (os.POSIX_SPAWN_DUP2, theirs.fileno(), CHANNEL_FD)])
        except BaseException:
            ours.close()
            raise
        finally:
            os.close(log_fd)
            theirs.close()
        ours.setblocking(False)
        self.pid, self.channel = pid, ours
        self.exited = self.watcher.watch(pid)
        self._ready = asyncio.ensure_future(self._handshake())

    async def ready(self, timeout_s: float) -> None:
        assert self._ready is not None
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)
        except asyncio.TimeoutError:
            self.fail(f"not ready after {timeout_s:g}s")
            raise ForkServerError(self.broken) from None

    async def _handshake(self) -> None:
        message = await self._receive()
        if "error" in message:
            self.fail(message["error"])
            raise ForkServerError(self.broken)
        self.info = message
        log.info("[forkserver] pid %s ready (%s, %s): preloaded %s in %.2fs; %d task(s) "
                 "tolerated at fork: %s", self.pid, self.key.kind, self.key.python,
                 ", ".join(message.get("preloaded", [])) or "the engine core only",
                 message.get("import_s", 0.0), message.get("tasks", 0),
                 ", ".join(message.get("tolerated", [])))

    async def _receive(self) -> dict[str, Any]:
        assert self.channel is not None and self.exited is not None
        loop = asyncio.get_running_loop()
        receive = asyncio.ensure_future(loop.sock_recv(self.channel, MAX_MESSAGE))
        watched: set[asyncio.Future[Any]] = {receive, self.exited}
        await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        if not receive.done():
            receive.cancel()
            status = self.exited.result().status
            how = f"signal {status.signal_name}" if status.signal else f"code {status.code}"
            self.fail(f"exited ({how})")
            raise ForkServerError(self.broken)
        data = receive.result()
        if not data:
            self.fail("closed its channel")
            raise ForkServerError(self.broken)
        try:
            message = json.loads(data)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            self.fail(f"sent a malformed message: {data[:80]!r}")
            raise ForkServerError(self.broken)
        return message

    async def fork(self, env: Mapping[str, str], name: str, out_fd: int) -> int:
        """The engine's pid, adopted by the daemon already (its exit not yet watched)."""
        async with self._lock:
            if not self.alive:
                raise ForkServerError(self.broken or "not running")
            assert self.channel is not None
            data = json.dumps({"env": dict(env), "name": name}).encode()
            fds = array.array("i", [out_fd])
            self.channel.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            try:
                reply = await asyncio.wait_for(self._receive(), FORK_TIMEOUT_S)
            except asyncio.TimeoutError:
                self.fail(f"no answer to a spawn in {FORK_TIMEOUT_S:g}s")
                raise ForkServerError(self.broken) from None
            if "pid" not in reply:
                why = str(reply.get("error", reply))
                self.fail(why)
                raise ForkServerError(why)
            return int(reply["pid"])

    def fail(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
            log.warning("[forkserver] pid %s (%s): %s; engines start by exec until a new "
                        "one is up", self.pid, self.key.kind, why)
        self.close()

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()  # EOF: the server exits
            self.channel = None
        if self.exited is not None and not self.exited.done() and self.pid is not None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass


class ForkServerLauncher:
    """The daemon's launcher: fork servers where they are safe, `ExecLauncher` elsewhere and for
    command engines."""

    def __init__(self, exec_launcher: ExecLauncher, log_dir: Path, default: str = FORKSERVER,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.exec = exec_launcher
        self.watcher = exec_launcher.watcher
        self.log_dir = log_dir
        self.default = default
        self.start_timeout_s = start_timeout_s
        self.servers: dict[ServerKey, ForkServer] = {}
        self.started_total = 0
        self.closing = False
        self._replacing: set[asyncio.Task[None]] = set()

    async def start(self, spec: EngineSpec, config: EngineConfig) -> Child:
        if spec.is_command:  # a server of its own: always by exec
            return await self.exec.start(spec, config)
        return await self.spawn(config, dict(spec.env), spec.launcher)

    async def spawn(self, config: EngineConfig, env: Mapping[str, str],
                    launcher: str = "") -> Child:
        mode = launcher or self.default
        if mode == EXEC:
            return await self.exec.spawn(config, env)
        why = unforkable(config)
        if why is None:
            try:
                return await self._fork(config, env)
            except ForkServerError as exc:
                why = f"fork server: {exc}"
        child = await self.exec.spawn(config, env)
        return replace(child, launcher=f"{EXEC} ({why})")

    async def _fork(self, config: EngineConfig, env: Mapping[str, str]) -> Child:
        if self.exec.budget is not None:
            self.exec.budget.check_spawn()
        full = child_environment(config, env, self.exec.pythonpath, self.exec.nofile,
                                 self.exec.orphan_timeout_s)
        server = await self._server(config, env, full)
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        self.watcher.hold()
        try:
            try:
                pid = await server.fork(full, config.name, write_fd)
            finally:
                os.close(write_fd)
            os.set_blocking(read_fd, False)
            spawned_at = time.monotonic()
            exited = self.watcher.watch(pid, output_fd=read_fd)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            self.watcher.release()
        return Child(pid, read_fd, exited, spawned_at, launcher=FORKSERVER)

    async def _server(self, config: EngineConfig, env: Mapping[str, str],
                      full: Mapping[str, str]) -> ForkServer:
        key = ServerKey(config.python or self.exec.python, engine_kind(config),
                        tuple(sorted(env.items())))
        server = self.servers.get(key)
        if server is None or not server.alive:
            server = ForkServer(key, self.watcher, self.log_dir / "forkserver.log")
            self.servers[key] = server
            server_env = {k: v for k, v in full.items() if k != ENV_CONFIG}
            server_env["CUDA_VISIBLE_DEVICES"] = ""  # nothing for an import to initialise
            server_env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # is_available() without cuInit
            self.started_total += 1
            server_env[ENV_OWNER] = f"{os.getpid()}/forkserver/{self.started_total}"
            try:
                server.start(server_env)
            except OSError as exc:
                server.fail(f"cannot start: {exc.strerror or exc}")
                raise ForkServerError(server.broken) from None
            assert server.exited is not None
            server.exited.add_done_callback(
                lambda _: self._on_server_exit(server, config, env, server_env))
        await server.ready(self.start_timeout_s)
        return server

    def _on_server_exit(self, server: ForkServer, config: EngineConfig, env: Mapping[str, str],
                        server_env: Mapping[str, str]) -> None:
        """A server that was serving and died (SIGKILL, OOM) is replaced at once, so the next
        crash does not pay for its imports; one that never got ready is retried only by the
        next spawn that needs it (no start loop)."""
        if self.closing or self.servers.get(server.key) is not server:
            return
        status = server.exited.result().status if server.exited is not None else None
        was_ready = bool(server.info) and server.broken is None
        server.fail(f"exited ({status.signal_name or f'code {status.code}'})"
                    if status is not None else "exited")
        if not was_ready:
            return
        task = asyncio.ensure_future(self._replace(config, env))
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def _replace(self, config: EngineConfig, env: Mapping[str, str]) -> None:
        try:
            full = child_environment(config, env, self.exec.pythonpath, self.exec.nofile,
                                 self.exec.orphan_timeout_s)
            await self._server(config, env, full)
        except (ForkServerError, OSError):
            pass  # said by fail(); the next spawn tries again

    def describe(self) -> list[dict[str, Any]]:
        """The fork servers for status: pid, kind, interpreter, state."""
        return [{"pid": s.pid, "kind": s.key.kind, "python": s.key.python,
                 "state": "ready" if s.alive and s.info else
                          "starting" if s.alive else f"down: {s.broken}",
                 "tasks": s.info.get("tasks"), "import_s": s.info.get("import_s")}
                for s in self.servers.values()]

    def hand_over(self) -> list[dict[str, Any]]:
        """An upgrade in place: each ready, idle fork server with a duplicate of its channel
        (kept across the exec: the server sees no EOF and goes on serving the new code)."""
        out = []
        for server in self.servers.values():
            if not (server.alive and server.info and server.channel is not None) \
                    or server._lock.locked():  # noqa: SLF001 - a spawn in progress
                continue
            fd = os.dup(server.channel.fileno())
            os.set_inheritable(fd, True)
            out.append({"python": server.key.python, "kind": server.key.kind,
                        "env": [list(pair) for pair in server.key.env], "pid": server.pid,
                        "channel_fd": fd, "info": server.info,
                        "started_total": self.started_total})
        return out

    def adopt(self, records: list[dict[str, Any]]) -> list[int]:
        """The new code's side: the fork servers the old code handed over, ready at once (a
        record that does not hold is dropped: the next spawn starts a server). Returns their
        pids."""
        adopted = []
        for record in records:
            try:
                key = ServerKey(str(record["python"]), str(record["kind"]),
                                tuple((str(k), str(v)) for k, v in record["env"]))
                pid, fd = int(record["pid"]), int(record["channel_fd"])
                self.started_total = max(self.started_total, int(record["started_total"]))
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("[forkserver] a handed-over server record is unusable (%s)", exc)
                continue
            channel = socket.socket(fileno=fd)
            channel.set_inheritable(False)
            channel.setblocking(False)
            server = ForkServer(key, self.watcher, self.log_dir / "forkserver.log")
            try:
                server.exited = self.watcher.watch(pid)
            except OSError:
                channel.close()
                continue
            server.pid, server.channel, server.info = pid, channel, dict(record.get("info") or {})
            ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            ready.set_result(None)
            server._ready = ready  # noqa: SLF001 - its handshake was the old code's
            server.exited.add_done_callback(self._adopted_exit(server))
            self.servers[key] = server
            adopted.append(pid)
        return adopted

    def _adopted_exit(self, server: ForkServer) -> Any:
        def exited(_: object) -> None:
            if not self.closing:
                server.fail("exited")
        return exited

    async def close(self) -> None:
        self.closing = True
        for task in list(self._replacing):
            task.cancel()
        for server in self.servers.values():
            server.close()
        for server in self.servers.values():
            if server.exited is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(server.exited), 5.0)
                except asyncio.TimeoutError:
                    pass
