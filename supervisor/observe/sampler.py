"""Resource samples for status and metrics: engine process trees (psutil) and GPUs (NVML).

Sampling reads /proc for each engine's process tree and may call into the NVIDIA driver, so it
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
from engined.supervisor.host.reaper import children_of

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
    """RSS and CPU of each pid plus all its descendants. Only those processes are read (down
    /proc/PID/task/*/children): the cost follows the engines' trees, not the host's process
    count."""
    out = {}
    for root in pids:
        tree = _sum_tree(root)
        if tree is not None:
            out[root] = tree
    return out


def _read(pid: int) -> tuple[int, float] | None:
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            cpu = proc.cpu_times()
            return proc.memory_info().rss, cpu.user + cpu.system
    except psutil.Error:
        return None


def _sum_tree(root: int) -> TreeSample | None:
    top = _read(root)
    if top is None:
        return None
    rss, cpu = top
    seen, stack = {root}, list(children_of(root))
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        got = _read(pid)
        if got is not None:
            rss, cpu = rss + got[0], cpu + got[1]
            seen.add(pid)
            stack.extend(children_of(pid))
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
