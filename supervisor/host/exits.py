"""Exit detection by event: a pidfd per child on the event loop, never a poll.

`ChildWatcher` keeps the set of pids it watches, so the reaper (host/reaper.py) reaps only the
others and never steals a supervised child's exit status. The status comes from wait4 with the
child's rusage; a child reaped elsewhere (ChildProcessError: it should not happen), or a process
that is not our child (adopted after a daemon died, supervisor.recovery), ends with an unknown
status, which counts as a failure, never as a clean exit.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Callable

from engined.supervisor.lifecycle.policy import ExitStatus


@dataclass(frozen=True)
class ExitRecord:
    status: ExitStatus
    at_monotonic: float
    at_wall: float
    cpu_seconds: float = 0.0  # the child's own user+system time, from wait4's rusage


class ChildWatcher:
    """Exit detection by event (a pidfd per child, on the event loop), with the set of pids it
    watches: the reaper reaps only the others (never steals a supervised child's status)."""

    def __init__(self) -> None:
        self.pids: set[int] = set()
        self.on_change: list[Callable[[int, bool], None]] = []  # each called (pid, watched now)
        self.pidfds: dict[int, int] = {}  # pid -> its pidfd, while watched
        self.outputs: dict[int, int] = {}  # pid -> the read end of its output pipe
        # A fork server's engine is the daemon's child before its pid is known here: while a
        # spawn is between the two, the reaper must not reap (it would take that exit status).
        self.holds = 0
        self.on_release: Callable[[], None] | None = None  # the reaper catches up

    def hold(self) -> None:
        self.holds += 1

    def release(self) -> None:
        self.holds -= 1
        if self.holds == 0 and self.on_release is not None:
            self.on_release()

    def watch(self, pid: int, output_fd: int | None = None,
              pidfd: int | None = None) -> asyncio.Future[ExitRecord]:
        """Watch `pid` from the running loop (call on the event-loop thread). `output_fd`: the
        read end of its output pipe, `pidfd`: a pidfd already open for it (one handed over:
        the proof that it is the process it was), both kept here for the guard while it
        lives (supervisor.host.guardctl)."""
        self.pids.add(pid)
        try:
            if pidfd is None:
                pidfd = os.pidfd_open(pid)
            future = watch_exit(asyncio.get_running_loop(), pid, pidfd)
        except BaseException:
            self.pids.discard(pid)
            raise
        self.pidfds[pid] = pidfd
        if output_fd is not None:
            self.outputs[pid] = output_fd
        future.add_done_callback(lambda _: self._gone(pid))
        for listener in self.on_change:
            listener(pid, True)
        return future

    def _gone(self, pid: int) -> None:
        self.pids.discard(pid)
        self.pidfds.pop(pid, None)
        self.outputs.pop(pid, None)
        for listener in self.on_change:
            listener(pid, False)


def watch_exit(loop: asyncio.AbstractEventLoop, pid: int,
               pidfd: int | None = None) -> asyncio.Future[ExitRecord]:
    """A future resolved (and the zombie reaped, if it is our child) the moment `pid` exits,
    via its pidfd (`pidfd`, or one opened now). A process that is not our child (adopted after
    a daemon's death) ends with an unknown status: only its parent can read it."""
    future: asyncio.Future[ExitRecord] = loop.create_future()
    if pidfd is None:
        pidfd = os.pidfd_open(pid)
    os.set_inheritable(pidfd, False)

    def on_exit() -> None:
        try:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            cpu_s = usage.ru_utime + usage.ru_stime
        except ChildProcessError:  # reaped elsewhere; should not happen, but never hang on it
            exit_status, cpu_s = ExitStatus.UNKNOWN, 0.0
        else:
            if done == 0:
                return
            exit_status = ExitStatus.from_wait_status(status)
        record = ExitRecord(exit_status, time.monotonic(), time.time(), cpu_s)
        loop.remove_reader(pidfd)
        os.close(pidfd)
        if not future.done():
            future.set_result(record)

    loop.add_reader(pidfd, on_exit)
    return future

