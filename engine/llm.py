"""Hugging Face causal-LM engines: `builtin:tiny-llama` and `{path: DIR, dtype: ...}`.

Imported only inside the child, only when such a model is configured: this module is the one
place that imports torch and transformers. No hub access, ever: the child runs with
HF_HUB_OFFLINE=1 and every load is `from_pretrained(<local directory>)`.

`builtin:tiny-llama` is a small random-weight Llama with a byte-level tokenizer, built once (seeded,
so every replica and every run gets the same weights) with `save_pretrained` into a cache
directory, and from then on loaded through the same `from_pretrained` path as a real checkpoint.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from engined.engine.models import Completion, EngineConfigError, ProgressFn

if TYPE_CHECKING:
    from engined.engine.protocol import EngineConfig, GenerateRequest, GpuMemory

TINY_LLAMA_VERSION = "v1"  # bump when the recipe below changes: a new cache directory is built
_SPECIALS = ("<pad>", "<s>", "</s>")


def cache_root() -> Path:
    explicit = os.environ.get("ENGINED_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "engined"


def tiny_llama_dir(progress: ProgressFn) -> Path:
    """The tiny model's checkpoint directory, built on first use (atomically: replicas race)."""
    target = cache_root() / f"tiny-llama-{TINY_LLAMA_VERSION}"
    if (target / "config.json").exists():
        return target
    progress("build", f"creating tiny-llama checkpoint in {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=target.parent))
    try:
        _save_tiny_llama(staging)
        os.rename(staging, target)  # atomic; fails if another replica won the race
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _save_tiny_llama(directory: Path) -> None:
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
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
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


def build_hf_model(config: EngineConfig, progress: ProgressFn) -> HFModel:
    progress("import", "torch, transformers")
    try:
        import torch
        import transformers
    except ImportError as exc:  # a missing stack is a configuration error, not a crash loop
        raise EngineConfigError(missing_stack_message(exc, "torch and transformers")) from None

    torch.set_num_threads(max(1, config.threads))
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # no tqdm bars in the engine's log
    device = _device(config, torch)
    path = tiny_llama_dir(progress) if config.model == "builtin:tiny-llama" else Path(config.model)
    _check_checkpoint(path)
    dtype = _dtype(config.dtype, path, torch)
    progress("weights", f"{path} ({str(dtype).removeprefix('torch.')}, {device})")
    model, tokenizer = _load(path, dtype, device)
    built = HFModel(model, tokenizer, device, dtype, list(config.gpus))
    progress("warmup", "one generate step")
    built.generate_ids(["warm-up"], 2)
    return built


def _device(config: EngineConfig, torch: Any) -> str:
    if not config.gpus:
        return "cpu"
    if not torch.cuda.is_available():
        raise EngineConfigError(f"gpus {config.gpus} requested but CUDA is not available "
                                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
    torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES pins this replica: its first GPU is index 0
    return "cuda:0"


# A checkpoint directory needs one of each (the files Hugging Face loaders look for).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "tokenizer.tiktoken")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def missing_stack_message(exc: ImportError, stack: str) -> str:
    """What to tell an operator whose engine's environment lacks its model stack."""
    import sys

    missing = exc.name or str(exc)
    return (f"this engine needs {stack}, but {missing!r} cannot be imported in its environment "
            f"({sys.executable}): {exc}. Install them there: "
            f"{sys.executable} -m pip install 'engined[engine]' (GPU hosts: your CUDA build of "
            f"torch first)")


def _check_checkpoint(path: Path) -> None:
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


def _dtype(name: str | None, path: Path, torch: Any) -> Any:
    """The spec's dtype, else the checkpoint's own (config.json), else float32."""
    if name in (None, "auto"):
        saved = json.loads((path / "config.json").read_text("utf-8"))
        name = saved.get("dtype") or saved.get("torch_dtype") or "float32"
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise EngineConfigError(f"unknown dtype {name!r} (expected a torch dtype such as "
                                f"float32, float16 or bfloat16)")
    return value


def _load(path: Path, dtype: Any, device: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                          local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EngineConfigError(f"cannot load model from {path}: {exc}") from None
    tokenizer.padding_side = "left"  # decoder-only batching: pad on the left
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


class HFModel:
    def __init__(self, model: Any, tokenizer: Any, device: str, dtype: Any,
                 gpus: list[int]) -> None:
        import torch

        self.torch = torch
        self.model, self.tokenizer = model, tokenizer
        self.device = device
        self.dtype = str(dtype).removeprefix("torch.")
        self.gpus = gpus

    def generate(self, batch: list[GenerateRequest],
                 on_token: Callable[[], None] = lambda: None) -> list[Completion]:
        rows = self.generate_ids([r.prompt for r in batch], max(r.max_tokens for r in batch),
                                 on_token)
        out = []
        for req, (prompt_tokens, new_tokens) in zip(batch, rows):
            ids = new_tokens[: req.max_tokens]
            out.append(Completion(self.tokenizer.decode(ids, skip_special_tokens=True),
                                  prompt_tokens, len(ids)))
        return out

    def generate_ids(self, prompts: list[str], max_new_tokens: int,
                     on_token: Callable[[], None] = lambda: None) -> list[tuple[int, list[int]]]:
        """Greedy generation for a left-padded batch: (prompt tokens, new token ids) per row."""
        torch = self.torch
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True).to(self.device)
        with torch.inference_mode():
            output = self.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                         pad_token_id=self.tokenizer.pad_token_id,
                                         stopping_criteria=_progress_criteria(on_token))
        width = enc["input_ids"].shape[1]
        eos = self.tokenizer.eos_token_id
        results = []
        for row, mask in zip(output, enc["attention_mask"]):
            new = row[width:].tolist()
            if eos in new:  # finished rows are padded after their end-of-sequence token
                new = new[: new.index(eos)]
            results.append((int(mask.sum()), new))
        return results

    def dummy_step(self) -> None:
        """A one-token forward: what an idle data-parallel rank runs while its peers work."""
        torch = self.torch
        token = torch.tensor([[self.tokenizer.bos_token_id or 0]], device=self.device)
        with torch.inference_mode():
            self.model(input_ids=token)

    def gpu_memory(self) -> list[GpuMemory]:
        from engined.engine.protocol import GpuMemory

        cuda = self.torch.cuda
        if not self.gpus or not cuda.is_initialized():
            return []
        return [GpuMemory(gpu=physical, allocated_bytes=cuda.memory_allocated(i),
                          reserved_bytes=cuda.memory_reserved(i),
                          peak_bytes=cuda.max_memory_allocated(i))
                for i, physical in enumerate(self.gpus[: cuda.device_count()])]

    def close(self) -> dict[str, float]:
        """Drop every reference to the weights; core's `finally` then releases CUDA caches."""
        cuda = self.torch.cuda
        report: dict[str, float] = {"model_freed": 1.0}
        if cuda.is_initialized():
            report["cuda_allocated_with_model_bytes"] = float(cuda.memory_allocated())
        self.model = None
        self.tokenizer = None
        gc.collect()
        return report


def _progress_criteria(on_token: Callable[[], None]) -> Any:
    """A stopping criterion that never stops: it stamps busy-loop progress after every token."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Stamp(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            on_token()
            import torch
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([_Stamp()])
