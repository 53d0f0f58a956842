"""The daemon's end of its guard (`python -m engined.supervisor.host.guard`, host/guard.py): it
starts the guard, tells it every child the daemon spawns (with the child's pidfd and output pipe)
and loses, and is replaced by a new one if it dies."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from engined.supervisor.host import scratch
from engined.supervisor.host.exits import ChildWatcher, ExitRecord

log = logging.getLogger("engined")

GUARD_MODULE = "engined.supervisor.host.guard"


class GuardControl:
    """The small process that outlives engined: it keeps the engines for the next engined
    (supervisor.orphan_timeout), or kills what carries engined's mark.

    It reads a SOCK_SEQPACKET socket from the daemon: EOF means the daemon is gone. After `.`
    (a clean shutdown: every engine is stopped already) it kills what is left and exits; after
    an unplanned death it holds the engines' pidfds and output pipes for `orphan_timeout` and
    hands them to the next engined (`<runtime_dir>/orphans.sock`), or kills them. It ignores
    SIGINT/SIGTERM/SIGHUP (a terminal's Ctrl-C or a unit's stop must not end it first) and runs
    in a session of its own. Spawned like an engine (posix_spawn from the event-loop thread)
    and watched by its pidfd; a dead guard is replaced.
    """

    RETRY_S = 5.0  # a guard that cannot be started is tried again this often

    def __init__(self, watcher: ChildWatcher, runtime_dir: Path | None = None,
                 orphan_timeout_s: float = 0.0) -> None:
        self.watcher = watcher
        self.runtime_dir = runtime_dir
        self.orphan_timeout_s = orphan_timeout_s
        self.pid: int | None = None
        self.exited: asyncio.Future[ExitRecord] | None = None
        self._channel: socket.socket | None = None
        self._closing = False
        self.marks: set[str] = set()  # owner marks of engines adopted from an earlier engined
        watcher.on_change.append(self._tell)

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
        its title (setproctitle, as vLLM's EngineCore does) overwrites its environment. A new
        child comes with its pidfd and output pipe (the guard holds them for the next engined
        if this one dies)."""
        if pid == self.pid:
            return
        if not alive:
            self._send(f"-{pid}")
            return
        fds = [fd for fd in (self.watcher.pidfds.get(pid), self.watcher.outputs.get(pid))
               if fd is not None]
        self._send(f"+{pid}", fds)

    def mark(self, prefix: str) -> None:
        """Sweep this owner mark too (an adopted engine's, from the engined before this one)."""
        self.marks.add(prefix)
        self._send(f"={prefix}")

    def _send(self, line: str, fds: list[int] | None = None) -> None:
        if self._channel is None:
            return
        try:
            socket.send_fds(self._channel, [line.encode()], fds or [])
        except OSError:  # a guard that died is replaced; it is told everything again then
            pass

    def start(self) -> int:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-m", GUARD_MODULE, str(os.getpid()), str(scratch.root()),
                str(self.runtime_dir or ""), f"{self.orphan_timeout_s:g}"]
        try:
            pid = os.posix_spawn(argv[0], argv, dict(os.environ), setsid=True,
                                 file_actions=[(os.POSIX_SPAWN_DUP2, theirs.fileno(), 0),
                                               (os.POSIX_SPAWN_OPEN, 1, "/dev/null",
                                                os.O_WRONLY, 0)])
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)  # a stuck guard never blocks the loop (it is replaced if it dies)
        self.pid, self._channel = pid, ours
        self.exited = self.watcher.watch(pid)
        self._tell_all()
        return pid

    def _tell_all(self) -> None:
        for prefix in sorted(self.marks):
            self._send(f"={prefix}")
        for child in sorted(self.watcher.pids - {self.pid}):
            self._tell(child, True)

    def alive(self) -> bool:
        return self.exited is not None and not self.exited.done()

    def hand_over(self) -> tuple[int | None, int | None]:
        """An upgrade in place: the guard's pid and its socket, kept across the exec (the guard
        sees no EOF: the same daemon goes on)."""
        self._closing = True  # its exit is the new code's to watch now
        if not self.alive() or self._channel is None:
            return None, None
        return self.pid, self._channel.detach()

    def adopt(self, pid: int, fd: int) -> None:
        """The new code's side: the guard the old code started, told every child again."""
        os.set_inheritable(fd, False)
        try:
            self.exited = self.watcher.watch(pid)
        except OSError:  # gone meanwhile: a new one
            os.close(fd)
            self.keep()
            return
        self.pid, self._channel = pid, socket.socket(fileno=fd)
        self._channel.setblocking(False)
        self._tell_all()
        self.exited.add_done_callback(self._exited)
        log.info("[guard] pid %d (handed over) watches for engined's death", pid)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Clean shutdown: `.` then EOF; it finds nothing left and exits."""
        self._closing = True
        if self._channel is not None:
            self._send(".")
            self._channel.close()
            self._channel = None
        if self.exited is not None and self.pid is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.exited), timeout_s)
            except asyncio.TimeoutError:
                os.kill(self.pid, signal.SIGKILL)
                await self.exited
