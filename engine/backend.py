"""What a backend is to the engine core: requests join a running engine, each step advances every
request it is running, and new tokens come out as events.

The core (engine/core.py) owns the request bookkeeping that is the same for every backend:
streaming or collecting, stop strings (checked across a resumed request's seam), usage, aborts,
timing. A backend owns its model and tokenizer:

* echo (engine/echo.py): characters are tokens, no torch; continuous batching by construction;
* transformers (engine/transformers_backend.py): a HF model; one `generate` per batch of
  requests with the same sampling parameters, streaming through a per-token hook;
* vllm (engine/vllm_backend.py): vLLM's LLMEngine in-process, continuous batching.

Built lazily inside the child; imports nothing heavy at module level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from engined.engine.protocol import ChatMessage, GpuMemory, Position, Sampling

ProgressFn = Callable[[str, str], None]


class EngineConfigError(Exception):
    """The engine's own config or model is invalid: exit 78, do not restart."""


class RequestRejected(Exception):
    """This request is invalid for this engine (too long, a bad token id): the client's error."""


def no_adapters(kind: str) -> str:
    """What a backend without LoRA adapters says (engine.adapters has the rest of them)."""
    return f"LoRA adapters need backend: vllm (this engine runs {kind})"


def refuse_structured(sampling: Sampling, backend: str) -> None:
    """What only vLLM's structured-output backend does: RequestRejected naming the field."""
    for name in ("response_format", "structured_outputs"):
        value = getattr(sampling, name)
        if value is not None and value != {"type": "text"}:
            raise RequestRejected(f"'{name}' (structured outputs) needs backend: vllm; the "
                                  f"{backend} backend cannot constrain its output")


@dataclass
class Admission:
    """A request as the core hands it to the backend: the prompt already in token ids (the
    resumed ids appended), the tokens still to generate, and the sampling parameters."""

    id: str
    prompt_ids: list[int]
    max_tokens: int  # still to generate (the original max_tokens minus the resumed ids)
    sampling: Sampling
    resumed: int = 0  # how many of prompt_ids are resumed output (the last ones)
    chat: Any = None  # a chat read by the engine's own frontend (engine.vllm_chat.Chat)
    prompt_text: str = ""  # the request's prompt as text, where it came as text
    adapter: str | None = None  # the loaded LoRA adapter it generates with (engine.adapters)


@dataclass(frozen=True)
class Delta:
    """New tokens of a request. `text` may be shorter than the ids say (a partial character is
    held back until the next token completes it). `logprobs`: one Position per id, when the
    request's sampling asks for them."""

    id: str
    token_ids: list[int]
    text: str
    logprobs: list[Position] | None = None


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's positions' logprobs (`sampling.prompt_logprobs`), before the first Delta:
    one Position per prompt token; the first holds only the token, with rank 0 (nothing comes
    before it: see `first_position`)."""

    id: str
    positions: list[Position]


@dataclass(frozen=True)
class Finished:
    """A request ended inside the backend: eos or max_tokens (`stop` / `length`), or the
    backend failed it (`error`, with what went wrong). A token that ended it (the end of
    sequence, or one of `stop_token_ids`) was the last Delta's, with no text, as vLLM counts
    and shows it; `stop_reason` names such a stop token id (vLLM's: None for eos)."""

    id: str
    reason: str
    error: str | None = None
    stop_reason: int | None = None
    rejected: bool = False  # an error the request itself caused (a client error)


Event = Delta | Finished | PromptLogprobs
Emit = Callable[[Event], None]


@dataclass(frozen=True)
class Load:
    running: int  # requests being generated
    waiting: int  # admitted, not yet running
    kv_cache_usage: float | None = None  # 0..1 where the backend knows it
    batch_limit: int | None = None  # sequences a step may take now (engine.memory)
    oom_total: int = 0  # steps that ran out of memory


class Backend(Protocol):
    """What the core asks of a backend. Backends subclass it, so that what is optional (a KV
    cache to describe, memory sizing, a chat frontend) comes with its default here and the core
    never has to ask whether a backend has it."""

    device: str
    dtype: str
    kind: str  # what it is, in messages: "builtin:echo", "transformers", "vllm"
    # Work arriving on an idle engine waits a moment for the rest of its burst (the core's
    # batching window): transformers, whose batch cannot grow; vLLM, where a burst split over
    # two steps costs a whole extra step (the late ones' prefill, then one more decode step for
    # all). Not echo, whose steps cost nothing: the wait would only add latency.
    burst_window: bool

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus output this engine takes."""

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """The prompt's token ids (with what the model expects at the start, e.g. BOS, unless
        not `special`)."""

    def vocab_pieces(self, ids: list[int]) -> list[str]:
        """The ids' entries in the vocabulary, as the tokenizer stores them (e.g. "Ġthe")."""

    def apply_chat_template(self, messages: list[ChatMessage]) -> list[int]:
        """A chat's prompt ids: the tokenizer's template, else the documented fallback."""

    def detokenize(self, ids: list[int]) -> str: ...

    def add(self, request: Admission) -> None:
        """The request joins (running requests go on). Raises RequestRejected."""

    def abort(self, request_id: str) -> None:
        """Stop generating it (no Finished event follows)."""

    def has_work(self) -> bool: ...

    def pending_tokens(self) -> int:
        """How many per-token hooks the next `step` calls (0: none to run): data-parallel
        ranks agree on it to run their collectives in lockstep."""

    def step(self, emit: Emit, on_token: Callable[[], None]) -> None:
        """Advance the running requests, emitting events as tokens come; call `on_token` after
        each generated token position (busy-loop progress, data-parallel lockstep)."""

    def load(self) -> Load: ...

    def dummy_step(self) -> None:
        """A tiny forward: what an idle data-parallel rank runs while its peers work."""

    def gpu_memory(self) -> list[GpuMemory]: ...

    def close(self) -> dict[str, float]:
        """Free the model; returns what was freed (for the cleanup report)."""

    # --- optional capabilities, with what a backend without them says -------------------------
    @property
    def cache_info(self) -> dict[str, float]:
        """Its KV cache, where it has one (vLLM: block_size, num_gpu_blocks), for READY."""
        return {}

    @property
    def sizing(self) -> dict[str, float]:
        """What it sized itself under memory_limit (vLLM: its KV cache), for READY's memory."""
        return {}

    def open_chat(self, body: dict[str, Any]) -> Any:
        """A chat read by the engine's own frontend (engine.vllm_chat.Chat): vLLM's only."""
        raise RequestRejected("this engine reads chats itself only with backend: vllm")

    # LoRA adapters (engine.adapters): vLLM's, and builtin:echo's for the supervisor's tests
    def adapters(self) -> list[str]:
        """The names of the adapters loaded now (READY lists them)."""
        return []

    def load_adapter(self, name: str, path: str) -> None:
        """Load adapter `name` from directory `path` (done already from there: nothing to do).
        RequestRejected naming the adapter and why it cannot."""
        raise RequestRejected(no_adapters(self.kind))

    def unload_adapter(self, name: str) -> None:
        """Requests that name it are refused from now on. RequestRejected if it is not
        loaded."""
        raise RequestRejected(no_adapters(self.kind))

    def check_adapter(self, name: str) -> None:
        """A request may generate with adapter `name`: RequestRejected naming it otherwise."""
        raise RequestRejected(no_adapters(self.kind))

    # vLLM's sleep mode (sleep_mode level1/level2): vLLM's, and builtin:echo's for the tests
    def sleep(self, level: int) -> None:
        """Free the model's memory but keep the process (nothing in flight: the supervisor
        drained it). RequestRejected where it cannot."""
        raise RequestRejected(f"{self.kind} cannot sleep in place (sleep_mode level1/level2 "
                              f"is vLLM's): use sleep_mode: stop")

    def wake_up(self) -> None:
        """Take the memory back; serve as before the sleep."""
        raise RequestRejected(f"{self.kind} cannot sleep in place")


def first_position(token: int, text: str) -> Position:
    """A prompt's first position: the token and its text, no logprob (rank 0)."""
    from engined.engine.protocol import TokenLogprob

    return [TokenLogprob(token, 0.0, 0, text)]


FALLBACK_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"  # per message, then "<|assistant|>\n"


def fallback_chat_prompt(messages: list[ChatMessage]) -> str:
    """The documented chat fallback for tokenizers without a chat template."""
    return "".join(FALLBACK_CHAT_TEMPLATE.format(role=m.role, content=m.content)
                   for m in messages) + "<|assistant|>\n"


def torch_gpu_memory(torch: Any, gpus: list[int]) -> list[GpuMemory]:
    """torch's figures per GPU of this engine (physical index, in CUDA_VISIBLE_DEVICES order);
    nothing before CUDA is initialised (asking would initialise it)."""
    from engined.engine.protocol import GpuMemory

    cuda = torch.cuda
    if not gpus or not cuda.is_initialized():
        return []
    return [GpuMemory(gpu=physical, allocated_bytes=cuda.memory_allocated(i),
                      reserved_bytes=cuda.memory_reserved(i),
                      peak_bytes=cuda.max_memory_allocated(i))
            for i, physical in enumerate(gpus[: cuda.device_count()])]
