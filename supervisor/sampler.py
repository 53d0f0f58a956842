"""Resource samples for status and metrics: engine process trees (psutil) and GPUs (NVML).

Sampling reads /proc for every process on the host and may call into the NVIDIA driver, so it
runs in a worker thread (`asyncio.to_thread`) and its result is cached briefly: a burst of scrapes
costs one sample, and the event loop (heartbeats, exits) never waits on /proc or the driver.
NVML is optional: without a driver (NVMLError_LibraryNotFound) the GPU figures are simply absent.
NVML never creates a CUDA context, so the daemon stays CUDA-free.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

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
class GpuDevice:
    index: int
    uuid: str
    used_bytes: int
    total_bytes: int
    process_bytes: dict[int, int]  # pid -> bytes used by that process on this device


@dataclass(frozen=True)
class Sample:
    at: float
    trees: dict[int, TreeSample] = field(default_factory=dict)  # engine leader pid -> its tree
    gpus: tuple[GpuDevice, ...] = ()


class Nvml:
    """A thin, failure-tolerant view of NVML (nvidia-ml-py)."""

    def __init__(self) -> None:
        self.available = False
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self.available = pynvml, True
        except Exception as exc:  # noqa: BLE001 - no library, no driver, no GPU: all "absent"
            log.info("[gpu] NVML unavailable (%s): GPU device metrics are off",
                     type(exc).__name__)

    def devices(self) -> tuple[GpuDevice, ...]:
        if not self.available:
            return ()
        nvml = self._nvml
        try:
            return tuple(self._device(nvml, i) for i in range(nvml.nvmlDeviceGetCount()))
        except nvml.NVMLError as exc:
            log.warning("[gpu] NVML query failed: %s", exc)
            return ()

    @staticmethod
    def _device(nvml: Any, index: int) -> GpuDevice:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        uuid = nvml.nvmlDeviceGetUUID(handle)
        per_pid: dict[int, int] = {}
        for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            used = proc.usedGpuMemory
            if used is not None:
                per_pid[proc.pid] = per_pid.get(proc.pid, 0) + int(used)
        return GpuDevice(index, uuid if isinstance(uuid, str) else uuid.decode(),
                         int(memory.used), int(memory.total), per_pid)


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


GPU_RELEASE_WAIT_S = 10.0
GPU_RELEASE_POLL_S = 0.1


async def wait_gpu_released(nvml: Nvml, name: str, pids: set[int], gpus: tuple[int, ...],
                            timeout_s: float = GPU_RELEASE_WAIT_S,
                            poll_s: float = GPU_RELEASE_POLL_S) -> float | None:
    """Until no pid of `pids` holds memory on `gpus` (NVML), at most `timeout_s`; returns the
    seconds waited, or None without NVML. A respawn right after an exit races the driver freeing
    the dead incarnation's memory: the new engine would then fail to allocate."""
    if not nvml.available or not gpus or not pids:
        return None
    loop = asyncio.get_running_loop()
    began = loop.time()
    logged = False
    while True:
        devices = await asyncio.to_thread(nvml.devices)
        held = {d.index: sorted(p for p in pids if d.process_bytes.get(p))
                for d in devices if d.index in gpus}
        held = {gpu: who for gpu, who in held.items() if who}
        waited = loop.time() - began
        if not held:
            if logged:
                log.info("[gpu] %s: GPU memory of the last incarnation released after %.2fs",
                         name, waited)
            return waited
        if waited >= timeout_s:
            log.warning("[gpu] %s: GPU(s) %s still held by %s after %.0fs: spawning anyway",
                        name, sorted(held), sorted({p for v in held.values() for p in v}),
                        waited)
            return waited
        if not logged:
            log.info("[gpu] %s: waiting for GPU(s) %s to release the memory of pid(s) %s",
                     name, sorted(held), sorted({p for v in held.values() for p in v}))
            logged = True
        await asyncio.sleep(poll_s)


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
