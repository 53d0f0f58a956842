"""Which backend an engine gets, built lazily inside the child: the one module that knows every
backend (engine/backend.py says what a backend is), and the one that wraps it in the tests' fault
injection where they ask for it (engine/faults.py). Heavy imports happen only in the branch that
needs them: echo imports nothing, transformers imports torch, vllm imports vLLM."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from engined.engine.backend import Backend, EngineConfigError, ProgressFn
from engined.engine.echo import EchoBackend
from engined.engine.faults import with_faults

if TYPE_CHECKING:
    from engined.engine.protocol import EngineConfig

BACKENDS = ("transformers", "vllm")


def build_backend(config: EngineConfig, progress: ProgressFn,
                  stopping: Callable[[], bool]) -> Backend:
    """The engine's backend, with the tests' faults where they are asked for (`stopping`: the
    engine was asked to stop, which ends even a wedged loop)."""
    return with_faults(_build(config, progress), config, stopping)


def _build(config: EngineConfig, progress: ProgressFn) -> Backend:
    """Dispatch on the model source and the backend; heavy imports happen only in the branch
    that needs them."""
    if config.model == "builtin:echo":
        return EchoBackend.build(progress)
    if config.model.startswith("builtin:") and config.model != "builtin:tiny-llama":
        raise EngineConfigError(f"unknown builtin model {config.model!r}")
    if config.backend == "vllm":
        from engined.engine.vllm_backend import build_vllm_backend

        return build_vllm_backend(config, progress)
    if config.backend != "transformers":
        raise EngineConfigError(f"unknown backend {config.backend!r} (known: "
                                f"{', '.join(BACKENDS)})")
    # torch and transformers load here only
    from engined.engine.transformers_backend import build_hf_backend

    return build_hf_backend(config, progress)
