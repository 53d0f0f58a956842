"""Was an engine killed by the kernel's OOM killer? Only evidence says so, never a guess.

An unexpected SIGKILL is often the OOM killer, but as often a person's `kill -9`. engined says
"out of memory" only when the kernel log names the pid (`Killed process 1234`, `oom-kill:...,
pid=1234`; /dev/kmsg, where readable) or, without a readable kernel log, when the OOM-kill counter
of engined's memory cgroup moved since it last looked (cgroup v2 `memory.events`, v1
`memory.oom_control`: `oom_kill N`) or, without that either, when the host's OOM-kill counter
(/proc/vmstat `oom_kill`) moved. Reads are small and bounded: they run once per unexpected
SIGKILL, on the event loop, between the exit and the respawn. The kernel log (a few hundred
microseconds to read, more with a full ring) is read only when the host's counter moved since it
was last read, or when that read did not name every kill the counter had counted: the counter
moves before the kill's log line is written and before the process dies, so while it stands
still, the last read's answer stands.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

KMSG = "/dev/kmsg"
KMSG_RECORDS = 20_000  # at most this many records read per check (the ring is a few MB)
_KILLED = re.compile(rb"(?:Killed process (\d+)\b|oom-kill:.*?\bpid=(\d+)\b)")
_COUNTER = re.compile(rb"^oom_kill (\d+)$", re.M)


def oom_pids_in(records: list[bytes]) -> set[int]:
    """The pids kernel log records name as killed by the OOM killer."""
    found: set[int] = set()
    for record in records:
        for match in _KILLED.finditer(record):
            found.add(int(match.group(1) or match.group(2)))
    return found


def read_kmsg(path: str = KMSG, limit: int = KMSG_RECORDS) -> list[bytes] | None:
    """Every record of the kernel's log buffer, or None where it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    records: list[bytes] = []
    try:
        while len(records) < limit:
            try:
                records.append(os.read(fd, 8192))
            except BlockingIOError:
                break  # the end of the buffer
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten while reading: go on
                    continue
                if not records:
                    return None
                break
    finally:
        os.close(fd)
    return records


def cgroup_counter_file(proc_cgroup: str = "/proc/self/cgroup",
                        root: str = "/sys/fs/cgroup") -> Path | None:
    """engined's own memory cgroup's OOM-kill counter file (v2, else v1), if there is one."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            candidate = Path(root) / path.lstrip("/") / "memory.events"
        elif "memory" in controllers.split(","):
            candidate = Path(root) / "memory" / path.lstrip("/") / "memory.oom_control"
        else:
            continue
        if candidate.is_file():
            return candidate
    return None


VMSTAT = "/proc/vmstat"  # `oom_kill N`: the host's OOM kills since boot (Linux 4.13+)


class OomWitness:
    """`killed(pid)`: True only with evidence that the OOM killer killed that pid: the kernel
    log naming it; without a readable log, engined's memory cgroup's OOM-kill counter having
    moved; without that either, the host's (/proc/vmstat `oom_kill`) having moved."""

    def __init__(self, kmsg: str = KMSG, counter: Path | None | bool = True,
                 vmstat: Path | None = Path(VMSTAT)) -> None:
        self.kmsg = kmsg
        self.counter = cgroup_counter_file() if counter is True else counter or None
        self.vmstat = vmstat
        self._count = self._read_count(self.counter)
        self._host = self._read_count(self.vmstat)
        records = read_kmsg(self.kmsg) if self._host is not None else None
        self._seen = oom_pids_in(records) if records is not None else set()  # in the last read
        self._settled = records is not None  # it named every kill the host's counter counted

    @staticmethod
    def _read_count(path: Path | None) -> int | None:
        if path is None:
            return None
        try:
            match = _COUNTER.search(path.read_bytes())
        except OSError:
            return None
        return int(match.group(1)) if match else None

    def killed(self, pid: int) -> bool:
        before, self._count = self._count, self._read_count(self.counter)
        host_before, self._host = self._host, self._read_count(self.vmstat)
        if self._settled and self._host is not None and self._host == host_before:
            return pid in self._seen  # no OOM kill on the host since the log was last read
        records = read_kmsg(self.kmsg)
        if records is not None:
            found = oom_pids_in(records)
            self._settled = (self._host is not None and host_before is not None
                             and len(found - self._seen) >= self._host - host_before)
            self._seen = found
            return pid in found
        self._settled = False
        if before is not None and self._count is not None:
            return self._count > before
        return host_before is not None and self._host is not None and self._host > host_before
