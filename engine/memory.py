"""Memory that adapts, inside the engine child: a step that fails for memory shrinks the batch
instead of killing the engine, and `memory_limit` bounds what the engine may hold.

* `is_oom`: torch's OutOfMemoryError on a GPU; on a CPU the allocator's "can't allocate memory"
  RuntimeError, or Python's MemoryError.
* `BatchLimit`: the most sequences a step may take. An out-of-memory step of N sequences sets
  it to N // 2 and keeps it under N (the size that failed); each step that succeeds grows it by
  one, up to that ceiling; after REGROW_AFTER_S without another failure the ceiling is lifted
  (the burst that failed may be gone), so the limit comes back to the spec's max_batch_size.
* `apply_memory_limit`: on a CPU the limit is enforced after the stack and the model are loaded,
  by RLIMIT_AS: the address space now plus the headroom the limit leaves over the resident
  memory now. An allocation beyond it fails in the engine (an exception it catches), never in
  the kernel's OOM killer. glibc's mmap threshold is fixed then, so that a large block freed
  gives its address space back (a dynamic threshold moves large blocks into the heap, whose
  freed middle stays mapped: a limit on address space would then count memory nobody holds).
  For the same reason the engine's own threads start before it (engine.heartbeat): a thread
  started after it took its stack (8 MiB) and, where the headroom had room, its malloc arena
  (64 MiB reserved) from the headroom, nearly none of either ever resident.
  On a GPU it is torch's per-process memory fraction of the device.
* A request that runs out of memory alone is tried once more alone, once what the failed step
  held is released (what a larger failed step left behind can be what it met); a second
  failure alone is its own: it fails with `too_large`'s error and the engine serves on.
* `Trimmer`: freed heap memory goes back to the kernel when a burst ends and while idle.
"""

from __future__ import annotations

import ctypes
import os
import resource
import time
from typing import Any

# oneDNN (torch's CPU kernels, vLLM's CPU attention) says "could not create a primitive" when
# it cannot allocate a kernel's scratch memory
OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory",
               "could not create a primitive")
REGROW_AFTER_S = 30.0
MiB = 1 << 20
# glibc's mallopt parameters, and the threshold over which a block is mapped on its own
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 128 * 1024
ALONE_TRIES = 2
# What a vLLM engine keeps free under its limit once its KV cache is sized (activations of a
# step, allocator slack): the larger of this and RESERVE_FRACTION of the limit, unless
# ENGINE_MEMORY_RESERVE (bytes) says otherwise.
RESERVE_MIN = 64 * MiB
RESERVE_FRACTION = 0.1
TRIM_IDLE_S = 60.0  # an idle engine trims its heap this often (Trimmer)


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    if type(exc).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError (CUDA)
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in OOM_MARKERS)


class BatchLimit:
    """The most sequences one step may take, lowered by out-of-memory steps and grown back."""

    def __init__(self, maximum: int, clock: Any = time.monotonic) -> None:
        self.maximum = maximum
        self.limit = maximum
        self.ceiling = maximum
        self.oom_total = 0
        self.last_oom: float | None = None
        self.clock = clock

    def failed(self, size: int) -> None:
        """A step of `size` sequences ran out of memory."""
        self.oom_total += 1
        self.last_oom = self.clock()
        self.ceiling = max(1, size - 1)
        self.limit = max(1, min(self.limit, size) // 2)

    def succeeded(self) -> None:
        if self.last_oom is not None and self.clock() - self.last_oom >= REGROW_AFTER_S:
            self.ceiling, self.last_oom = self.maximum, None
        self.limit = min(self.ceiling, self.limit + 1)


def reserve(limit: int) -> int:
    """Bytes of a limit kept out of a preallocated KV cache for everything else a step takes."""
    import os

    explicit = os.environ.get("ENGINE_MEMORY_RESERVE", "")
    if explicit.strip():
        return max(0, int(explicit))
    return max(RESERVE_MIN, int(limit * RESERVE_FRACTION))


def too_large(prompt_tokens: int, max_tokens: int) -> str:
    """The error for a request that ran out of memory alone: its own fault, said so."""
    return (f"out of memory: this request does not fit in the engine's memory even alone "
            f"(prompt {prompt_tokens} tokens, max_tokens {max_tokens}): shorten the prompt or "
            f"lower max_tokens")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


class MemoryLimitError(Exception):
    """The limit is below what the loaded engine already holds (a configuration error)."""


def apply_memory_limit(limit: int, device: str, torch: Any = None) -> dict[str, float]:
    """Bound the engine's memory by `limit` bytes from now on; what was set, for its log."""
    if device.startswith("cuda") and torch is not None:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        reserved = int(torch.cuda.memory_reserved())
        if reserved >= limit:
            raise MemoryLimitError(f"memory_limit ({limit} bytes) is below what the engine "
                                   f"holds once loaded ({reserved} bytes of GPU memory "
                                   f"reserved): raise it")
        fraction = min(1.0, limit / total)
        torch.cuda.set_per_process_memory_fraction(fraction)
        return {"memory_limit_bytes": float(limit), "reserved_at_limit_bytes": float(reserved),
                "memory_fraction": fraction}
    rss, vm = rss_bytes(), _status_kib("VmSize") * 1024
    headroom = limit - rss
    if headroom <= 0:
        raise MemoryLimitError(f"memory_limit ({limit} bytes) is below what the engine holds "
                               f"once loaded ({rss} bytes resident): raise it")
    _fix_malloc()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = vm + headroom
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return {"memory_limit_bytes": float(limit), "resident_at_limit_bytes": float(rss),
            "address_space_limit_bytes": float(soft)}


def held_bytes(device: str, torch: Any = None) -> int:
    """What the engine holds against its limit: device memory reserved by torch on a GPU,
    resident memory on a CPU."""
    if device.startswith("cuda") and torch is not None and torch.cuda.is_initialized():
        return int(torch.cuda.memory_reserved())
    return rss_bytes()


def headroom(limit: int | None, device: str = "cpu", torch: Any = None) -> int | None:
    """Bytes the engine may still take under its limit, negative when it holds more than the
    limit (the daemon restarts it for `memory` then); None: no limit."""
    return None if limit is None else limit - held_bytes(device, torch)


def _fix_malloc() -> None:
    """Large blocks mapped on their own from now on, and the heap's top trimmed eagerly: freed
    memory leaves the address space (the limit's measure) instead of staying in the heap."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):
        pass  # not glibc: its allocator keeps its own policy


def trim() -> bool:
    """Give freed heap memory back to the kernel (glibc's malloc_trim(0))."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


class Trimmer:
    """Gives freed heap memory back to the kernel (`trim`: glibc's malloc_trim) when a burst
    ends and every TRIM_IDLE_S while idle: a long-running engine's RSS otherwise keeps the
    high-water mark of its largest burst. ENGINE_MALLOC_TRIM=0 turns it off (the benchmark's
    comparison)."""

    def __init__(self) -> None:
        self.enabled = os.environ.get("ENGINE_MALLOC_TRIM", "1") != "0"
        self.last = time.monotonic()

    def after(self, burst_ended: bool, idle: bool, now: float) -> None:
        if self.enabled and (burst_ended or idle and now - self.last >= TRIM_IDLE_S):
            trim()
            self.last = now
