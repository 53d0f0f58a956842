"""Starting engine children: one small interface, one exec-based implementation.

A launcher turns a resolved EngineConfig into a running child and hands back a `Child`: its pid,
the read end of its output pipe, and a future that resolves when it exits. Death is detected by
event (a pidfd registered with the event loop), never by polling. A faster launcher (a preloaded
fork server) can replace `ExecLauncher` without touching the lifecycle code.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Protocol

import engined.engine
from engined.engine.contract import (
    CONFIG_LINE_PREFIX,
    ENV_CONFIG,
    ENV_NOFILE,
    ENV_ORPHAN_TIMEOUT,
    ENV_OWNER,
    ENV_PARENT_PID,
)
from engined.engine.protocol import EngineConfig, encode_config
from engined.supervisor.host import scratch
from engined.supervisor.host.exits import ChildWatcher, ExitRecord
from engined.supervisor.host.fdreserve import FdReserve
from engined.supervisor.spec.model import EngineSpec

# Never let a child see the daemon's systemd plumbing: a child writing to NOTIFY_SOCKET would
# confuse systemd, and WATCHDOG_* would make it think it is the watched process.
_STRIPPED_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID",
                 "LISTEN_FDNAMES", "ENGINED_SOCKET")
ENGINE_MODULE = "engined.engine"


def expose_engine_package(root: Path) -> str:
    """A directory holding only `engined/engine` (a link to this installation's engine package),
    for the children's PYTHONPATH.

    The child needs the engine package and nothing else of ours, possibly under another
    interpreter with its own stack (a vLLM venv): putting the directory the daemon was installed
    into on its path would put the daemon venv's whole site-packages (its transformers, its
    torch) in front of the engine venv's own. `engined` is a namespace package, so this portion
    and an installed one combine.
    """
    package = Path(next(iter(engined.engine.__path__))).resolve()
    link = root / "engined" / "engine"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not (link.is_symlink() and Path(os.readlink(link)) == package):
        staging = link.with_name(f".engine-{os.getpid()}")
        staging.unlink(missing_ok=True)
        staging.symlink_to(package, target_is_directory=True)
        os.replace(staging, link)  # atomic: a child starting now sees the old or the new link
    return str(root)


@dataclass
class Child:
    pid: int
    output_fd: int  # read end of the child's stdout+stderr pipe (the caller owns it)
    exited: asyncio.Future[ExitRecord]
    spawned_at: float = field(default_factory=time.monotonic)
    launcher: str = "exec"  # what started it: "forkserver", "exec", "exec (why not forked)"
    port: int | None = None  # a command engine's port (this spawn's)
    # our descendant (what it leaves behind is too: see host.reaper); not so for an engine a
    # crashed daemon left, adopted by the next one
    descendant: bool = True

    @property
    def alive(self) -> bool:
        return not self.exited.done()

    def signal_group(self, sig: int) -> bool:
        """Signal the child's whole process group; False if it is already gone."""
        try:
            os.killpg(self.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False


class Launcher(Protocol):
    async def start(self, spec: EngineSpec, config: EngineConfig) -> Child:
        """Start one incarnation of `spec`: its engine child (from `config`), or for a command
        engine its server, on this spawn's port. Raises OSError if it could not be started."""


def child_environment(config: EngineConfig, extra: Mapping[str, str], pythonpath: str,
                      nofile: int | None = None, orphan_timeout_s: float = 0.0) -> dict[str, str]:
    """The child's environment: ours minus systemd plumbing, plus GPU pinning, thread bounds and
    a TMPDIR of its own (`scratch`)."""
    env = {k: v for k, v in os.environ.items() if k not in _STRIPPED_ENV}
    threads = str(config.threads)
    env.update({
        "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
        "OPENBLAS_NUM_THREADS": threads, "ENGINED_NUM_THREADS": threads,
        "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    })
    env.update(extra)
    env.update(scratch.environment(owner_token(config.name, config.incarnation), extra,
                                   torch=config.model != "builtin:echo"))
    # Set before the interpreter starts, so before any CUDA call. No GPUs: hide them all, so a
    # CPU engine can never initialise CUDA on GPU 0 by accident.
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in config.gpus)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's indices = nvidia-smi's = NVML's = ours
    env[ENV_CONFIG] = encode_config(config)
    env[ENV_PARENT_PID] = str(os.getpid())
    env[ENV_OWNER] = owner_token(config.name, config.incarnation)
    if nofile is not None:
        env[ENV_NOFILE] = str(nofile)
    if orphan_timeout_s > 0:
        env[ENV_ORPHAN_TIMEOUT] = f"{orphan_timeout_s:g}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    return env


def command_environment(spec: EngineSpec, incarnation: int, port: int | None) -> dict[str, str]:
    """A command engine's environment: ours minus systemd plumbing and engined's own variables,
    plus the spec's env, GPU pinning, PORT, the owner mark and a TMPDIR of its own (and, with
    sleep_mode level1/level2, VLLM_SERVER_DEV_MODE=1: vLLM serves /sleep and /wake_up only
    then). None of the engine child's knobs (thread bounds, offline flags, our PYTHONPATH): the
    server is not ours."""
    env = {k: v for k, v in os.environ.items()
           if k not in _STRIPPED_ENV and not k.startswith("ENGINED_")}
    if spec.sleep_level:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env.update(spec.env)
    env.update(scratch.environment(owner_token(spec.name, incarnation), dict(spec.env)))
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if port is not None:
        env["PORT"] = str(port)
    env[ENV_OWNER] = owner_token(spec.name, incarnation)
    return env


def command_argv(spec: EngineSpec, port: int | None) -> list[str]:
    """The spec's argv with {port} replaced by this spawn's port."""
    if port is None:
        return list(spec.command)
    return [arg.replace("{port}", str(port)) for arg in spec.command]


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
AUTO_PORT_FLOOR = 10000  # `port: auto` takes ports from here up to the kernel's ephemeral range
AUTO_PORT_TRIES = 64


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The ports the kernel hands out as the source of outgoing connections (Linux's default
    32768-60999)."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


class PortPicker:
    """This spawn's port. A fixed one (`port: N`) must be free: a server that cannot bind would
    only crash-loop, and saying which port is taken is better. `auto` is a free loopback port
    outside the kernel's ephemeral range: a port from inside it, free when picked, is often
    taken as the source port of some outgoing connection before the server binds it (vLLM binds
    its port half a minute after it starts), and the server then exits at once. Ports handed
    out recently are not handed out again while their servers start."""

    def __init__(self, rng: random.Random | None = None, hold_s: float = 600.0) -> None:
        self.rng = rng or random.Random()
        self.hold_s = hold_s
        self._given: dict[int, float] = {}  # port -> monotonic time it was handed out

    def pick(self, spec: EngineSpec) -> int | None:
        if spec.port is None:
            return None
        if spec.port:
            return _bind_test(spec.port, "")
        now = time.monotonic()
        self._given = {p: t for p, t in self._given.items() if now - t < self.hold_s}
        low, high = ephemeral_range()
        ranges = [r for r in (range(AUTO_PORT_FLOOR, low), range(high + 1, 65536)) if len(r)]
        for _ in range(AUTO_PORT_TRIES if ranges else 0):
            candidate = self.rng.choice(self.rng.choice(ranges))
            if candidate in self._given:
                continue
            try:
                port = _bind_test(candidate, "127.0.0.1")
            except OSError:
                continue
            self._given[port] = now
            return port
        port = _bind_test(0, "127.0.0.1")  # every try taken: the kernel's choice, as before
        self._given[port] = now
        return port


def _bind_test(port: int, host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise OSError(exc.errno, f"port {port} is in use ({exc.strerror})") from None
        return int(probe.getsockname()[1])


# Between posix_spawn and the server: the daemon's death kills the server (PR_SET_PDEATHSIG
# survives exec; not when supervisor.orphan_timeout lets engines outlive it), the descriptor
# limit engined started with is given back, the working directory is set, then exec. A program
# that cannot be run at all is a configuration error (exit 78 with a `[config]` line), not a
# crash to retry. Stdlib only, no site (-S): it costs ~20 ms.
_EXEC_SHIM = """
import ctypes, os, resource, signal, sys
parent, nofile, orphans, cwd = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
argv = sys.argv[5:]
if orphans != "1":  # else it outlives a dead daemon: the guard ends it if none adopts it
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit(1)
if nofile > 0:
    try:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
    except (ValueError, OSError):
        pass
os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # only its stdio goes to the server
try:
    if cwd:
        os.chdir(cwd)
    os.execvp(argv[0], argv)
except OSError as exc:
    print(f"PREFIXcannot run {argv[0]}: {exc.strerror}", flush=True)
    sys.exit(78)
""".replace("PREFIX", CONFIG_LINE_PREFIX)


def owner_token(engine: str, incarnation: int) -> str:
    """The mark every process of one incarnation inherits (its descendants too, unless they
    rewrite their environment): how engined finds what an engine left behind."""
    return f"{os.getpid()}/{engine}/{incarnation}"


class ExecLauncher:
    """posix_spawn a fresh interpreter running `python -m engined.engine` in its own session.

    Called from the event-loop thread only: PR_SET_PDEATHSIG in the child is tied to the thread
    that spawned it, and the loop thread lives as long as the daemon. `pythonpath` is
    `expose_engine_package`'s directory.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, pythonpath: str,
                 python: str = sys.executable, budget: FdReserve | None = None,
                 nofile: int | None = None, watcher: ChildWatcher | None = None) -> None:
        self.loop = loop
        self.watcher = watcher or ChildWatcher()
        self.pythonpath = pythonpath
        self.python = python
        self.budget = budget
        self.nofile = nofile
        self.ports = PortPicker()
        self.orphan_timeout_s = 0.0  # supervisor.orphan_timeout: engines outlive our death

    async def start(self, spec: EngineSpec, config: EngineConfig) -> Child:
        if spec.is_command:
            port = self.ports.pick(spec)
            child = self.spawn_command(spec, config.incarnation, port)
            child.port = port
            return child
        return await self.spawn(config, dict(spec.env))

    async def spawn(self, config: EngineConfig, env: Mapping[str, str],
                    launcher: str = "") -> Child:
        """Start the child; raises OSError if it could not be started (nothing is left behind:
        a child whose exit could not be watched is killed and reaped at once)."""
        if self.budget is not None:
            self.budget.check_spawn()
        python = config.python or self.python
        return self._spawn(python, [python, "-m", ENGINE_MODULE],
                           child_environment(config, env, self.pythonpath, self.nofile,
                                             self.orphan_timeout_s))

    def spawn_command(self, spec: EngineSpec, incarnation: int, port: int | None) -> Child:
        """Start a command engine (a server engined did not write) through the exec shim."""
        if self.budget is not None:
            self.budget.check_spawn()
        argv = [sys.executable, "-S", "-c", _EXEC_SHIM, str(os.getpid()), str(self.nofile or 0),
                "1" if self.orphan_timeout_s > 0 else "0", spec.cwd or "",
                *command_argv(spec, port)]
        return self._spawn(sys.executable, argv, command_environment(spec, incarnation, port))

    def _spawn(self, program: str, argv: list[str], env: dict[str, str]) -> Child:
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        try:
            pid = os.posix_spawn(program, argv, env,
                                 file_actions=[
                                     (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                                     (os.POSIX_SPAWN_DUP2, write_fd, 1),
                                     (os.POSIX_SPAWN_DUP2, write_fd, 2)],
                                 setsid=True)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        os.set_blocking(read_fd, False)
        try:
            exited = self.watcher.watch(pid, output_fd=read_fd)
        except BaseException:
            _kill_and_reap(pid)
            os.close(read_fd)
            raise
        return Child(pid, read_fd, exited)


def _kill_and_reap(pid: int) -> None:
    """A child we cannot watch must not live on: kill its group and reap it (it dies at once)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
