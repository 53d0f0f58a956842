"""`python -m engined.supervisor.host.guard DAEMON_PID [SCRATCH_ROOT]`: outlives a SIGKILLed engined
and kills every process that carries its mark (see engined.supervisor.host.reaper).

It reads stdin (a pipe whose write end only the daemon holds): the daemon tells it each child it
spawns (`+PID`: a process-group leader) and each one that exits (`-PID`). EOF comes when the
daemon exits for any reason: a clean shutdown has stopped every engine already, so nothing is
found; a SIGKILLed daemon leaves engines (which PR_SET_PDEATHSIG kills), the rest of their
process groups (a server's engine core, which may have overwritten its environment, and so its
mark, with a process title), and descendants that left the group (found by their mark). It kills
until none is left, removes the daemon's scratch root (its engines' TMPDIRs, see
engined.supervisor.host.scratch), then exits.
It imports only the standard library and the contract module: it starts in milliseconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

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


def marked_processes(prefix: str) -> list[int]:
    """Live pids whose ENGINED_OWNER mark equals `prefix`, or starts with it when it ends in
    '/' (every process of one daemon)."""
    own, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == own:
            continue
        mark = _mark(int(entry))
        if mark is not None and (mark == prefix or (prefix.endswith("/")
                                                    and mark.startswith(prefix))):
            out.append(int(entry))
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


def _read_groups(groups: set[int], data: bytes) -> None:
    """The daemon's lines: `+PID` (a child spawned: a process-group leader), `-PID` (gone)."""
    for line in data.split():
        try:
            pid = int(line[1:])
        except ValueError:
            continue
        if line.startswith(b"+"):
            groups.add(pid)
        elif line.startswith(b"-"):
            groups.discard(pid)


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    daemon = argv[1]
    groups: set[int] = set()
    pending = b""
    while chunk := os.read(0, 4096):
        pending += chunk
        complete, _, pending = pending.rpartition(b"\n")
        _read_groups(groups, complete)
    died = _ticks_now() + os.sysconf("SC_CLK_TCK")  # one tick of slack either way
    prefix = f"{daemon}/"
    killed: set[int] = set()
    for _ in range(ROUNDS):
        found = set(marked_processes(prefix)) | set(group_members(groups, died))
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
        print(f"engined guard: daemon {daemon} is gone; killed {len(killed)} leftover "
              f"process(es): {sorted(killed)}", file=sys.stderr, flush=True)
    if len(argv) > 2:  # the daemon's scratch root: its engines' TMPDIRs
        shutil.rmtree(argv[2], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
