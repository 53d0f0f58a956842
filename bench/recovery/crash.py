"""Section 1, measured: crash → READY and → first token. SIGKILL of replica 0 (idle) → READY again
(the daemon's own `since`, and when a 20 ms status poll saw it) and → the first answer of a `POST
/v1/generate` sent right after the kill and resent every 10 ms while it answers 503.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any

import psutil

from bench.common import BenchError
from bench.recovery.daemon import MB, POLL_S, SETTLE_S, STATUS_EVERY, Daemon, Generate
from testkit.driver import is_engine_of


@dataclass
class Kill:
    ready_s: float  # SIGKILL → the daemon's READY (`since`)
    seen_s: float  # → a status poll saw it
    served_s: float  # → the first generate answered (max_tokens 1)
    detect_s: float | None  # → exit recorded (`last_exit.at`)
    startup_s: float | None  # the new incarnation's spawn → READY
    load_s: float | None  # the child's own build → warm-up (`[ready]` line)
    launcher: str  # what started the new incarnation
    attempts: int  # generate requests sent until one was served
    answer_s: float | None  # the answered request's time in the daemon (`total_s`)
    server_pid: int | None = None  # forkserver: the server that forked it (unchanged?)


def victim_of(d: Daemon, name: str) -> tuple[dict[str, Any], psutil.Process]:
    """`name` READY, settled, its pid checked to be an engine of `d` and no fork server (its
    USS, MB, in the returned status as `uss_mb`: what the kernel frees when it dies)."""
    old = d.wait_ready(1, name=name)
    time.sleep(SETTLE_S)
    old = d.engine(name)
    if old["state"] != "READY":
        old = d.wait_ready(old["incarnation"], name=name)
    pid = old["pid"]
    if pid in d.server_pids or not is_engine_of(pid, d.pid):
        raise BenchError(f"{name} pid {pid} is not an engine of daemon {d.pid}")
    victim = psutil.Process(pid)
    info = victim.memory_full_info()
    old["uss_mb"], old["rss_mb"] = info.uss / MB, info.rss / MB
    old["huge_mb"] = huge_pages_mb(pid)
    return old, victim


def huge_pages_mb(pid: int) -> float | None:
    """Anonymous memory in transparent huge pages (cheaper to free than 4 KiB pages)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024 / MB
    except OSError:
        pass
    return None


def recover(d: Daemon, gen: Generate, name: str, old: dict[str, Any], t_kill: float
            ) -> tuple[float, float, int, dict[str, Any], float | None]:
    """After the kill: generate (max_tokens 1) to `name` every POLL_S while it answers 503, and
    read status every STATUS_EVERY-th round, until a token was served and a poll saw `name`
    READY with a higher incarnation: (served at, seen at, generate requests, its status, the
    answered request's own time in the daemon, `total_s`)."""
    deadline = time.monotonic() + d.backend.ready_timeout_s
    served = seen = None
    new: dict[str, Any] | None = None
    attempts = rounds = 0
    total_s = None
    while served is None or seen is None:
        if served is None:
            attempts += 1
            code, body = gen.once(name)
            if code == 200:
                served, total_s = time.time(), body.get("total_s")
            elif code != 503:
                raise BenchError(f"POST /v1/generate to {name}: HTTP {code}: {body}")
        if seen is None and rounds % STATUS_EVERY == 0:
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
    assert new is not None
    d.tracker.add(new["pid"])
    return served, seen, attempts, new, total_s


def kill_once(d: Daemon, gen: Generate) -> Kill:
    """SIGKILL replica 0's engine, then generate-and-poll until it served a token and a poll saw
    it READY again."""
    name = d.watched
    old, victim = victim_of(d, name)
    servers_before = {s["pid"] for s in d.fork_servers() if s["state"] == "ready"}
    gen.once(name)  # the connection is open before the kill (and the route warm)
    t_kill = time.time()
    victim.send_signal(signal.SIGKILL)
    served, seen, attempts, new, total_s = recover(d, gen, name, old, t_kill)
    last_exit = new.get("last_exit") or {}
    servers_after = {s["pid"] for s in d.fork_servers() if s["state"] == "ready"}
    return Kill(ready_s=new["since"] - t_kill, seen_s=seen - t_kill, served_s=served - t_kill,
                detect_s=last_exit["at"] - t_kill if last_exit.get("at") else None,
                startup_s=new.get("startup_s"),
                load_s=d.child_load_s(name, new["incarnation"]),
                launcher=str(new.get("launcher")), attempts=attempts, answer_s=total_s,
                server_pid=(next(iter(servers_after)) if servers_after == servers_before
                            and len(servers_after) == 1 else None))
