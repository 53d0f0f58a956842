"""Section 2, measured: RSS, USS and PSS (psutil `memory_full_info`) of every engine and of the
fork server, after each replica has served a request: forked engines share the preloaded stack
with the server and with each other copy-on-write.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from bench.common import BenchError
from bench.recovery.daemon import MB, REPLICAS, Daemon, Generate


@dataclass
class Mem:
    rss: float
    uss: float
    pss: float
    procs: int = 1  # the process and its descendants


def memory_of(pid: int) -> Mem | None:
    """RSS/USS/PSS (MB) of `pid` and its descendants (vLLM's backend has none: it runs LLMEngine
    in-process), None if it is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    total = Mem(0.0, 0.0, 0.0, 0)
    for p in procs:
        try:
            info = p.memory_full_info()
        except psutil.NoSuchProcess:
            continue
        total.rss += info.rss / MB
        total.uss += info.uss / MB
        total.pss += info.pss / MB
        total.procs += 1
    return total


@dataclass
class Memory:
    engines: dict[str, Mem] = field(default_factory=dict)
    servers: list[tuple[dict[str, Any], Mem]] = field(default_factory=list)


def measure_memory(d: Daemon, gen: Generate) -> Memory:
    """After each replica served one request (max_tokens 8) and a 1 s pause."""
    names = [f"{d.backend.group}-{i}" for i in range(REPLICAS)]
    for name in names:
        d.wait_ready(1, name=name)
        code, body = gen.once(name, max_tokens=8)
        if code != 200:
            raise BenchError(f"POST /v1/generate to {name}: HTTP {code}: {body}")
    time.sleep(1.0)
    status = d.status()
    out = Memory()
    for e in status["engines"]:
        m = memory_of(e["pid"]) if e.get("pid") else None
        if m is not None:
            out.engines[e["name"]] = m
    for s in d.fork_servers(status):
        m = memory_of(s["pid"]) if s.get("pid") and s["state"] == "ready" else None
        if m is not None:
            out.servers.append((s, m))
    return out
