"""What one kill, one promotion and one memory reading measure.

- `kill_once`: SIGKILL of replica 0 (idle) → READY again (the daemon's own `since`, and when a
  20 ms status poll saw it) and → the first answer of a `POST /v1/generate` sent right after the
  kill and resent every 10 ms while it answers 503.
- `standby_kill`: the same with a READY warm standby beside the victim: its engine is promoted
  under the dead one's name; then the standby builds a new spare.
- `teardown_floor`: SIGKILL → pidfd readable of a bare process mapping what the victim mapped:
  the kernel tears an address space down before it reports the exit, so no supervisor can
  learn of a death sooner.
- `measure_memory`: RSS, USS, PSS of every engine and fork server after each served a request.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import psutil

from bench.common import BenchError, Tracker, terminate
from bench.recovery.daemon import REPLICAS, Daemon, Generate
from testkit.driver import is_engine_of

SETTLE_S = 0.5  # after READY (and the other daemon's restart) before a kill
POLL_S = 0.01  # generate retries; status every other round: a 20 ms status poll
MB = 1e6


@dataclass
class Kill:
    ready_s: float  # SIGKILL → the daemon's READY (`since`)
    seen_s: float  # → a status poll saw it
    served_s: float  # → the first generate answered (max_tokens 1)
    detect_s: float | None  # → exit recorded (`last_exit.at`)
    startup_s: float | None  # the new incarnation's spawn → READY
    launcher: str  # what started the new incarnation
    promoted: bool = False  # standby: the replica's new pid is the standby's (not a restart)
    spare_s: float | None = None  # standby: → a new standby READY (its `since`)
    victim_uss_mb: float = 0.0  # the killed engine's private memory
    victim_rss_mb: float = 0.0  # … and all it mapped


def victim_of(d: Daemon, name: str) -> tuple[dict[str, Any], psutil.Process]:
    """`name` READY and settled, its pid checked to be an engine of `d`, no fork server."""
    d.wait_ready(1, name=name)
    time.sleep(SETTLE_S)
    old = d.wait_ready(d.engine(name)["incarnation"], name=name)
    if old["pid"] in d.server_pids or not is_engine_of(old["pid"], d.pid):
        raise BenchError(f"{name} pid {old['pid']} is not an engine of daemon {d.pid}")
    return old, psutil.Process(old["pid"])


def kill_once(d: Daemon, gen: Generate, spare_name: str | None = None) -> Kill:
    """SIGKILL replica 0's engine, then generate (max_tokens 1) to it every POLL_S while it
    answers 503, and read status every other round, until a token was served and a poll saw it
    READY with a higher incarnation."""
    name = d.watched
    spare = d.wait_ready(1, name=spare_name) if spare_name else None
    old, victim = victim_of(d, name)
    info = victim.memory_full_info()
    gen.once(name)  # the connection is open before the kill (and the route warm)
    t_kill = time.time()
    victim.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + d.backend.ready_timeout_s
    served = seen = None
    new: dict[str, Any] = {}
    rounds = 0
    while served is None or seen is None:
        if served is None:
            code, body = gen.once(name)
            if code == 200:
                served = time.time()
            elif code != 503:
                raise BenchError(f"POST /v1/generate to {name}: HTTP {code}: {body}")
        if seen is None and rounds % 2 == 0:
            e = d.engine(name)
            if e["state"] == "FAILED":
                raise BenchError(f"{name} FAILED: {e.get('fail_reason')}\n{d.log_tail()}")
            if e["state"] == "READY" and e["incarnation"] > old["incarnation"]:
                seen, new = time.time(), e
        rounds += 1
        if time.monotonic() > deadline:
            raise BenchError(f"{name} not READY and serving {d.backend.ready_timeout_s:g}s "
                             f"after its SIGKILL\n{d.log_tail()}")
        time.sleep(POLL_S)
    d.tracker.add(new["pid"])
    last_exit = new.get("last_exit") or {}
    k = Kill(ready_s=new["since"] - t_kill, seen_s=seen - t_kill, served_s=served - t_kill,
             detect_s=last_exit["at"] - t_kill if last_exit.get("at") else None,
             startup_s=new.get("startup_s"), launcher=str(new.get("launcher")),
             victim_uss_mb=info.uss / MB, victim_rss_mb=info.rss / MB)
    if spare is not None and spare_name is not None:
        k.promoted = new["pid"] == spare["pid"]
        k.spare_s = d.wait_ready(spare["incarnation"] + 1, name=spare_name)["since"] - t_kill
    return k


# The floor's victim: `argv[2]` MB mapped that its parent holds too (copy-on-write, as a forked
# engine maps the fork server's pages) and `argv[1]` MB of its own, all touched, anonymous and
# private. It prints its pid; its parent reaps it.
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
    of its own and `shared_mb` MB shared with its parent."""
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
            proc.stdout.close()  # type: ignore[union-attr]
    return times


@dataclass
class Mem:
    rss: float
    uss: float
    pss: float


def memory_of(pid: int) -> Mem | None:
    """RSS/USS/PSS (MB) of `pid` and its descendants; None if it is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    total = Mem(0.0, 0.0, 0.0)
    for p in procs:
        try:
            info = p.memory_full_info()
        except psutil.NoSuchProcess:
            continue
        total.rss, total.uss, total.pss = (total.rss + info.rss / MB, total.uss + info.uss / MB,
                                           total.pss + info.pss / MB)
    return total


def measure_memory(d: Daemon, gen: Generate) -> dict[str, list[Mem]]:
    """After each replica served one request (max_tokens 8) and a 1 s pause: the engines'
    and the fork servers'."""
    for name in (f"{d.backend.group}-{i}" for i in range(REPLICAS)):
        d.wait_ready(1, name=name)
        code, body = gen.once(name, max_tokens=8)
        if code != 200:
            raise BenchError(f"POST /v1/generate to {name}: HTTP {code}: {body}")
    time.sleep(1.0)
    status = d.status()
    engines = [memory_of(e["pid"]) for e in status["engines"] if e.get("pid")]
    servers = [memory_of(s["pid"]) for s in d.fork_servers(status) if s["state"] == "ready"]
    return {"engines": [m for m in engines if m], "servers": [m for m in servers if m]}
