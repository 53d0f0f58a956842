"""Which backend an engine gets, built lazily inside the child: the one module that knows every
backend (engine/backend.py says what a backend is), and the one that wraps it in the tests' fault
injection where they ask for it (engine/faults.py). The config's LoRA adapters are checked before
anything is built and loaded once it is, before READY (engine/adapters.py). Heavy imports happen
only in the branch that needs them: echo imports nothing, transformers imports torch, vllm imports
vLLM."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from engined.engine.adapters import check_config_adapters, load_config_adapters
from engined.engine.backend import Backend, EngineConfigError, ProgressFn, no_adapters
from engined.engine.echo import EchoBackend
from engined.engine.faults import with_faults

if TYPE_CHECKING:
    from engined.engine.protocol import EngineConfig

BACKENDS = ("transformers", "vllm")


def build_backend(config: EngineConfig, progress: ProgressFn,
                  stopping: Callable[[], bool]) -> Backend:
    """The engine's backend, with the tests' faults where they are asked for (`stopping`: the
    engine was asked to stop, which ends even a wedged loop)."""
    _check_adapters(config)
    backend = _build(config, progress)
    load_config_adapters(backend, config.adapters, progress)
    return with_faults(backend, config, stopping)


def _check_adapters(config: EngineConfig) -> None:
    """The config's adapters, before a model is loaded: a backend that has none, or a
    directory that is no adapter, is a configuration error (exit 78) now, not after the load."""
    if not config.adapters:
        return
    if config.model != "builtin:echo" and config.backend != "vllm":
        names = ", ".join(repr(name) for name in sorted(config.adapters))
        raise EngineConfigError(f"cannot load adapter{'s' if len(config.adapters) > 1 else ''} "
                                f"{names}: {no_adapters(config.backend)}")
    check_config_adapters(config.adapters)


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
