"""After an unplanned death of engined: the next one adopts the engines it left.

A SIGKILLed, crashed or OOM-killed engined leaves its engines running (supervisor.orphan_timeout:
they set no PR_SET_PDEATHSIG) and its guard holding them: each engine's pidfd and output pipe
(supervisor.host.guard). The state it kept current on disk (`<runtime_dir>/state.json`, written
on every change: `Keeper`) says what each engine was. The next engined started on the same
runtime directory, once it holds the runtime lock (so the old one is gone):

* reads that snapshot (`load`): a corrupt or newer one is not used, and it starts fresh;
* claims the engines from the guard (`claim`, `<runtime_dir>/orphans.sock`);
* adopts each saved engine the guard hands over, by the guard's pidfd: a pidfd names one
  process for its whole life, so a reused pid can never be taken for the engine. An engine that
  is alive must also have the saved start time (and owner mark, where its environment still
  shows one). An engine that died while no engined watched is adopted dead: its exit is seen at
  once, said once (its status is lost with the daemon that was its parent) and it is restarted
  by its policy. Processes the guard hands over that the snapshot does not know (spawned just
  before the death) are ours by proof and are killed; a saved pid the guard does not hand over
  is never signalled unless it is provably the engine (start time and owner mark), and then it
  is killed and restarted (its output pipe is lost with the guard).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engined.supervisor.host.guard import ORPHANS_SOCKET, _mark, close_fds, pidfd_exited
from engined.supervisor.lifecycle.replica import Replica
from engined.supervisor.upgrade import snapshot
from engined.supervisor.upgrade.handover import spec_digest

log = logging.getLogger("engined")

CLAIM_TIMEOUT_S = 5.0
MIN_GAP_S = 0.02  # the snapshot is rewritten at most this often (a burst of changes: once)


@dataclass
class Orphan:
    """One process the guard held: its pidfd and output pipe, and what it wrote meanwhile."""

    pid: int
    alive: bool
    pidfd: int | None
    output_fd: int | None
    output: str = ""

    def close(self) -> None:
        close_fds(self.pidfd, self.output_fd)
        self.pidfd = self.output_fd = None

    def exited(self) -> bool:
        return self.pidfd is None or pidfd_exited(self.pidfd)

    def kill(self) -> None:
        """SIGKILL its process group, only while the pidfd says it lives (its pid is its)."""
        if not self.exited():
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass


def load(runtime_dir: Path) -> snapshot.Snapshot | None:
    """The state a dead engined kept in `runtime_dir`, or None (none, or unusable: said)."""
    path = snapshot.path_in(runtime_dir)
    found, why = snapshot.load(path)
    if found is None:
        if why != "none":
            log.error("[recover] the state snapshot cannot be used (%s): starting fresh; "
                      "engines the guard hands over are stopped", why)
        return None
    if found.pid == os.getpid():
        return None
    return found


def claim(runtime_dir: Path) -> dict[int, Orphan]:
    """The engines a dead engined's guard is keeping, by pid ({} if there is no such guard)."""
    path = runtime_dir / ORPHANS_SOCKET
    if not path.exists():
        return {}
    out: dict[int, Orphan] = {}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.settimeout(CLAIM_TIMEOUT_S)
            conn.connect(str(path))
            conn.sendall(b"claim")
            while True:
                data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 4)
                if data in (b"end", b""):
                    break
                header = json.loads(data)
                for fd in fds:
                    os.set_inheritable(fd, False)
                orphan = Orphan(int(header["pid"]), bool(header["alive"]),
                                fds[0] if fds else None, fds[1] if len(fds) > 1 else None,
                                str(header.get("output", "")))
                out[orphan.pid] = orphan
            conn.sendall(b"ok")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.error("[recover] the guard at %s did not hand its engines over (%s): they are left "
                  "to it", path, exc)
        for orphan in out.values():
            orphan.close()
        return {}
    log.info("[recover] the guard handed over %d process(es) (%d alive)", len(out),
             sum(1 for o in out.values() if o.alive))
    return out


def stop_orphans(runtime_dir: Path) -> str:
    """`engined --stop-orphans`: the guard of a dead engined kills what it keeps now (a stop,
    not a restart: nothing will adopt them). What happened, in words."""
    path = runtime_dir / ORPHANS_SOCKET
    if not path.exists():
        return f"no engines are waiting to be adopted in {runtime_dir}"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.settimeout(CLAIM_TIMEOUT_S * 6)  # the sweep waits for the kills to land
            conn.connect(str(path))
            conn.sendall(b"sweep")
            answer = conn.recv(64)
    except OSError as exc:
        return f"the guard at {path} did not answer ({exc})"
    if answer != b"done":
        return f"the guard at {path} answered {answer!r}"
    return f"the engines kept for adoption in {runtime_dir} were stopped"


class Claimer:
    """`handover.Claim` for the crash path: a saved process is taken back by the guard's
    pidfd."""

    def __init__(self, orphans: dict[int, Orphan], old_pid: int) -> None:
        self.orphans = orphans
        self.old_pid = old_pid

    def __call__(self, replica: Replica, process: snapshot.Process) -> tuple[int | None, int] | \
            None:
        orphan = self.orphans.pop(process.pid, None)
        if orphan is None or orphan.pidfd is None:
            self._not_handed_over(replica, process)
            return None
        if process.spec and process.spec != spec_digest(replica.spec) and not orphan.exited():
            log.warning("[recover] %s: its spec changed since pid %d was started: it is "
                        "started again with the new one", replica.name, process.pid)
            orphan.kill()
            orphan.close()
            return None
        if not orphan.exited():  # the pidfd proves it; the start time says it is the one saved
            why = _not_the_same(process, use_mark=False)
            if why is not None:
                log.error("[recover] %s: pid %d is not the engine saved (%s): killed, and %s "
                          "starts again", replica.name, process.pid, why, replica.name)
                orphan.kill()
                orphan.close()
                return None
        else:
            replica.log.note(f"pid {process.pid} exited while no engined was watching (engined "
                             f"pid {self.old_pid} had died); its exit status is lost")
        if orphan.output:
            replica.log.feed(orphan.output.encode())
            replica.log.flush_partial()
        output_fd = orphan.output_fd
        if output_fd is None:  # it closed its output: an empty pipe stands in
            output_fd, write_end = os.pipe2(os.O_CLOEXEC)
            os.close(write_end)
        return orphan.pidfd, output_fd

    def _not_handed_over(self, replica: Replica, process: snapshot.Process) -> None:
        """No guard has it: it is ours only if its start time and mark prove it (then it cannot
        be supervised without its output: killed, and started again); else never touched."""
        if _not_the_same(process) is None:
            log.warning("[recover] %s: pid %d lives but no guard handed it over: killed, and it "
                        "starts again", replica.name, process.pid)
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except OSError:
                pass

    def leftovers(self) -> None:
        """Processes the guard handed over that no saved engine claims (spawned just before the
        death, a fork server, an engine since removed from the spec): killed."""
        for orphan in self.orphans.values():
            if not orphan.exited():
                log.warning("[recover] pid %d of engined pid %d is no engine of the saved state: "
                            "killed", orphan.pid, self.old_pid)
                orphan.kill()
            orphan.close()
        self.orphans.clear()


def _not_the_same(process: snapshot.Process, use_mark: bool = True) -> str | None:
    """Why the live `process.pid` is not the process saved, or None if it is: its start time,
    and (`use_mark`) its owner mark, which must be there (a forked engine's environment in
    /proc is its fork server's: it cannot be proven this way)."""
    ticks = snapshot.start_ticks(process.pid)
    if ticks is None:
        return "gone"
    if ticks != process.start_ticks:
        return f"started at tick {ticks}, not {process.start_ticks}: a reused pid"
    if not use_mark:
        return None
    mark = _mark(process.pid)
    if mark is None:
        return "no owner mark to prove it"
    if mark != process.token:
        return f"owner mark {mark!r}, not {process.token!r}"
    return None


class Keeper:
    """Keeps `<runtime_dir>/state.json` current: rewritten, off the event loop and atomically
    (supervisor.snapshot), MIN_GAP_S after `changed` is set (a state change, an event, a child
    spawned or gone, a request counted), so at most that often. Changes come in bursts (an
    exit, its state changes, the respawn, its HELLO): written once the burst is over, and never
    between an engine's exit and its respawn, where the capture and the writing thread (it
    takes the GIL) made the respawn wait. The file's ages are relative to its `written_at`, so
    an idle daemon has nothing to rewrite and never wakes for it."""

    def __init__(self, path: Path, capture: Callable[[], snapshot.Snapshot],
                 changed: asyncio.Event) -> None:
        self.path = path
        self.capture = capture
        self.changed = changed
        self.failed: str | None = None
        self.closed = False
        self._writing: asyncio.Future[None] | None = None

    async def close(self) -> None:
        """No more writes (a clean shutdown removes the file once the write in flight, if any,
        has landed)."""
        self.closed = True
        if self._writing is not None:
            try:
                await self._writing
            except OSError:
                pass

    async def run(self) -> None:
        while not self.closed:
            await self.changed.wait()
            await asyncio.sleep(MIN_GAP_S)
            self.changed.clear()
            await self.write_now()

    async def write_now(self) -> None:
        if self.closed:
            return
        self._writing = asyncio.ensure_future(
            asyncio.to_thread(snapshot.write, self.path, self.capture()))
        try:
            await asyncio.shield(self._writing)
            self.failed = None
        except OSError as exc:
            if self.failed is None:
                log.error("[snapshot] cannot write %s (%s): a crash now loses the engines' "
                          "adoption", self.path, exc)
            self.failed = str(exc)


def elapsed_since(saved: snapshot.Snapshot) -> float:
    """Seconds since the snapshot was written (its ages are relative to then)."""
    return max(0.0, time.time() - saved.written_at)
