"""The engine child as a process, apart from its engine: tied to the daemon's life, its file
limit restored, its stop signals turned into a flag, and CUDA released in its `finally`."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any

from engined.engine import contract

_PR_SET_PDEATHSIG = 1


class StopFlag:
    """Set by SIGTERM/SIGINT; the handler does nothing else (the busy loop drains and exits)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def handler(self, signum: int, _frame: Any) -> None:
        self.signum = signum

    @property
    def set(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self.handler)
        signal.signal(signal.SIGINT, self.handler)


def restore_nofile() -> None:
    """engined raised its own soft RLIMIT_NOFILE; an engine gets the limit engined started with."""
    wanted = os.environ.get(contract.ENV_NOFILE)
    if not wanted:
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if int(wanted) < soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (int(wanted), hard))
    except (ValueError, OSError):
        pass  # keep the raised one: more descriptors never hurt an engine


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when the daemon dies, then close the race where it already has.

    PR_SET_PDEATHSIG is tied to the daemon's thread that spawned us; engined spawns from its
    event-loop thread, which lives as long as the daemon does.
    """
    if contract.outlives_daemon():
        return  # the daemon's guard ends us if no engined adopts us in time
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    parent = os.environ.get(contract.ENV_PARENT_PID)
    if parent is not None and os.getppid() != int(parent):
        os._exit(1)  # the daemon died before the prctl took effect


def drain_fd(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def release_cuda() -> dict[str, float]:
    """Release CUDA only if torch was imported and CUDA initialised; never import torch here."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return {}
    before_alloc = torch.cuda.memory_allocated()
    before_reserved = torch.cuda.memory_reserved()
    torch.cuda.synchronize()
    # cuBLAS keeps a workspace per handle and stream in torch's allocator (32 MiB on Hopper)
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()
    torch.cuda.ipc_collect()
    return {"cuda_allocated_before_bytes": float(before_alloc),
            "cuda_reserved_before_bytes": float(before_reserved),
            "cuda_allocated_after_bytes": float(torch.cuda.memory_allocated()),
            "cuda_reserved_after_bytes": float(torch.cuda.memory_reserved())}
