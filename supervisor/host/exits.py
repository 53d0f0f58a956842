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
import signal
import time
from dataclasses import dataclass
from typing import Callable, ClassVar

from engined.engine.contract import EXIT_CONFIG


@dataclass(frozen=True)
class ExitStatus:
    """How a child ended: exactly one of `code` and `signal` is set, or neither when the status
    is unknown (`UNKNOWN`: the child was reaped by someone else), which is never a clean exit."""

    code: int | None = None
    signal: int | None = None

    UNKNOWN: ClassVar[ExitStatus]

    @classmethod
    def from_wait_status(cls, status: int) -> ExitStatus:
        if os.WIFSIGNALED(status):
            return cls(signal=os.WTERMSIG(status))
        return cls(code=os.waitstatus_to_exitcode(status))

    @property
    def signal_name(self) -> str | None:
        """The killing signal, or the one behind a 128+N exit after cleanup (143 -> SIGTERM)."""
        num = self.signal
        if num is None and self.code is not None and 128 < self.code < 128 + 65:
            num = self.code - 128
        if num is None:
            return None
        try:
            return signal.Signals(num).name
        except ValueError:
            return f"SIG{num}"

    @property
    def clean(self) -> bool:
        return self.code == 0

    def describe(self, oom: bool = False) -> str:
        """`oom`: the kernel says its OOM killer sent that SIGKILL (see host/oom.py);
        without that evidence a SIGKILL is just a SIGKILL (a person's `kill -9` is one too)."""
        if self.signal is not None:
            hint = " by the kernel's OOM killer (out of memory)" if oom else ""
            return f"killed by {self.signal_name}{hint}"
        if self.code == EXIT_CONFIG:
            return "exit 78 (invalid engine config or model)"
        if self.code is None:
            return "exit status unknown (not engined's child: adopted, or reaped elsewhere)"
        if self.signal_name is not None:
            return f"exit {self.code} (terminated by {self.signal_name} after cleanup)"
        return f"exit {self.code}"


ExitStatus.UNKNOWN = ExitStatus()


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

