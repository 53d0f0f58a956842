"""vLLM's KV cache under `memory_limit` (engine.memory): the budget vLLM's own sizing is given,
the configuration error when the limit leaves no room for it, and what vLLM allocated (READY's
memory and cache figures).

Imported only inside a vLLM engine's child; vLLM is imported where used.
"""

from __future__ import annotations

import os
from typing import Any

from engined.engine import memory
from engined.engine.backend import EngineConfigError


def memory_kwargs(limit: int, device: str, torch: Any) -> dict[str, Any]:
    """The KV budget from `memory_limit`, through vLLM's own sizing: its memory utilisation
    (on a CPU, of the NUMA node's memory; on a GPU, of the device's) is the limit less a
    reserve (engine.memory.reserve) over the total, and vLLM gives its KV cache whatever of
    that the engine does not hold after loading and profiling the model."""
    env = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if env.strip():  # vLLM's legacy setting overrides any other sizing
        raise EngineConfigError(f"env VLLM_CPU_KVCACHE_SPACE={env} sizes vLLM's KV cache, and so "
                                f"does memory_limit: set one of them")
    if device.startswith("cuda"):
        total = int(torch.cuda.mem_get_info()[1])
    else:
        from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

        total = int(get_memory_node_info(get_allowed_cpu_list()[0].numa_node).total_memory)
    budget = limit - memory.reserve(limit)
    held = memory.held_bytes(device, torch)
    if budget <= held:
        raise EngineConfigError(
            f"memory_limit ({limit} bytes) leaves no room for a KV cache: less its reserve "
            f"({limit - budget} bytes) it is {budget} bytes, and the engine holds {held} before "
            f"its model is even loaded: raise it")
    return {"gpu_memory_utilization": round(budget / total, 6)}


def kv_does_not_fit(limit: int | None, exc: ValueError) -> None:
    """vLLM could not size a KV cache under memory_limit: a configuration error (exit 78), not a
    crash to restart, when the limit is the cause (the engine holds it all already, or one
    sequence of max_model_len does not fit)."""
    if limit is None:
        return
    text = " ".join(str(exc).split())
    held = memory.rss_bytes()
    if held >= limit - memory.reserve(limit) or "max seq len" in text or "KV cache" in text:
        raise EngineConfigError(f"memory_limit ({limit} bytes; the engine holds {held} after "
                                f"loading its model) is too small for vLLM's KV cache: {text}"
                                ) from None


def kv_sizing(engine: Any, scheduler: Any) -> dict[str, float]:
    """How vLLM sized its KV cache: its memory utilisation and the cache it allocated."""
    out = {"gpu_memory_utilization":
           float(engine.vllm_config.cache_config.gpu_memory_utilization)}
    try:
        tensors = scheduler.kv_cache_config.kv_cache_tensors
        out["kv_cache_bytes"] = float(sum(int(t.size) for t in tensors))
    except AttributeError:
        pass
    return out


def cache_info(engine: Any) -> dict[str, float]:
    """Its KV cache's blocks, as vLLM's own vllm:cache_config_info says them."""
    cache = engine.vllm_config.cache_config
    return {k: float(v) for k in ("block_size", "num_gpu_blocks")
            if isinstance(v := getattr(cache, k, None), int) and not isinstance(v, bool)}
