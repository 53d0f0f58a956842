"""LoRA adapters in a vLLM engine (engine.adapters says what an adapter is): the engine arguments
that enable them, and the adapters as vLLM's LoRARequests, loaded and removed through LLMEngine's
add_lora / remove_lora.

vLLM runs at most max_loras adapters in one batch and keeps max_cpu_loras in memory (an LRU
cache); a request carries its adapter's LoRARequest, path included, so one vLLM evicted is read
again when a request needs it. Which adapters are loaded is ours (`Adapters`): a name unloaded is
refused from then on, whatever vLLM still holds; a request admitted before keeps the adapter it
was admitted with.

Imported only inside a vLLM engine's child; vLLM itself is imported when `VllmAdapters` is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engined.engine.adapters import Adapters, check_config_adapters
from engined.engine.backend import EngineConfigError, RequestRejected

if TYPE_CHECKING:
    from engined.engine.protocol import EngineConfig

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM's LoRAConfig takes
DEFAULT_LORA_RANK = 16  # room for adapters loaded at run time, of the usual ranks
MIN_LORA_SLOTS = 4  # adapters in one batch, at least (at most max_batch_size)


def lora_kwargs(config: EngineConfig) -> dict[str, Any]:
    """EngineArgs keywords for LoRA, where the config has adapters or engine_args.enable_lora:
    enable_lora; max_loras (adapters in one batch) for every config adapter, at least
    MIN_LORA_SLOTS, at most max_batch_size; max_cpu_loras to keep each config adapter in memory;
    the smallest max_lora_rank vLLM takes that fits them and DEFAULT_LORA_RANK. What engine_args
    sets itself wins (vLLM checks it: exit 78)."""
    args = config.engine_args
    wanted = args.get("enable_lora")
    if not config.adapters and not wanted:
        return {}
    if wanted is False:
        raise EngineConfigError("adapters need LoRA, but engine_args.enable_lora is false")
    count = len(config.adapters)
    ranks = [adapter.rank for adapter in check_config_adapters(config.adapters)]
    slots = int(args.get("max_loras") or min(max(MIN_LORA_SLOTS, count), config.max_batch_size))
    return {"enable_lora": True, "max_loras": slots,
            "max_lora_rank": args.get("max_lora_rank") or lora_rank(max(ranks, default=0)),
            "max_cpu_loras": args.get("max_cpu_loras") or max(slots, count)}


def lora_rank(needed: int) -> int:
    """The smallest max_lora_rank vLLM takes for adapters of rank `needed` (and the default)."""
    want = max(needed, DEFAULT_LORA_RANK)
    return next((rank for rank in MAX_LORA_RANKS if rank >= want), want)


class VllmAdapters:
    """The adapters of one vLLM engine as LoRARequests (its id: the adapter's slot, unique in
    the process, so a name loaded again from elsewhere never meets the old weights in vLLM's
    cache). Holds no reference to the engine: each call gets it."""

    def __init__(self, lora_config: Any) -> None:
        from vllm.lora.request import LoRARequest

        self.lora_request = LoRARequest
        self.config = lora_config  # vLLM's LoRAConfig; None: built without LoRA
        self.loaded = Adapters()
        self.requests: dict[str, Any] = {}
        self.rejections = _rejection_types()

    def names(self) -> list[str]:
        return self.loaded.names()

    def request(self, name: str | None) -> Any:
        """The LoRARequest a request with adapter `name` gives vLLM (None: the base model)."""
        if name is None:
            return None
        self.loaded.get(name)  # RequestRejected naming it, if it is not loaded
        return self.requests[name]

    def load(self, engine: Any, name: str, path: str) -> None:
        if self.config is None:
            raise RequestRejected(f"adapter {name!r}: this vLLM engine was built without LoRA "
                                  f"(give it adapters in its spec, or engine_args.enable_lora: "
                                  f"true)")
        adapter = self.loaded.prepare(name, path)
        if adapter is None:
            return  # loaded from there already
        limit = int(self.config.max_lora_rank)
        if adapter.rank > limit:
            raise RequestRejected(f"adapter {name!r} ({adapter.path}) has rank {adapter.rank}, "
                                  f"more than this engine's max_lora_rank {limit} (set "
                                  f"engine_args.max_lora_rank)")
        request = self.lora_request(name, adapter.slot, adapter.path)
        try:
            added = engine.add_lora(request)
        except Exception as exc:  # noqa: BLE001 - re-raised, or a rejection naming it
            # vLLM may have cached it before it failed to activate it (weights of another
            # shape): nothing of it stays
            engine.remove_lora(adapter.slot)
            if isinstance(exc, self.rejections):
                raise RequestRejected(f"adapter {name!r} ({adapter.path}): vLLM cannot load "
                                      f"it: {' '.join(str(exc).split()) or type(exc).__name__}"
                                      ) from None
            raise
        if not added:
            raise RuntimeError(f"vLLM did not load adapter {name!r} ({adapter.path})")
        self.loaded.add(adapter)
        self.requests[name] = request

    def unload(self, engine: Any, name: str) -> None:
        adapter = self.loaded.remove(name)
        del self.requests[name]
        engine.remove_lora(adapter.slot)  # False: vLLM had evicted it already


def _rejection_types() -> tuple[type[BaseException], ...]:
    """What vLLM raises for an adapter it cannot load: not found (a client error), a config or
    weights that do not fit the model or the engine (ValueError), weights that are not
    safetensors. (Weights of another model's shapes fail as torch's RuntimeError, which an
    out-of-memory error is too: not a rejection, an error that names the adapter.)"""
    from safetensors import SafetensorError

    plain: tuple[type[BaseException], ...] = (ValueError, TypeError, KeyError, FileNotFoundError,
                                              SafetensorError)
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # older vLLM: plain errors
        return plain
    return (VLLMClientError, *plain)
