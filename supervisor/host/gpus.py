"""GPUs as NVML sees them (nvidia-ml-py): per-device and per-process memory, and the wait for a
dead incarnation's memory to be freed before its replacement spawns.

NVML is optional: without a driver (NVMLError_LibraryNotFound) every figure is simply absent.
NVML never creates a CUDA context, so the daemon stays CUDA-free.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("engined.gpu")


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str
    used_bytes: int
    total_bytes: int
    process_bytes: dict[int, int]  # pid -> bytes used by that process on this device


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


def visible_gpus() -> tuple[tuple[int, ...], str]:
    """The GPUs this process may hand out (`gpus: auto`), as the indices `gpus` takes (NVML's,
    in PCI bus order), and where they were read:

    * CUDA_VISIBLE_DEVICES in engined's own environment, when set: its indices up to the first
      entry that is not one (CUDA's own rule), or its GPU UUIDs mapped to indices by NVML;
    * else every device NVML enumerates (in a container, what the device plugin made visible);
    * else the /dev/nvidiaN device files (a driver NVML could not be loaded for);
    * else none: the engines run on the CPU."""
    import os
    import re

    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    nvml = None
    if env is not None:
        items = [item.strip() for item in env.split(",") if item.strip()]
        if not any(item.startswith(("GPU-", "MIG-")) for item in items):
            indices: list[int] = []
            for item in items:
                if not item.isdigit():
                    break
                indices.append(int(item))
            return tuple(indices), "CUDA_VISIBLE_DEVICES"
        nvml = Nvml()
        by_uuid = {d.uuid: d.index for d in nvml.devices()}
        return (tuple(by_uuid[item] for item in items if item in by_uuid),
                "CUDA_VISIBLE_DEVICES (UUIDs, through NVML)")
    nvml = Nvml()
    if nvml.available:
        return tuple(d.index for d in nvml.devices()), "NVML"
    try:
        files = [n for n in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", n)]
    except OSError:
        files = []
    return tuple(range(len(files))), "/dev/nvidia*"
