"""Local checkpoints: the `builtin:tiny-llama` recipe and the checks every loader runs first.

`builtin:tiny-llama` is a small random-weight Llama with a byte-level tokenizer and a chat template,
built once (seeded, so every replica and every run gets the same weights) with `save_pretrained`
into a cache directory, and from then on loaded through the same `from_pretrained` path as a real
checkpoint (transformers and vLLM alike). Its head_dim is 64 (hidden 256, 4 heads): vLLM's CPU
attention loads it too. No hub access, ever: every load is from a local directory.

torch, tokenizers and transformers are imported only while a recipe is being built.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from engined.engine.backend import EngineConfigError, ProgressFn

TINY_LLAMA_VERSION = "v2"  # bump when the recipe below changes: a new cache directory is built
# head_dim 64 (vLLM's CPU attention needs 32, 64, 80 or more); chat template for the chat path
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
                      "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
_SPECIALS = ("<pad>", "<s>", "</s>")


def cache_root() -> Path:
    explicit = os.environ.get("ENGINED_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "engined"


def tiny_llama_dir(progress: ProgressFn) -> Path:
    """The tiny model's checkpoint directory, built on first use (atomically: replicas race)."""
    return recipe_dir(f"tiny-llama-{TINY_LLAMA_VERSION}", TINY_LLAMA_DIMS, progress)


def recipe_dir(name: str, dims: dict[str, Any], progress: ProgressFn) -> Path:
    """`name` in the cache: the recipe at `dims`, built on first use, atomically (replicas
    race, and a build cut short must not look finished)."""
    target = cache_root() / name
    if (target / "config.json").exists():
        return target
    progress("build", f"creating the {name} checkpoint in {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        save_llama_recipe(staging, dims)
        os.rename(staging, target)  # atomic; fails if another replica won the race
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# tiny-llama's shape; bench.vllm builds a heavier model from the same recipe (its section 1c)
TINY_LLAMA_DIMS: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 512,
                                   "num_hidden_layers": 2, "num_attention_heads": 4,
                                   "num_key_value_heads": 2}


def save_llama_recipe(directory: Path, dims: dict[str, Any]) -> None:
    """The recipe: a byte-level tokenizer, random weights of a Llama of `dims`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(_SPECIALS)}
    vocab.update({ch: len(_SPECIALS) + i for i, ch in enumerate(sorted(alphabet))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                        bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    config = LlamaConfig(vocab_size=len(vocab), **dims,
                         max_position_embeddings=2048, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False,
                         initializer_range=0.2)  # wide enough that greedy output varies
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    # Random weights, readable output: only lowercase letters, space and a little punctuation
    # keep output-projection rows, so greedy decoding emits text rather than raw bytes.
    readable = {tokenizer.convert_tokens_to_ids(t) for ch in "abcdefghijklmnopqrstuvwxyz .,"
                for t in tokenizer.tokenize(ch)}
    with torch.no_grad():
        for token_id in range(len(vocab)):
            if token_id not in readable:
                model.lm_head.weight[token_id].zero_()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


# A checkpoint directory needs one of each (the files Hugging Face loaders look for).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "tokenizer.tiktoken")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_checkpoint(path: Path) -> None:
    """A directory a loader can use: config.json, tokenizer files and weights."""
    config_file = path / "config.json"
    if not path.is_dir():
        raise EngineConfigError(f"model directory {path} does not exist")
    if not config_file.is_file():
        raise EngineConfigError(f"model directory {path} has no config.json")
    try:
        json.loads(config_file.read_text("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineConfigError(f"corrupt {config_file}: {exc}") from None
    names = {p.name for p in path.iterdir()}
    if not names & set(TOKENIZER_FILES):
        raise EngineConfigError(f"model directory {path} has no tokenizer files (expected one "
                                f"of {', '.join(TOKENIZER_FILES)})")
    if not names & set(WEIGHT_FILES) and not any(n.endswith(".safetensors") for n in names):
        raise EngineConfigError(f"model directory {path} has no weights (expected "
                                f"{', '.join(WEIGHT_FILES)} or *.safetensors)")
