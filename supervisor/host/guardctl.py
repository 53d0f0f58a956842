"""The daemon's end of its guard (`python -m engined.supervisor.host.guard`, host/guard.py): it
starts the guard, tells it every child the daemon spawns and loses, and is replaced by a new one
if it dies."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from engined.supervisor.host import scratch
from engined.supervisor.host.exits import ChildWatcher, ExitRecord

log = logging.getLogger("engined")

GUARD_MODULE = "engined.supervisor.host.guard"


class GuardControl:
    """The small process that outlives a SIGKILLed engined and kills what carries its mark.

    It reads a pipe from the daemon: EOF means the daemon is gone (or shutting down, having
    stopped every engine already): it then kills every process marked `<daemon pid>/...` and
    exits. It ignores SIGINT/SIGTERM/SIGHUP (a terminal's Ctrl-C or a unit's stop must not end
    it first) and runs in a session of its own. Spawned like an engine (posix_spawn from the
    event-loop thread) and watched by its pidfd; a dead guard is replaced.
    """

    RETRY_S = 5.0  # a guard that cannot be started is tried again this often

    def __init__(self, watcher: ChildWatcher) -> None:
        self.watcher = watcher
        self.pid: int | None = None
        self.exited: asyncio.Future[ExitRecord] | None = None
        self._write_fd: int | None = None
        self._closing = False
        watcher.on_change = self._tell

    def keep(self) -> None:
        """Start the guard, and a new one whenever it dies (until `close`)."""
        if self._closing:
            return
        try:
            pid = self.start()
        except OSError as exc:
            log.error("[guard] cannot start the guard (%s); retrying in %.0fs", exc,
                      self.RETRY_S)
            asyncio.get_running_loop().call_later(self.RETRY_S, self.keep)
            return
        log.info("[guard] pid %d watches for engined's death", pid)
        assert self.exited is not None
        self.exited.add_done_callback(self._exited)

    def _exited(self, future: asyncio.Future[ExitRecord]) -> None:
        if self._closing or future.cancelled():
            return
        log.warning("[guard] pid %s exited (%s): starting a new one", self.pid,
                    future.result().status.describe())
        self.keep()

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

    def hand_over(self) -> tuple[int | None, int | None]:
        """An upgrade in place: the guard's pid and its pipe's write end, kept across the exec
        (the guard sees no EOF: the same daemon goes on)."""
        self._closing = True  # its exit is the new code's to watch now
        return (self.pid, self._write_fd) if self.alive() else (None, None)

    def adopt(self, pid: int, write_fd: int) -> None:
        """The new code's side: the guard the old code started, told every child again."""
        os.set_inheritable(write_fd, False)
        try:
            self.exited = self.watcher.watch(pid)
        except OSError:  # gone meanwhile: a new one
            os.close(write_fd)
            self.keep()
            return
        self.pid, self._write_fd = pid, write_fd
        for child in sorted(self.watcher.pids - {pid}):
            self._tell(child, True)
        self.exited.add_done_callback(self._exited)
        log.info("[guard] pid %d (handed over) watches for engined's death", pid)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Clean shutdown: EOF on its pipe; it finds nothing left and exits."""
        self._closing = True
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None
        if self.exited is not None and self.pid is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.exited), timeout_s)
            except asyncio.TimeoutError:
                os.kill(self.pid, signal.SIGKILL)
                await self.exited
