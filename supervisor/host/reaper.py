"""An engine owns its whole process tree: what it started dies with it, and with the daemon.

Engines such as vLLM start workers of their own, and a descendant that called setsid() has left
the engine's process group, so a group kill misses it (vLLM #55510: workers that survive their
parent keep the GPUs). engined therefore

* is a child subreaper (PR_SET_CHILD_SUBREAPER): a descendant whose parent dies is re-parented to
  engined, not to init, and engined reaps it. It reaps only pids it does not supervise, by pid
  (a waitpid(-1) would steal the engines' own exit statuses, which their pidfd watchers read);
* finds what an incarnation left behind by the mark every process it started inherits
  (ENGINED_OWNER=<daemon pid>/<engine>/<incarnation>, in /proc/PID/environ) and kills it before
  the replacement spawns, and removes its TMPDIR (`scratch`: the files it left there);
* runs a guard (`engined.supervisor.guard`) that outlives a SIGKILLed daemon and kills whatever
  carries the daemon's mark (PR_SET_PDEATHSIG covers only the direct children).

A descendant that rewrites its own environment escapes the mark; under systemd the unit's cgroup
still ends it (KillMode=mixed), see the README.
"""

from __future__ import annotations

import asyncio
import ctypes
import glob
import logging
import os
import signal
import sys
import time
from typing import Callable

from engined.supervisor import scratch
from engined.supervisor.guard import marked_processes
from engined.supervisor.launcher import ChildWatcher, ExitRecord

log = logging.getLogger("engined.reaper")

_PR_SET_CHILD_SUBREAPER = 36
LEFTOVER_WAIT_S = 5.0
GUARD_MODULE = "engined.supervisor.guard"


def become_subreaper() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("[start] cannot become a child subreaper (errno %d): an engine's escaped "
                    "descendants are re-parented to init", ctypes.get_errno())
        return False
    return True


def children_of(pid: int) -> set[int]:
    """Direct children (alive or zombie) of `pid`, from /proc/PID/task/*/children."""
    kids: set[int] = set()
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as f:
                kids.update(int(p) for p in f.read().split())
        except OSError:
            continue
    return kids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


class Reaper:
    """Reaps adopted orphans and clears an incarnation's leftovers. `supervised()` gives the
    pids watched by their pidfd (never reaped here)."""

    def __init__(self, supervised: Callable[[], set[int]],
                 held: Callable[[], bool] = lambda: False) -> None:
        self.supervised = supervised
        self.held = held  # a fork-server spawn in progress: its engine is not watched yet
        self.killed_total = 0

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_signal_handler(signal.SIGCHLD, self.reap_orphans)

    def reap_orphans(self) -> None:
        """SIGCHLD: reap children that are not supervised (adopted descendants, by pid)."""
        if self.held():
            return  # called again on release
        watched = self.supervised()
        for pid in children_of(os.getpid()) - watched:
            try:
                os.waitpid(pid, os.WNOHANG)  # a zombie is reaped; a live orphan is left alone
            except ChildProcessError:
                continue

    async def clear(self, engine: str, incarnation: int, token: str) -> list[int]:
        """Kill every process still marked as this incarnation's, and wait (bounded) until they
        are gone; returns the pids killed."""
        pids = await asyncio.to_thread(marked_processes, token)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if pids:
            self.killed_total += len(pids)
            log.warning("[leftover] %s incarnation %d left %d process(es) behind: killed %s",
                        engine, incarnation, len(pids), pids)
            deadline = time.monotonic() + LEFTOVER_WAIT_S
            while any(_alive(p) for p in pids) and time.monotonic() < deadline:
                self.reap_orphans()
                await asyncio.sleep(0.01)
            self.reap_orphans()
        await self._remove_scratch(engine, incarnation, token)  # its processes are gone
        return pids

    async def _remove_scratch(self, engine: str, incarnation: int, token: str) -> None:
        left = await asyncio.to_thread(scratch.remove, token)
        if left:
            log.info("[leftover] %s incarnation %d left %d file(s) in its TMPDIR: removed",
                     engine, incarnation, left)


class Guard:
    """The small process that outlives a SIGKILLed engined and kills what carries its mark.

    It reads a pipe from the daemon: EOF means the daemon is gone (or shutting down, having
    stopped every engine already): it then kills every process marked `<daemon pid>/...` and
    exits. It ignores SIGINT/SIGTERM/SIGHUP (a terminal's Ctrl-C or a unit's stop must not end
    it first) and runs in a session of its own. Spawned like an engine (posix_spawn from the
    event-loop thread) and watched by its pidfd; a dead guard is replaced.
    """

    def __init__(self, watcher: ChildWatcher) -> None:
        self.watcher = watcher
        self.pid: int | None = None
        self.exited: asyncio.Future[ExitRecord] | None = None
        self._write_fd: int | None = None
        watcher.on_change = self._tell

    def _tell(self, pid: int, alive: bool) -> None:
        """Every child is a process-group leader (setsid): the guard keeps the list, and kills
        those groups too. Some descendants cannot be found by their mark: a process that sets
        its title (setproctitle, as vLLM's EngineCore does) overwrites its environment."""
        if self._write_fd is None or pid == self.pid:
            return
        try:
            os.write(self._write_fd, f"{'+' if alive else '-'}{pid}\n".encode())
        except OSError:  # a guard that died is replaced; it is told everything again then
            pass

    def start(self) -> int:
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        argv = [sys.executable, "-m", GUARD_MODULE, str(os.getpid()), str(scratch.root())]
        try:
            pid = os.posix_spawn(argv[0], argv, dict(os.environ), setsid=True,
                                 file_actions=[(os.POSIX_SPAWN_DUP2, read_fd, 0),
                                               (os.POSIX_SPAWN_OPEN, 1, "/dev/null",
                                                os.O_WRONLY, 0)])
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        self.pid, self._write_fd = pid, write_fd
        self.exited = self.watcher.watch(pid)
        for child in sorted(self.watcher.pids - {pid}):
            self._tell(child, True)
        return pid

    def alive(self) -> bool:
        return self.exited is not None and not self.exited.done()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Clean shutdown: EOF on its pipe; it finds nothing left and exits."""
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None
        if self.exited is not None and self.pid is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.exited), timeout_s)
            except asyncio.TimeoutError:
                os.kill(self.pid, signal.SIGKILL)
                await self.exited
