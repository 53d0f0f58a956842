"""`python -m engined.supervisor.host.guard DAEMON_PID [SCRATCH_ROOT [RUNTIME_DIR ORPHAN_TIMEOUT]]`:
outlives engined; after an unplanned death it keeps the engines for the next engined to adopt,
or kills every process that carries engined's mark.

Its stdin is a unix SOCK_SEQPACKET socket whose other end only the daemon holds. The daemon
sends one message per event:

* `+PID` with up to two descriptors: the child's pidfd (proof of which process it is: a pid can
  be reused, a pidfd cannot) and the read end of its output pipe. Every child is a
  process-group leader (setsid);
* `-PID`: it exited;
* `=MARK`: another owner-mark prefix to sweep (engines adopted from an engined before this one);
* `.`: a clean shutdown follows (every engine is stopped already).

EOF comes when the daemon exits for any reason. After a clean shutdown, or with no live engine,
or when ORPHAN_TIMEOUT is 0 (engines then die with the daemon by PR_SET_PDEATHSIG), it sweeps at
once: it kills every process in the engines' process groups (a server's engine core may have
overwritten its environment, and so its mark, with a process title) and every process whose
ENGINED_OWNER mark is the daemon's (descendants that left the group), until none is left,
removes the daemon's scratch root (its engines' TMPDIRs, see engined.supervisor.host.scratch),
then exits.

After an unplanned death (SIGKILL, a crash, the OOM killer) with ORPHAN_TIMEOUT > 0 it keeps
the engines instead (supervisor.orphan_timeout): it drains their output pipes (so no engine
blocks on, or dies of, a write: the last OUTPUT_KEPT bytes of each are kept) and listens on
`RUNTIME_DIR/orphans.sock`. The next engined started on that runtime directory connects and
sends `claim`; the guard answers with one message per engine (a JSON header: pid, alive, the
output kept; its pidfd and output pipe as descriptors) then `end`, waits for `ok`, and exits
leaving everything running: the new engined adopts them and starts a guard of its own. If
none comes within ORPHAN_TIMEOUT, it sweeps as above: no orphan outlives `orphan_timeout`.
`sweep` instead of `claim` (`engined --stop-orphans`: the unit was stopped, not restarted)
sweeps at once and answers `done`.

It imports only the standard library and the contract module: it starts in milliseconds.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import shutil
import signal
import socket
import sys
import time
from collections.abc import Iterable

from engined.engine.contract import ENV_OWNER  # the contract is standard library only

ROUNDS = 50  # a killed parent's children may still be forking for a moment
ROUND_S = 0.1


def _mark(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    key = ENV_OWNER.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(key):
            return item[len(key):].decode(errors="replace")
    return None


def marked_processes(prefix: str, among: Iterable[int] | None = None) -> list[int]:
    """Live pids whose ENGINED_OWNER mark equals `prefix`, or starts with it when it ends in
    '/' (every process of one daemon); of `among` only, or of every process on the host."""
    own, out = os.getpid(), []
    pids = among if among is not None else (int(e) for e in os.listdir("/proc") if e.isdigit())
    for pid in pids:
        if pid == own:
            continue
        mark = _mark(pid)
        if mark is not None and (mark == prefix or (prefix.endswith("/")
                                                    and mark.startswith(prefix))):
            out.append(pid)
    return out


def _stat(pid: int) -> tuple[int, int] | None:
    """(process group, start time in clock ticks since boot) of a live pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()  # after "pid (comm) ": state is field 3
    try:
        return int(fields[2]), int(fields[19])
    except (IndexError, ValueError):
        return None


def group_members(groups: set[int], born_before: float) -> list[int]:
    """Live pids in one of `groups` (the daemon's engines' process groups) that started before
    `born_before` (ticks since boot): a group id is not reused while a member lives, and a
    process started after the daemon died is no engine's."""
    own, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == own:
            continue
        stat = _stat(int(entry))
        if stat is not None and stat[0] in groups and stat[1] <= born_before:
            out.append(int(entry))
    return out


def _ticks_now() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK")


def pidfd_exited(pidfd: int) -> bool:
    """Whether the process a pidfd names has exited (a pidfd turns readable then)."""
    return bool(select.select([pidfd], [], [], 0)[0])


def close_fds(*fds: int | None) -> None:
    """Close each descriptor given (None: none), ignoring one already closed."""
    for fd in fds:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


OUTPUT_KEPT = 64 * 1024  # per engine, the tail of what it wrote while no engined read it
ORPHANS_SOCKET = "orphans.sock"
CLAIM_WAIT_S = 5.0  # a claimant that says nothing (or never acknowledges) for this long is let go


class Held:
    """One child the daemon told us of: its pidfd and output pipe, once it is orphaned the
    output it wrote since."""

    def __init__(self, pid: int, fds: list[int]) -> None:
        self.pid = pid
        self.pidfd = fds[0] if fds else None
        self.output = fds[1] if len(fds) > 1 else None
        self.kept = bytearray()
        self.alive = True
        for fd in fds[2:]:
            os.close(fd)

    def close(self) -> None:
        close_fds(self.pidfd, self.output)
        self.pidfd = self.output = None

    def drain(self) -> None:
        """Read what the engine wrote (non-blocking); keep the tail. EOF: nobody writes."""
        assert self.output is not None
        try:
            chunk = os.read(self.output, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            os.close(self.output)
            self.output = None
            return
        self.kept += chunk
        del self.kept[:-OUTPUT_KEPT]

    def check_alive(self) -> bool:
        if self.alive and self.pidfd is not None:
            self.alive = not pidfd_exited(self.pidfd)
        return self.alive


class Guard:
    def __init__(self, daemon: str) -> None:
        self.daemon = daemon
        self.held: dict[int, Held] = {}
        self.marks = {f"{daemon}/"}
        self.clean = False
        self.died = 0.0  # when the daemon died, in clock ticks since boot
        self.swept = False

    def read_daemon(self, channel: socket.socket) -> None:
        """Until EOF: the daemon's messages."""
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(channel, 4096, 4)
            except InterruptedError:
                continue
            except OSError:
                return
            if not data:
                for fd in fds:
                    os.close(fd)
                return
            self.message(data.strip(), fds)

    def message(self, line: bytes, fds: list[int]) -> None:
        kind, rest = line[:1], line[1:].decode(errors="replace")
        if kind == b"+" and rest.isdigit():
            old = self.held.pop(int(rest), None)
            if old is not None:
                old.close()
            self.held[int(rest)] = Held(int(rest), fds)
            return
        for fd in fds:
            os.close(fd)
        if kind == b"-" and rest.isdigit():
            gone = self.held.pop(int(rest), None)
            if gone is not None:
                gone.close()
        elif kind == b"=" and rest:
            self.marks.add(rest)
        elif kind == b".":
            self.clean = True

    def live(self) -> list[Held]:
        return [h for h in self.held.values() if h.check_alive()]

    def sweep(self, died: float) -> None:
        """Kill every process of the engines' groups (born before `died`) and every marked one,
        until none is left."""
        groups = set(self.held)
        killed: set[int] = set()
        for _ in range(ROUNDS):
            found = set(group_members(groups, died))
            for mark in self.marks:
                found |= set(marked_processes(mark))
            if not found:
                break
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            time.sleep(ROUND_S)
        if killed:
            print(f"engined guard: daemon {self.daemon} is gone; killed {len(killed)} leftover "
                  f"process(es): {sorted(killed)}", file=sys.stderr, flush=True)

    def keep_orphans(self, runtime_dir: str, timeout_s: float) -> bool:
        """Hold the engines until an engined claims them (True) or `timeout_s` passes."""
        path = os.path.join(runtime_dir, ORPHANS_SOCKET)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            os.unlink(path)
        except OSError:
            pass
        old_umask = os.umask(0o177)
        try:
            listener.bind(path)
        except OSError as exc:
            print(f"engined guard: cannot listen on {path} ({exc}): the engines of daemon "
                  f"{self.daemon} cannot be adopted", file=sys.stderr, flush=True)
            return False
        finally:
            os.umask(old_umask)
        listener.listen(4)
        print(f"engined guard: daemon {self.daemon} died; keeping {len(self.live())} engine(s) "
              f"for {timeout_s:g}s for the next engined to adopt", file=sys.stderr, flush=True)
        deadline = time.monotonic() + timeout_s
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(listener, selectors.EVENT_READ)
                for held in self.held.values():
                    if held.output is not None:
                        sel.register(held.output, selectors.EVENT_READ, held)
                while (left := deadline - time.monotonic()) > 0:
                    for key, _ in sel.select(min(left, 1.0)):
                        if key.data is None:
                            if self.hand_over(listener):
                                return True
                            continue
                        held = key.data
                        held.drain()
                        if held.output is None:
                            sel.unregister(key.fileobj)
                return False
        finally:
            listener.close()
            try:
                os.unlink(path)
            except OSError:
                pass

    def hand_over(self, listener: socket.socket) -> bool:
        """A claimant: every engine held goes to it; True once it has acknowledged them."""
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(CLAIM_WAIT_S)
            try:
                ask = conn.recv(64).strip()
                if ask == b"sweep":  # `engined --stop-orphans`: a stop, not a restart
                    self.sweep(self.died)
                    self.swept = True
                    conn.sendall(b"done")
                    return True
                if ask != b"claim":
                    return False
                for held in self.held.values():
                    if held.output is not None:
                        held.drain()
                    header = json.dumps({"pid": held.pid, "alive": held.check_alive(),
                                         "output": held.kept.decode(errors="replace")})
                    fds = [fd for fd in (held.pidfd, held.output) if fd is not None]
                    socket.send_fds(conn, [header.encode()], fds)
                conn.sendall(b"end")
                if conn.recv(64).strip() != b"ok":
                    return False
            except OSError:
                return False
        print(f"engined guard: {len(self.held)} engine(s) of daemon {self.daemon} handed to "
              f"the next engined", file=sys.stderr, flush=True)
        return True


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    guard = Guard(argv[1])
    channel = socket.socket(fileno=0)
    guard.read_daemon(channel)
    died = guard.died = _ticks_now() + os.sysconf("SC_CLK_TCK")  # one tick of slack either way
    orphan_timeout = float(argv[4]) if len(argv) > 4 else 0.0
    if not guard.clean and orphan_timeout > 0 and guard.live():
        if guard.keep_orphans(argv[3], orphan_timeout) and not guard.swept:
            return 0
    if not guard.swept:
        guard.sweep(died)
    if len(argv) > 2:  # the daemon's scratch root: its engines' TMPDIRs
        shutil.rmtree(argv[2], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
