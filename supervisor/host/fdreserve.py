"""File descriptors: the one resource whose exhaustion would take the daemon down with its fleet.

libzmq aborts the whole process (`Too many open files (src/ipc_listener.cpp)`) when its I/O
thread cannot accept a child's connection, and PR_SET_PDEATHSIG then takes every engine with the
daemon. So engined (1) raises its soft RLIMIT_NOFILE to the hard limit at start, giving children
the original soft limit back, and (2) keeps a reserve: a spawn is held back, and a new control or
HTTP connection refused, before free descriptors fall under what the children that are still
starting will need (each opens its ZeroMQ connections: control, requests, heartbeats).
"""

from __future__ import annotations

import errno
import logging
import os
import resource
from typing import Callable

log = logging.getLogger("engined.resources")

RESERVE_FDS = 32  # for the daemon's own needs: log rotation, /proc reads, a reload, sd_notify
FDS_PER_STARTING_CHILD = 4  # ZeroMQ connections a starting child has yet to open, and slack
FDS_PER_SPAWN = 4  # what a spawn holds on our side: the output pipe, the pidfd, and transients


def raise_nofile_limit() -> tuple[int, int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns (old soft, new soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:  # e.g. above fs.nr_open: keep what we have
            log.warning("[start] cannot raise the file-descriptor limit to %d: %s", target, exc)
            target = soft
    return soft, target, hard


def open_fds() -> int | None:
    """Descriptors open in this process (None when even listing them fails: no fd to spare)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # minus the one listdir itself opened
    except OSError:
        return None


class FdReserve:
    """Whether a spawn or a connection fits above the reserve, judged at that moment."""

    def __init__(self, starting_children: Callable[[], int]) -> None:
        self.starting_children = starting_children
        self.child_soft_limit: int | None = None  # given back to every child (ENV_NOFILE)

    def free(self) -> int:
        used = open_fds()
        if used is None:
            return 0
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return (soft if soft != resource.RLIM_INFINITY else 1 << 30) - used

    def needed(self) -> int:
        return RESERVE_FDS + FDS_PER_STARTING_CHILD * self.starting_children()

    def check_spawn(self) -> None:
        """Raise OSError(EMFILE) when a spawn now would eat into the reserve."""
        free, need = self.free(), self.needed() + FDS_PER_SPAWN
        if free < need:
            raise OSError(errno.EMFILE, f"only {max(free, 0)} file descriptors free, {need} "
                                        f"kept in reserve for the children starting and the "
                                        f"daemon itself: spawn held back")

    def may_accept(self) -> bool:
        return self.free() > self.needed()
