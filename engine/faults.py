"""Fault injection for tests and chaos runs: a backend that wraps the real one.

The core knows nothing of it: `engine.build` wraps the backend it built when the tests ask, that
is for `builtin:echo` always, and for any other model where the child's environment (the spec's
`env`) has ENGINED_FAULT_INJECTION=1. A request whose text prompt starts with one of these
injects its fault in the first step that runs it:

* `!stall`: the step wedges; the busy loop stops progressing, heartbeats go on (a stall);
* `!raise`: the step raises (the busy loop's crash: exit 1);
* `!grow` (with a memory_limit): the engine's resident memory grows past its limit without an
  allocation failing, as memory mapped before the limit (weights paged in) would: every page of
  a mapping as large as the limit, made before the limit was applied, is touched;
* `!wedge`: the request is answered, then once the engine is idle its busy loop stops
  (heartbeats go on), as a deadlock while idle would; a stop request still ends it.

And at build: ENGINED_FAULT_BUILD_RANK=N makes data-parallel rank N fail to build (a crash).
"""

from __future__ import annotations

import mmap
import os
import time
from typing import TYPE_CHECKING, Any, Callable

from engined.engine.backend import Admission, Backend, Emit, Load

if TYPE_CHECKING:
    from engined.engine.protocol import ChatMessage, EngineConfig, GpuMemory

ENV_ENABLE = "ENGINED_FAULT_INJECTION"
ENV_BUILD_RANK = "ENGINED_FAULT_BUILD_RANK"
FAULTS = ("!stall", "!raise", "!grow", "!wedge")
_STALL_S = 3600.0
_WEDGE_POLL_S = 0.1  # how often a wedged loop looks for a stop request


def wanted(config: EngineConfig) -> bool:
    """Whether this engine's backend gets faults: builtin:echo always, others when asked."""
    return config.model == "builtin:echo" or os.environ.get(ENV_ENABLE) == "1"


def with_faults(backend: Backend, config: EngineConfig,
                stopping: Callable[[], bool]) -> Backend:
    """`backend` with faults, if this engine gets them (`wanted`); `stopping` says whether the
    engine was asked to stop (a wedged loop still ends then)."""
    if not wanted(config):
        return backend
    if config.data_parallel and os.environ.get(ENV_BUILD_RANK) == str(config.rank):
        raise RuntimeError(f"fault injected: rank {config.rank} fails to build")
    return FaultyBackend(backend, config.memory_limit, stopping)


class FaultyBackend(Backend):
    """The wrapped backend, with the faults its requests' prompts ask for (module docstring)."""

    def __init__(self, inner: Backend, memory_limit: int | None,
                 stopping: Callable[[], bool]) -> None:
        self.inner = inner
        self.device, self.dtype, self.kind = inner.device, inner.dtype, inner.kind
        self.burst_window = inner.burst_window
        self.stopping = stopping
        self.pending: list[Admission] = []  # added with a fault, not yet stepped
        self.wedged = False  # a `!wedge` ran: the loop stops once idle
        # `!grow`'s mapping: made now, before the core applies memory_limit
        self.ballast = mmap.mmap(-1, memory_limit) if memory_limit else None

    # --- faults ------------------------------------------------------------------------------
    def add(self, request: Admission) -> None:
        self.inner.add(request)
        if request.prompt_text.startswith(FAULTS):
            self.pending.append(request)

    def has_work(self) -> bool:
        return self.inner.has_work() or self.wedged

    def pending_tokens(self) -> int:
        return self.inner.pending_tokens() or int(self.wedged)

    def step(self, emit: Emit, on_token: Callable[[], None]) -> None:
        pending, self.pending = self.pending, []
        for request in pending:
            self._inject(request)
        if self.wedged and not self.inner.has_work():
            self._wedge()
            return
        self.inner.step(emit, on_token)

    def _inject(self, request: Admission) -> None:
        prompt = request.prompt_text
        if prompt.startswith("!wedge"):
            self.wedged = True
        if prompt.startswith("!grow") and self.ballast is not None:
            for offset in range(0, len(self.ballast), mmap.PAGESIZE):
                self.ballast[offset] = 1
        if prompt.startswith("!stall"):
            while True:
                time.sleep(_STALL_S)
        if prompt.startswith("!raise"):
            raise RuntimeError(f"fault injected by request {request.id} (!raise)")

    def _wedge(self) -> None:
        """The step that never ends, no progress stamped, until the engine is asked to stop."""
        while not self.stopping():
            time.sleep(_WEDGE_POLL_S)

    # --- the rest is the wrapped backend's ---------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self.inner.tokenize(text, special)

    def vocab_pieces(self, ids: list[int]) -> list[str]:
        return self.inner.vocab_pieces(ids)

    def apply_chat_template(self, messages: list[ChatMessage]) -> list[int]:
        return self.inner.apply_chat_template(messages)

    def detokenize(self, ids: list[int]) -> str:
        return self.inner.detokenize(ids)

    def abort(self, request_id: str) -> None:
        self.inner.abort(request_id)

    def load(self) -> Load:
        return self.inner.load()

    def dummy_step(self) -> None:
        self.inner.dummy_step()

    def gpu_memory(self) -> list[GpuMemory]:
        return self.inner.gpu_memory()

    def close(self) -> dict[str, float]:
        self.ballast = None
        return self.inner.close()

    @property
    def cache_info(self) -> dict[str, float]:
        return self.inner.cache_info

    @property
    def sizing(self) -> dict[str, float]:
        return self.inner.sizing

    def open_chat(self, body: dict[str, Any]) -> Any:
        return self.inner.open_chat(body)

    def adapters(self) -> list[str]:
        return self.inner.adapters()

    def load_adapter(self, name: str, path: str) -> None:
        self.inner.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        self.inner.unload_adapter(name)

    def check_adapter(self, name: str) -> None:
        self.inner.check_adapter(name)

    def sleep(self, level: int) -> None:
        self.inner.sleep(level)

    def wake_up(self) -> None:
        self.inner.wake_up()
