"""LoRA adapters for the tests: real PEFT-format adapters of a Llama checkpoint (tiny-llama), so
that vLLM loads them exactly as it loads one trained with PEFT, without PEFT installed.

An adapter directory holds what PEFT's `save_pretrained` writes: `adapter_config.json`
(peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, target_modules, the base model) and
`adapter_model.safetensors`, whose tensors are named as PEFT names them
(`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`: [r, in];
`...lora_B.weight`: [out, r]), with shapes read from the base model's config.json.

PEFT starts B at zero (an untrained adapter changes nothing); here both A and B are random and
large (seeded), so that greedy output with the adapter differs from the base model's, and two
seeds give two adapters that answer differently. Written with numpy and safetensors (both in
the dev venv and the vLLM venv): no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS = ATTENTION
WEIGHT_STD = 0.2  # tiny-llama's own initializer_range: the update is as large as the weights


def make_tiny_llama_adapter(directory: Path, base_model_dir: Path, rank: int = 8,
                            seed: int = 0,
                            target_modules: tuple[str, ...] = DEFAULT_TARGETS) -> Path:
    """A PEFT LoRA adapter of the Llama at `base_model_dir` in `directory` (created), with
    random A and B of rank `rank` from `seed`; returns the directory."""
    import numpy as np
    from safetensors.numpy import save_file

    config = json.loads((Path(base_model_dir) / "config.json").read_text())
    shapes = module_shapes(config)
    unknown = sorted(set(target_modules) - set(shapes))
    if unknown:
        raise ValueError(f"unknown target modules {unknown} (known: {sorted(shapes)})")
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module in target_modules:
            in_features, out_features = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{_block(module)}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = _random(rng, (rank, in_features))
            tensors[f"{prefix}.lora_B.weight"] = _random(rng, (out_features, rank))
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        adapter_config(base_model_dir, rank, target_modules), indent=2))
    return out


def adapter_config(base_model_dir: Path, rank: int,
                   target_modules: tuple[str, ...]) -> dict[str, Any]:
    """What PEFT writes for a plain LoRA of a causal LM (alpha 2r: scaling 2)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(base_model_dir), "r": rank, "lora_alpha": 2 * rank,
            "target_modules": list(target_modules), "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True}


def module_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each Llama projection, from its config.json."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def _block(module: str) -> str:
    return "self_attn" if module in ATTENTION else "mlp"


def _random(rng: Any, shape: tuple[int, int]) -> Any:
    import numpy as np

    return (rng.standard_normal(shape) * WEIGHT_STD).astype(np.float32)
