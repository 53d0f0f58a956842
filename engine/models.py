"""Models an engine core can run, built lazily inside the child.

`builtin:echo` is the light engine: same lifecycle, heartbeats and request loop as a real one, no
torch. It echoes the prompt back one character-token at a time. Fault switches for tests and
chaos runs come from the child's environment (set through the spec's `env`):

* ENGINED_ECHO_LOAD_S=SECONDS  — take this long to "load" (reported as progress phases)
* ENGINED_ECHO_FAIL=build      — the build raises (a crash: exit 1, restarted with backoff)
* ENGINED_ECHO_FAIL=config     — the build reports an invalid config (exit 78, FAILED at once)
* ENGINED_ECHO_TOKEN_MS=MS     — time per generated token
* ENGINED_ECHO_CLOSE_S=SECONDS — take this long to free the "model" in the child's cleanup
* ENGINED_ECHO_SPAWN=child,setsid — start sleeping descendants at build and never stop them
  (`setsid`: one that leaves the engine's process group), as engines with workers do
* prompts `!stall` and `!raise` inject faults (see engine.core._inject_faults); for other models
  set ENGINED_FAULT_INJECTION=1 to enable them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from engined.engine.protocol import EngineConfig, GenerateRequest, GpuMemory

ProgressFn = Callable[[str, str], None]


class EngineConfigError(Exception):
    """The engine's own config or model is invalid: exit 78, do not restart."""


@dataclass(frozen=True)
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int


class Model(Protocol):
    device: str
    dtype: str

    def generate(self, batch: list[GenerateRequest],
                 on_token: Callable[[], None] = ...) -> list[Completion]:
        """Run one batch; call `on_token` after each generated token (busy-loop progress)."""

    def gpu_memory(self) -> list[GpuMemory]: ...

    def close(self) -> dict[str, float]: ...


def build_model(config: EngineConfig, progress: ProgressFn) -> Model:
    """Dispatch on the model source; heavy imports happen only in the branch that needs them."""
    if config.model == "builtin:echo":
        return EchoModel.build(progress)
    if config.model.startswith("builtin:") and config.model != "builtin:tiny-llama":
        raise EngineConfigError(f"unknown builtin model {config.model!r}")
    from engined.engine.llm import (
        build_hf_model,  # torch and transformers load here, in the child only
    )

    return build_hf_model(config, progress)


class EchoModel:
    device = "cpu"
    dtype = "none"

    def __init__(self, token_s: float) -> None:
        self.token_s = token_s

    @classmethod
    def build(cls, progress: ProgressFn) -> EchoModel:
        fail = os.environ.get("ENGINED_ECHO_FAIL", "")
        load_s = float(os.environ.get("ENGINED_ECHO_LOAD_S", "0"))
        progress("weights", "echo")
        if load_s > 0:
            _sleep_in_steps(load_s, progress)
        if fail == "build":
            raise RuntimeError("echo build failed (ENGINED_ECHO_FAIL=build)")
        if fail == "config":
            raise EngineConfigError("echo config rejected (ENGINED_ECHO_FAIL=config)")
        _spawn_descendants(os.environ.get("ENGINED_ECHO_SPAWN", ""))
        progress("warmup", "")
        return cls(float(os.environ.get("ENGINED_ECHO_TOKEN_MS", "0")) / 1000.0)

    def generate(self, batch: list[GenerateRequest],
                 on_token: Callable[[], None] = lambda: None) -> list[Completion]:
        longest = max(min(req.max_tokens, len(req.prompt)) for req in batch)
        for _ in range(longest if self.token_s else 0):
            time.sleep(self.token_s)
            on_token()
        return [Completion(req.prompt[: req.max_tokens], len(req.prompt),
                           min(req.max_tokens, len(req.prompt))) for req in batch]

    def gpu_memory(self) -> list[GpuMemory]:
        return []

    def close(self) -> dict[str, float]:
        time.sleep(float(os.environ.get("ENGINED_ECHO_CLOSE_S", "0")))
        return {"model_freed": 1.0}


def _spawn_descendants(kinds: str) -> None:
    """Sleeping processes the engine starts and never stops (for the no-leftovers tests)."""
    import subprocess
    import sys

    started = []
    for kind in filter(None, (k.strip() for k in kinds.split(","))):
        if kind not in ("child", "setsid"):
            raise EngineConfigError(f"ENGINED_ECHO_SPAWN: unknown kind {kind!r}")
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                                start_new_session=kind == "setsid", stdin=subprocess.DEVNULL)
        started.append(f"{proc.pid} ({kind})")
    if started:
        print(f"[echo] started descendants: {', '.join(started)}", file=sys.stderr, flush=True)


def _sleep_in_steps(total_s: float, progress: ProgressFn) -> None:
    """Load slowly but stay responsive to SIGTERM (progress raises StopRequested)."""
    deadline = time.monotonic() + total_s
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))
        progress("weights", f"{max(left, 0):.2f}s left")
