"""Section 4, measured: warm standby promotion. SIGKILL of the serving replica with a READY standby
beside it → READY under its name (the standby's engine promoted) and → its first token, → a new
standby READY; and the floor: the kernel's teardown of a bare process that maps as much memory as
the victim did (SIGKILL → its pidfd readable), the share of a promotion no supervisor can remove.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from bench.common import BenchError, Tracker, spec_has_key, terminate
from bench.recovery.crash import recover, victim_of
from bench.recovery.daemon import Daemon, Generate


@dataclass
class Promotion:
    ready_s: float  # SIGKILL of the serving replica → READY under its name (`since`)
    seen_s: float
    served_s: float
    detect_s: float | None
    promoted: bool  # the replica's new pid is the standby's (not a restart)
    spare_s: float  # → a new standby READY again (its `since`)
    spare_startup_s: float | None  # the new standby's spawn → READY
    spare_launcher: str
    attempts: int
    victim_uss_mb: float  # the killed engine's private memory
    victim_rss_mb: float  # … and all it mapped
    victim_huge_mb: float | None  # … of which anonymous huge pages
    answer_s: float | None

    @property
    def promote_s(self) -> float | None:
        return None if self.detect_s is None else self.ready_s - self.detect_s


def standby_kill(d: Daemon, gen: Generate) -> Promotion:
    """SIGKILL the serving replica with a READY standby beside it: the standby's engine is
    promoted under the dead one's name; then the standby builds a new spare."""
    name = d.watched
    spare_name = f"{d.backend.group}-standby-0"
    spare = d.wait_ready(1, name=spare_name)
    old, victim = victim_of(d, name)
    spare = d.engine(spare_name)
    if spare["state"] != "READY" or spare.get("role") != "standby":
        raise BenchError(f"{spare_name} is not a READY standby: {spare}")
    gen.once(name)
    t_kill = time.time()
    victim.send_signal(signal.SIGKILL)
    served, seen, attempts, new, total_s = recover(d, gen, name, old, t_kill)
    last_exit = new.get("last_exit") or {}
    rebuilt = d.wait_ready(spare["incarnation"] + 1, name=spare_name)
    return Promotion(ready_s=new["since"] - t_kill, seen_s=seen - t_kill,
                     served_s=served - t_kill,
                     detect_s=last_exit["at"] - t_kill if last_exit.get("at") else None,
                     promoted=new["pid"] == spare["pid"], spare_s=rebuilt["since"] - t_kill,
                     spare_startup_s=rebuilt.get("startup_s"),
                     spare_launcher=str(rebuilt.get("launcher")), attempts=attempts,
                     victim_uss_mb=old["uss_mb"], victim_rss_mb=old["rss_mb"],
                     victim_huge_mb=old["huge_mb"],
                     answer_s=total_s)


# The floor's victim: a process that maps `argv[2]` MB its parent holds too (copy-on-write, as a
# forked engine maps the fork server's pages) and `argv[1]` MB of its own, all of it touched,
# anonymous and private (malloc's kind, not shmem). It prints its pid; its parent reaps it.
HOLD_MEMORY = """\
import mmap, os, sys, time
def touch(mb):
    size = max(4096, int(float(mb) * 1e6))
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(0, size, 4096):
        m[i] = 1
    return m
shared = touch(sys.argv[2])
pid = os.fork()
if pid == 0:
    own = touch(sys.argv[1])
    print(os.getpid(), flush=True)
    time.sleep(600)
    os._exit(0)
os.waitpid(pid, 0)
"""


def teardown_floor(own_mb: float, shared_mb: float, tracker: Tracker, n: int = 3
                   ) -> list[float]:
    """SIGKILL → its pidfd readable (what the daemon waits on) of a process mapping `own_mb` MB
    of private memory and `shared_mb` MB shared with its parent: the kernel tears an address
    space down before it reports the exit, so no supervisor can learn of a death sooner."""
    times = []
    for _ in range(n):
        proc = subprocess.Popen([sys.executable, "-c", HOLD_MEMORY, f"{own_mb:.1f}",
                                 f"{shared_mb:.1f}"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, text=True)
        tracker.add(proc.pid)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            if not line.isdigit():
                raise BenchError(f"the memory holder exited with {proc.wait()}")
            victim = int(line)
            tracker.add(victim)
            pidfd = os.pidfd_open(victim)
            try:
                time.sleep(0.2)
                poller = select.poll()
                poller.register(pidfd, select.POLLIN)
                started = time.perf_counter()
                os.kill(victim, signal.SIGKILL)  # our child's child, alive until this kill
                if not poller.poll(30_000):
                    raise BenchError("the floor's victim did not exit within 30 s")
                times.append(time.perf_counter() - started)
            finally:
                os.close(pidfd)
            proc.wait(30)
        finally:
            terminate(proc, 5)
            if proc.stdout is not None:
                proc.stdout.close()
    return times


def standby_exists() -> bool:
    """Whether this engined has warm standbys (`standby:` in the spec): the lead builds it."""
    return spec_has_key("standby")
