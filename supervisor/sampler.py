"""Resource samples for status and metrics: engine process trees (psutil) and GPUs (NVML).

Sampling reads /proc for every process on the host and may call into the NVIDIA driver, so it
runs in a worker thread (`asyncio.to_thread`) and its result is cached briefly: a burst of scrapes
costs one sample, and the event loop (heartbeats, exits) never waits on /proc or the driver.
NVML (host/gpus.py) is optional: without a driver the GPU figures are simply absent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import psutil

from engined.supervisor.host.gpus import GpuDevice, Nvml

log = logging.getLogger("engined.sampler")

SAMPLE_TTL_S = 1.0


@dataclass(frozen=True)
class TreeSample:
    rss_bytes: int
    cpu_seconds: float
    pids: frozenset[int] = frozenset()  # the leader and every descendant

    def gpu_bytes(self, device: GpuDevice) -> int | None:
        """What the whole tree holds on `device` (a server's engine core is a grandchild)."""
        held = [device.process_bytes[p] for p in self.pids if p in device.process_bytes]
        return sum(held) if held else None


@dataclass(frozen=True)
class Sample:
    at: float
    trees: dict[int, TreeSample] = field(default_factory=dict)  # engine leader pid -> its tree
    gpus: tuple[GpuDevice, ...] = ()


def sample_trees(pids: list[int]) -> dict[int, TreeSample]:
    """RSS and CPU of each pid plus all its descendants, from one pass over /proc."""
    children: dict[int, list[int]] = {}
    stats: dict[int, TreeSample] = {}
    for proc in psutil.process_iter(["ppid", "memory_info", "cpu_times"]):
        info = proc.info
        if info["memory_info"] is None or info["cpu_times"] is None:
            continue
        children.setdefault(info["ppid"], []).append(proc.pid)
        cpu = info["cpu_times"]
        stats[proc.pid] = TreeSample(info["memory_info"].rss, cpu.user + cpu.system)
    return {pid: _sum_tree(pid, children, stats) for pid in pids if pid in stats}


def _sum_tree(root: int, children: dict[int, list[int]],
              stats: dict[int, TreeSample]) -> TreeSample:
    rss, cpu, stack, seen = 0, 0.0, [root], set()
    while stack:
        pid = stack.pop()
        if pid in stats:
            rss += stats[pid].rss_bytes
            cpu += stats[pid].cpu_seconds
            seen.add(pid)
        stack.extend(children.get(pid, ()))
    return TreeSample(rss, cpu, frozenset(seen))


class Sampler:
    def __init__(self, nvml: Nvml | None = None) -> None:
        self.nvml = nvml if nvml is not None else Nvml()
        self.last = Sample(at=0.0)
        self._inflight: asyncio.Future[Sample] | None = None

    async def sample(self, pids: list[int], max_age_s: float = SAMPLE_TTL_S) -> Sample:
        """A sample no older than max_age_s covering `pids`; concurrent callers share one."""
        if time.monotonic() - self.last.at <= max_age_s and set(pids) <= set(self.last.trees):
            return self.last
        if self._inflight is None:
            self._inflight = asyncio.ensure_future(asyncio.to_thread(self._take, pids))
        try:
            self.last = await asyncio.shield(self._inflight)
        finally:
            self._inflight = None
        return self.last

    def _take(self, pids: list[int]) -> Sample:
        try:
            trees = sample_trees(pids)
        except OSError as exc:  # no descriptor to read /proc with (EMFILE): report without
            log.warning("[sample] cannot read process trees: %s", exc)
            trees = {}
        return Sample(time.monotonic(), trees, self.nvml.devices())
