"""An engine owns its whole process tree: what it started dies with it, and with the daemon.

Engines such as vLLM start workers of their own, and a descendant that called setsid() has left
the engine's process group, so a group kill misses it (vLLM #55510: workers that survive their
parent keep the GPUs). engined therefore

* is a child subreaper (PR_SET_CHILD_SUBREAPER): a descendant whose parent dies is re-parented to
  engined, not to init, and engined reaps it. It reaps only pids it does not supervise, by pid
  (a waitpid(-1) would steal the engines' own exit statuses, which their pidfd watchers read);
* finds what an incarnation left behind by the mark every process it started inherits
  (ENGINED_OWNER=<daemon pid>/<engine>/<incarnation>, in /proc/PID/environ) and kills it before
  the replacement spawns, and removes its TMPDIR (`scratch`: the files it left there). As a
  subreaper, whatever an engine left is engined's descendant, and an orphan is re-parented to
  engined itself: only engined's unsupervised children and their descendants are read (from
  /proc/PID/task/*/children down), so the cost follows what was left, never the number of
  engines nor the host's processes (without the subreaper, every process on the host is read);
* runs a guard (`engined.supervisor.host.guard`) that outlives a SIGKILLed daemon: it keeps the
  engines for the next engined (supervisor.orphan_timeout), then kills their process groups and
  whatever carries the daemon's mark.

A descendant that rewrites its own environment and leaves its engine's process group escapes
both, see the README.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import time
from typing import Callable

from engined.supervisor.host import scratch
from engined.supervisor.host.guard import marked_processes

log = logging.getLogger("engined.reaper")

_PR_SET_CHILD_SUBREAPER = 36
LEFTOVER_WAIT_S = 5.0


SUBREAPER = [False]  # this process is a child subreaper (set by become_subreaper)


def become_subreaper() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("[start] cannot become a child subreaper (errno %d): an engine's escaped "
                    "descendants are re-parented to init", ctypes.get_errno())
        return False
    SUBREAPER[0] = True
    return True


def children_of(pid: int) -> set[int]:
    """Direct children (alive or zombie) of `pid`, from /proc/PID/task/*/children."""
    kids: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                kids.update(int(p) for p in f.read().split())
        except OSError:
            continue
    return kids


def descendants(root: int) -> set[int]:
    """Every descendant of `root` (alive or zombie), walking /proc/PID/task/*/children."""
    found: set[int] = set()
    frontier = [root]
    while frontier:
        kids = children_of(frontier.pop()) - found
        found |= kids
        frontier.extend(kids)
    return found


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
                 held: Callable[[], bool] = lambda: False,
                 subreaper: Callable[[], bool] = lambda: SUBREAPER[0]) -> None:
        self.supervised = supervised
        self.held = held  # a fork-server spawn in progress: its engine is not watched yet
        self.subreaper = subreaper  # leftovers are our descendants: only those are read
        self.killed_total = 0
        self._tidying: set[asyncio.Task[None]] = set()  # TMPDIR removals under way

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

    async def clear(self, engine: str, incarnation: int, token: str,
                    descendant: bool = True) -> list[int]:
        """Kill every process still marked as this incarnation's, and wait (bounded) until they
        are gone; returns the pids killed. `descendant`: the incarnation was our descendant (not
        an engine a crashed daemon left), so what it left is too.

        This runs between an engine's exit and its replacement's spawn: in the usual case (it
        left nothing) it reads a few /proc files on the loop and never waits for a thread. Its
        TMPDIR is `tidy`'s."""
        if descendant and self.subreaper():
            pids = marked_processes(token, self.orphans())
        else:  # anywhere on the host: every process is read, off the loop
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
        return pids

    def tidy(self, engine: str, incarnation: int, token: str) -> None:
        """Remove the TMPDIR of a cleared incarnation (its processes are gone), in the
        background: started now, it runs once the caller next waits, i.e. after the
        replacement's spawn. Its rmdir alone can take milliseconds (a filesystem mounted with
        `discard` trims the freed blocks at once), and the replacement has a directory of its
        own."""
        task = asyncio.get_running_loop().create_task(
            self._remove_scratch(engine, incarnation, token), name=f"tidy:{engine}")
        self._tidying.add(task)
        task.add_done_callback(self._tidying.discard)

    def orphans(self) -> set[int]:
        """What an exited engine of ours can have left, as a subreaper: our children that we do
        not supervise (its orphans, re-parented to us as it died: the kernel does so before its
        pidfd reports the exit) and their descendants. The supervised children's trees are
        not read: nothing in them descends from another engine, and reading them made each
        clear cost as much as every engine's processes."""
        roots = children_of(os.getpid()) - self.supervised()
        found = set(roots)
        for pid in roots:
            found |= descendants(pid)
        return found

    async def _remove_scratch(self, engine: str, incarnation: int, token: str) -> None:
        left = await asyncio.to_thread(scratch.remove, token)
        if left:
            log.info("[leftover] %s incarnation %d left %d file(s) in its TMPDIR: removed",
                     engine, incarnation, left)
