"""The transformers backend: `builtin:tiny-llama` and `{path: DIR, dtype: ...}` Hugging Face
causal LMs, streaming tokens as they come.

Imported only inside the child, only when such a model is configured: with engine/checkpoint.py's
recipe builder, the one place that imports torch and transformers. No hub access, ever: the
child runs with HF_HUB_OFFLINE=1 and every load is `from_pretrained(<local directory>)`.

One HF `generate` call applies one set of sampling parameters to a whole batch, so a batch is
formed of waiting requests with the same parameters; a request that arrives while a batch runs
waits for the next one (vLLM's backend has continuous batching). A per-token hook streams each
row's new tokens, stamps the busy loop's progress and ends rows that are done or aborted. What
`generate` has no parameter for (vLLM's logprobs, per-row sampling fields) is computed from the
logits in engine.transformers_logits.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import msgspec

from engined.engine.backend import (
    Admission,
    Backend,
    Delta,
    Emit,
    EngineConfigError,
    Finished,
    Load,
    ProgressFn,
    RequestRejected,
    fallback_chat_prompt,
    refuse_structured,
    torch_gpu_memory,
)
from engined.engine.checkpoint import check_checkpoint, tiny_llama_dir
from engined.engine.memory import ALONE_TRIES, BatchLimit, is_oom, too_large
from engined.engine.transformers_logits import RawLogits, RowLogits, position, prompt_logprobs

if TYPE_CHECKING:
    from engined.engine.protocol import ChatMessage, EngineConfig, GpuMemory, Position, Sampling

def build_hf_backend(config: EngineConfig, progress: ProgressFn) -> HFBackend:
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
    check_checkpoint(path)
    dtype = _dtype(config.dtype, path, torch)
    progress("weights", f"{path} ({str(dtype).removeprefix('torch.')}, {device})")
    model, tokenizer = _load(path, dtype, device)
    built = HFBackend(model, tokenizer, device, dtype, list(config.gpus), config.max_batch_size)
    progress("warmup", "one generate step")
    built.warm_up()
    return built


def _device(config: EngineConfig, torch: Any) -> str:
    if not config.gpus:
        return "cpu"
    if not torch.cuda.is_available():
        raise EngineConfigError(f"gpus {config.gpus} requested but CUDA is not available "
                                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
    torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES pins this replica: its first GPU is index 0
    return "cuda:0"


def missing_stack_message(exc: ImportError, stack: str) -> str:
    """What to tell an operator whose engine's environment lacks its model stack."""
    import sys

    missing = exc.name or str(exc)
    return (f"this engine needs {stack}, but {missing!r} cannot be imported in its environment "
            f"({sys.executable}): {exc}. Install them there: "
            f"{sys.executable} -m pip install 'engined[engine]' (GPU hosts: your CUDA build of "
            f"torch first)")


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


@dataclass
class _Row:
    request: Admission
    ids: list[int] = field(default_factory=list)  # generated so far (this incarnation)
    text_len: int = 0  # characters of decode(prefix + ids) already emitted
    done: bool = False
    # a row continued after an out-of-memory step: what it had generated before (now part of
    # request.prompt_ids), decoded with what follows so the text joins exactly
    prefix: list[int] = field(default_factory=list)
    continued: bool = False
    alone_ooms: int = 0  # steps it ran out of memory in alone


def _sampling_key(sampling: Sampling) -> Sampling:
    """What one `generate` call applies to its whole batch: everything but the budget and the
    stop strings (per row: the hook and the core handle them)."""
    return msgspec.structs.replace(sampling, max_tokens=0, stop=[])


class HFBackend(Backend):
    kind = "transformers"  # no LoRA adapters: Backend's refusal (engine.adapters)
    burst_window = True  # one `generate` per batch (it cannot grow): a burst shares one

    def __init__(self, model: Any, tokenizer: Any, device: str, dtype: Any, gpus: list[int],
                 max_batch_size: int) -> None:
        import torch

        self.torch = torch
        self.model, self.tokenizer = model, tokenizer
        self.device = device
        self.dtype = str(dtype).removeprefix("torch.")
        self.gpus = gpus
        self.max_batch_size = max_batch_size
        self.batch = BatchLimit(max_batch_size)  # lowered by out-of-memory steps (engine.memory)
        self.waiting: collections.deque[Admission] = collections.deque()
        self.resume: collections.deque[_Row] = collections.deque()  # cut by an OOM: go first
        self.rows: dict[str, _Row] = {}  # the batch being generated
        self.vocab_size = int(getattr(model.config, "vocab_size", 0) or len(tokenizer))
        self.max_length = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)

    # --- tokens ------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.max_length

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def vocab_pieces(self, ids: list[int]) -> list[str]:
        return [str(p) for p in self.tokenizer.convert_ids_to_tokens(ids)]

    def detokenize(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def apply_chat_template(self, messages: list[ChatMessage]) -> list[int]:
        chat = [{"role": m.role, "content": m.content} for m in messages]
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
            return list(ids)
        return self.tokenize(fallback_chat_prompt(messages))

    # --- requests ----------------------------------------------------------------------------
    def add(self, request: Admission) -> None:
        refuse_structured(request.sampling, "transformers")
        ids = request.prompt_ids
        if not ids:
            raise RequestRejected("empty prompt")
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise RequestRejected(f"token ids must be in 0..{self.vocab_size - 1}")
        if len(ids) + request.max_tokens > self.max_length:
            raise RequestRejected(f"prompt ({len(ids)} tokens) plus max_tokens "
                                  f"({request.max_tokens}) exceeds the model's context of "
                                  f"{self.max_length}")
        self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        row = self.rows.get(request_id)
        if row is not None:
            row.done = True  # its row stops at the next token
        self.waiting = collections.deque(r for r in self.waiting if r.id != request_id)
        self.resume = collections.deque(r for r in self.resume if r.request.id != request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.resume)

    def _next_batch(self) -> list[Admission]:
        first = self.waiting[0]
        if first.sampling.seed is not None:
            # `generate` draws from one RNG for the whole batch: a seeded request is
            # reproducible only alone
            return [first]
        key = _sampling_key(first.sampling)
        batch = [r for r in self.waiting
                 if r.sampling.seed is None and _sampling_key(r.sampling) == key]
        return batch[:min(self.max_batch_size, self.batch.limit)]

    def _next_rows(self) -> list[_Row]:
        """Rows an out-of-memory step cut go first (they came from one batch: one sampling),
        then new requests; at most the batch limit."""
        if self.resume:
            take = min(self.batch.limit, len(self.resume))
            return [self.resume.popleft() for _ in range(take)]
        batch = self._next_batch()
        chosen = {r.id for r in batch}
        self.waiting = collections.deque(r for r in self.waiting if r.id not in chosen)
        return [_Row(r) for r in batch]

    def pending_tokens(self) -> int:
        if self.resume:
            return max(r.request.max_tokens for r in self.resume)
        return max((r.max_tokens for r in self._next_batch()), default=0) if self.waiting else 0

    def load(self) -> Load:
        return Load(running=sum(1 for r in self.rows.values() if not r.done),
                    waiting=len(self.waiting) + len(self.resume),
                    batch_limit=self.batch.limit, oom_total=self.batch.oom_total)

    def step(self, emit: Emit, on_token: Callable[[], None]) -> None:
        """One batch of same-sampling requests through one `generate` call, streamed. One
        that runs out of memory frees what it held, lowers the batch limit and puts its rows
        back first, to continue from the tokens they had (engine.memory)."""
        rows = self._next_rows()
        self.rows = {r.request.id: r for r in rows}
        try:
            try:
                self._generate(rows, emit, on_token)
            except Exception as exc:  # noqa: BLE001 - only memory is handled; the rest raises
                if not is_oom(exc):
                    raise
                self._out_of_memory(rows, emit, exc)
                return
            self.batch.succeeded()
            for row in rows:  # generate ended at the batch's longest max_tokens
                if not row.done:
                    row.done = True
                    emit(Finished(row.request.id, "length"))
        finally:
            self.rows = {}

    def _out_of_memory(self, rows: list[_Row], emit: Emit, exc: BaseException) -> None:
        gc.collect()
        if self.torch.cuda.is_initialized():
            self.torch.cuda.empty_cache()
        live = [r for r in rows if not r.done]
        self.batch.failed(len(rows))
        print(f"[oom] a step of {len(rows)} sequence(s) ran out of memory "
              f"({str(exc).splitlines()[0][:160]}): batch limit now {self.batch.limit}, "
              f"{len(live)} request(s) continue", file=sys.stderr, flush=True)
        for row in live if len(rows) == 1 else []:
            row.alone_ooms += 1
        if len(rows) == 1 and any(row.alone_ooms >= ALONE_TRIES for row in live):
            for row in live:  # it does not fit even alone: its own fault, said so
                row.done = True
                request = row.request
                emit(Finished(request.id, "error", rejected=True, error=too_large(
                    len(request.prompt_ids) - len(row.prefix),
                    request.max_tokens + len(row.prefix))))
            return
        for row in reversed(live):
            request = row.request
            row.done = True  # this row object is finished; its continuation goes on
            self.resume.appendleft(_Row(
                Admission(request.id, request.prompt_ids + row.ids,
                          request.max_tokens - len(row.ids), request.sampling,
                          resumed=request.resumed + len(row.ids), chat=request.chat),
                text_len=row.text_len, prefix=row.prefix + row.ids, continued=True,
                alone_ooms=row.alone_ooms))

    def _generate(self, rows: list[_Row], emit: Emit, on_token: Callable[[], None]) -> None:
        batch = [row.request for row in rows]
        torch = self.torch
        width = max(len(r.prompt_ids) for r in batch)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids
                                  for r in batch], device=self.device)
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids)
                             for r in batch], device=self.device)
        sampling = batch[0].sampling
        # HF's own end-of-sequence handling is off (eos_token_id=None): the hook ends each row
        # (eos unless ignore_eos, a stop token id, its max_tokens); top_k 0 is off, as vLLM's
        kwargs: dict[str, Any] = {"do_sample": sampling.temperature > 0, "top_k": sampling.top_k,
                                  "eos_token_id": None}
        if sampling.temperature > 0:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p)
            if sampling.min_p:
                kwargs["min_p"] = sampling.min_p
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
        if sampling.repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = sampling.repetition_penalty
        hook = _StreamHook(self, rows, width, emit, on_token)
        adjust = RowLogits(torch, self.tokenizer.eos_token_id, batch, width)
        with torch.inference_mode(), RawLogits(self.model, sampling.logprobs) as raw:
            for row in rows:
                if not row.continued:  # a continued row had its prompt's logprobs already
                    prompt = prompt_logprobs(self.model, self.tokenizer, torch, self.device,
                                             row.request)
                    if prompt is not None:
                        emit(prompt)
            hook.raw = raw
            self.model.generate(input_ids=input_ids, attention_mask=mask,
                                max_new_tokens=max(r.max_tokens for r in batch),
                                pad_token_id=pad, stopping_criteria=hook.criteria(),
                                logits_processor=adjust.processors(), **kwargs)

    def _advance(self, row: _Row, token: int, emit: Emit, position: Position | None = None
                 ) -> bool:
        """Row `row` produced `token` (`position`: its logprobs, if asked); True when it is
        done."""
        sampling = row.request.sampling
        eos = token == self.tokenizer.eos_token_id and not sampling.ignore_eos
        if eos or token in sampling.stop_token_ids:
            # the token that ended it counts and has its logprobs, but no text (vLLM's way);
            # vLLM's stop_reason: the stop token id, None for the end of sequence
            row.done = True
            emit(Delta(row.request.id, [token], "", None if position is None else [position]))
            emit(Finished(row.request.id, "stop", stop_reason=None if eos else token))
            return True
        row.ids.append(token)
        full = str(self.tokenizer.decode(row.prefix + row.ids,
                                         skip_special_tokens=sampling.skip_special_tokens))
        # a byte-level token may end inside a multi-byte character: hold its text back
        text = "" if full.endswith("\ufffd") else full[row.text_len:]
        if text:
            row.text_len = len(full)
        emit(Delta(row.request.id, [token], text, None if position is None else [position]))
        if len(row.ids) >= row.request.max_tokens:
            row.done = True
            emit(Finished(row.request.id, "length"))
        return row.done

    def warm_up(self) -> None:
        request = Admission("warm-up", self.tokenize("warm-up"), 2,
                            _greedy_sampling())
        self.add(request)
        self.step(lambda event: None, lambda: None)

    def dummy_step(self) -> None:
        """A one-token forward: what an idle data-parallel rank runs while its peers work."""
        torch = self.torch
        token = torch.tensor([[self.tokenizer.bos_token_id or 0]], device=self.device)
        with torch.inference_mode():
            self.model(input_ids=token)

    def gpu_memory(self) -> list[GpuMemory]:
        return torch_gpu_memory(self.torch, self.gpus)

    def close(self) -> dict[str, float]:
        """Drop every reference to the weights; core's `finally` then releases CUDA caches."""
        cuda = self.torch.cuda
        report: dict[str, float] = {"model_freed": 1.0}
        if cuda.is_initialized():
            report["cuda_allocated_with_model_bytes"] = float(cuda.memory_allocated())
        self.model = None
        self.tokenizer = None
        self.waiting.clear()
        gc.collect()
        return report


def _greedy_sampling() -> Sampling:
    from engined.engine.protocol import Sampling

    return Sampling(max_tokens=2)


class _StreamHook:
    """Called by `generate` after every token position: stream each live row's new token, end
    rows that are done (eos, their own max_tokens, aborted), stamp the busy loop's progress."""

    def __init__(self, backend: HFBackend, rows: list[_Row], width: int, emit: Emit,
                 on_token: Callable[[], None]) -> None:
        self.backend, self.rows, self.width = backend, rows, width
        self.emit, self.on_token = emit, on_token
        self.raw: RawLogits | None = None

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        backend = self.backend
        torch = backend.torch
        at = input_ids.shape[1] - 1
        done = []
        logprobs = self.raw.logprobs() if self.raw is not None else None
        for i, row in enumerate(self.rows):
            if not row.done and at >= self.width:
                token = int(input_ids[i, at])
                top = row.request.sampling.logprobs
                backend._advance(row, token, self.emit, None if (
                    logprobs is None or top is None)
                    else position(torch, backend.tokenizer, logprobs[i], token, top))
            done.append(row.done)
        self.on_token()
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    def criteria(self) -> Any:
        from transformers import StoppingCriteria, StoppingCriteriaList

        hook = self

        class _Hook(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                return hook(input_ids, scores, **kwargs)

        return StoppingCriteriaList([_Hook()])
