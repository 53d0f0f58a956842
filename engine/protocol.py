"""Messages between the daemon and its engine-core children (torch-free, msgpack via msgspec).

Two ZeroMQ channels, both bound by the daemon so children never fight over ports:

* control: each child PUSHes Hello / Progress / Heartbeat / Goodbye to the daemon's PULL socket.
  Heartbeats come from a dedicated thread in the child, so they never queue behind request
  traffic, and they carry the busy loop's progress stamp so a live thread cannot hide a stuck loop.
* requests: the daemon's ROUTER talks to one DEALER per child (routing identity
  ``name:incarnation``, `contract.routing_id`). The child sends Ready on this channel, so the
  daemon learns that an engine is READY and that it is routable from the same message: "ready"
  means "usable", with no race between two sockets. GenerateRequest goes down, GenerateResult
  comes back.

Every message names its engine and incarnation; the daemon drops messages from an incarnation
that is no longer current. Nothing is ever pickled.
"""

from __future__ import annotations

from typing import Any

import msgspec

# Safety bounds for decoding: a malformed or hostile frame must not cost the daemon memory.
MAX_FRAME_BYTES = 4 * 1024 * 1024


class GpuMemory(msgspec.Struct, frozen=True):
    gpu: int  # physical index
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_bytes: int = 0


class Hello(msgspec.Struct, tag="hello", frozen=True):
    engine: str
    incarnation: int
    pid: int


PHASE_CLEANUP = "cleanup"


class Progress(msgspec.Struct, tag="progress", frozen=True):
    """Loading phases while STARTING (import, weights, warm-up, ...), and PHASE_CLEANUP when the
    child enters its `finally` on its own: its heartbeats stop then, and the daemon gives the
    cleanup stop_timeout (as for a requested stop) instead of declaring a hang."""

    engine: str
    incarnation: int
    phase: str
    detail: str = ""


class Ready(msgspec.Struct, tag="ready", frozen=True):
    """Sent on the request channel (see the module docstring): built, warmed up and routable."""

    engine: str
    incarnation: int
    load_s: float
    device: str
    model: str
    dtype: str
    gpu_memory: list[GpuMemory] = []
    # what memory_limit set (engine.memory): the limit, what the engine held at it, the address
    # space or device fraction, and for vLLM the KV cache it got
    memory: dict[str, float] = {}
    # its KV cache, where the backend has one (vLLM: block_size, num_gpu_blocks), for the
    # gateway's vllm:cache_config_info
    cache: dict[str, float] = {}
    adapters: list[str] = []  # the LoRA adapters loaded (EngineConfig.adapters), by name


class Heartbeat(msgspec.Struct, tag="hb", frozen=True):
    engine: str
    incarnation: int
    iteration: int  # busy-loop iterations so far
    last_iteration_at: float  # CLOCK_MONOTONIC (system-wide on Linux) of the last iteration
    waiting: int  # requests queued, not yet in a batch
    running: int  # requests in the batch being computed
    requests_ok: int = 0
    requests_failed: int = 0
    gpu_memory: list[GpuMemory] = []
    in_collective: bool = False  # a data-parallel rank blocked waiting for its peers
    tokens: int = 0  # tokens generated so far (all requests)
    kv_cache_usage: float | None = None  # 0..1, where the backend reports it (vLLM)
    batch_limit: int | None = None  # sequences a step may take now (lowered by an OOM)
    oom_total: int = 0  # steps that ran out of memory and were continued (engine.memory)
    memory_headroom: int | None = None  # bytes left under memory_limit (None: no limit)


class Goodbye(msgspec.Struct, tag="bye", frozen=True):
    """Sent from the child's `finally`: what cleanup ran and what it freed."""

    engine: str
    incarnation: int
    reason: str
    cleanup: dict[str, float] = {}


ControlMessage = Hello | Progress | Heartbeat | Goodbye  # what the control channel carries
ChildMessage = ControlMessage | Ready  # everything that changes an engine's lifecycle state


# --- requests: one protocol for every backend -------------------------------------------------
FINISH_STOP = "stop"  # end of sequence, or a stop string (not included in the text)
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_ABORT = "abort"  # the daemon aborted it (its client went away)
FINISH_ERROR = "error"  # see GenerateResult.error


MAX_LOGPROBS = 20  # top logprobs per position (vLLM's default max_logprobs, OpenAI's chat limit)


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One token's log-probability at one position, from the model's raw distribution (before
    temperature, penalties and the like: vLLM's default), with its rank (1: the likeliest) and
    its text as vLLM shows it (the token alone, its leading space kept)."""

    token_id: int
    logprob: float
    rank: int
    token: str


# One position: the token that was there first (sampled, or the prompt's), then the top
# `logprobs` tokens by rank, each token once (vLLM's order).
Position = list[TokenLogprob]


class Sampling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sampling parameters, with vLLM's names and meanings. temperature 0 is greedy
    (deterministic); a seed makes a sampled request reproducible on one engine (not after it
    moved to another: see `resume`). A resumed request counts its resumed tokens toward
    max_tokens and min_tokens, and as output for the presence and frequency penalties where the
    backend can (transformers; vLLM counts only what it generated itself)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = []  # stop strings; the text ends before the first one
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output (1: off)
    presence_penalty: float = 0.0  # over the output
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = {}  # token id -> added to its logit
    min_tokens: int = 0  # no end of sequence (or stop token) before this many tokens
    ignore_eos: bool = False  # go on past the end-of-sequence token
    stop_token_ids: list[int] = []  # generating one of these ends the request (finish: stop)
    include_stop_str_in_output: bool = False  # the text ends after the stop string, not before
    skip_special_tokens: bool = True  # special tokens' text is left out (vLLM backend)
    logprobs: int | None = None  # per generated token: its logprob and the top N (0: only its)
    prompt_logprobs: int | None = None  # the same for each prompt token (the first has none)
    # structured outputs, as the client sent them (OpenAI's and vLLM's fields, read by vLLM's
    # own code in the vLLM backend; the other backends reject them)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str  # system | user | assistant
    content: str


TASK_GENERATE, TASK_TOKENIZE, TASK_DETOKENIZE = "generate", "tokenize", "detokenize"
# LoRA adapters at run time (engine.adapters), answered at once: load `adapter` from the
# absolute directory `adapter_path` (loaded already from there: a success), or unload it
TASK_LOAD_ADAPTER, TASK_UNLOAD_ADAPTER = "load_adapter", "unload_adapter"
# vLLM's sleep mode (sleep_mode level1/level2, supervisor.routing.sleepmode), answered once done:
# sleep at `sleep_level` (1: weights to host memory, KV cache dropped; 2: both dropped), or
# wake up; the process stays, requests are refused while it sleeps
TASK_SLEEP, TASK_WAKE_UP = "sleep", "wake_up"


class GenerateRequest(msgspec.Struct, tag="gen", frozen=True):
    """A completion (`prompt`, or `prompt_ids` given as token ids) or a chat (`messages`: the
    child applies its tokenizer's chat template, or a plain documented fallback). `resume`
    carries the token ids already delivered for this request by an engine that died: the
    engine continues after them (they are appended to the prompt's ids, never re-tokenised
    text) and `max_tokens` counts them."""

    id: str
    prompt: str = ""
    prompt_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    sampling: Sampling = Sampling()
    stream: bool = False  # TokenChunks as tokens come, then the GenerateResult
    resume: list[int] = []
    echo: bool = False  # send the prompt back (its ids, text and logprobs): see `PromptEcho`
    # "generate", or answered at once without generating: "tokenize" (the prompt's ids, in
    # the result's token_ids; `token_strs`: their vocabulary pieces too; without
    # `add_special_tokens`, a text prompt gets no BOS) or "detokenize" (prompt_ids as text);
    # or TASK_LOAD_ADAPTER / TASK_UNLOAD_ADAPTER (see `adapter`)
    task: str = TASK_GENERATE
    token_strs: bool = False
    add_special_tokens: bool = True
    # a chat read by the engine's own frontend (vLLM engines): the client's body as it came
    # (messages with tool calls, tools, tool_choice, chat_template_kwargs, ...); the prompt,
    # tool-choice grammar and output parsing are vLLM's (`messages` is then unused)
    chat: dict[str, Any] | None = None
    # the loaded LoRA adapter to generate (chat, tokenize) with: one that is not loaded is
    # rejected, naming it; for TASK_LOAD_ADAPTER / TASK_UNLOAD_ADAPTER, the one to (un)load
    adapter: str | None = None
    adapter_path: str = ""  # TASK_LOAD_ADAPTER: its absolute directory (PEFT's format)
    sleep_level: int = 1  # TASK_SLEEP: vLLM's sleep level, 1 or 2


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """The daemon no longer wants request `id` (its client went away): stop generating it."""

    id: str


class Wake(msgspec.Struct, tag="wake", frozen=True):
    """Sent to the other ranks of a data-parallel group when one rank gets work, so they join
    the next lockstep step now instead of at the end of their idle poll."""


class PromptEcho(msgspec.Struct, frozen=True):
    """The prompt as the engine read it (a request with `echo`), in the request's first message:
    its token ids, its text, and its positions' logprobs (`prompt_logprobs`; position 0 has
    nothing before it: only the token itself, with rank 0 and no meaningful logprob)."""

    token_ids: list[int]
    text: str
    logprobs: list[Position] | None = None


class TokenChunk(msgspec.Struct, tag="tok", frozen=True):
    """New tokens of a streamed request (its text may lag its ids by a partial character), with
    their logprobs when the request asked for them (one Position per id)."""

    id: str
    engine: str
    incarnation: int
    token_ids: list[int]
    text: str
    logprobs: list[Position] | None = None
    prompt: PromptEcho | None = None
    delta: dict[str, Any] | None = None  # a `chat` request: the OpenAI delta for this text


class GenerateResult(msgspec.Struct, tag="result", frozen=True):
    """A request's end. Not streamed: the whole completion; streamed: only what the chunks did
    not carry. Token counts cover the whole request: prompt_tokens is the original prompt (the
    resumed ids excluded), completion_tokens includes the resumed ids, and the end of sequence
    or stop token that ended it (the last of token_ids, with no text: vLLM's count)."""

    id: str
    engine: str
    incarnation: int
    text: str = ""
    token_ids: list[int] = []
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    batch_size: int = 0  # requests running beside it when it started
    queue_s: float = 0.0
    compute_s: float = 0.0
    error: str | None = None
    rejected: bool = False  # the request itself is invalid (a client error: retrying is futile)
    logprobs: list[Position] | None = None  # for token_ids, as in TokenChunk
    prompt: PromptEcho | None = None  # if no chunk carried it
    token_strs: list[str] | None = None  # a tokenize task's vocabulary pieces, if asked
    # a `chat` request: the whole message (not streamed) or the stream's last delta, and the
    # finish reason the parser implies (tool_calls), if any
    message: dict[str, Any] | None = None
    delta: dict[str, Any] | None = None
    chat_finish: str | None = None
    max_model_len: int = 0  # a tokenize task: the longest prompt plus output the engine takes
    # vLLM's stop_reason: the stop string or the stop token id that ended it; None for the end
    # of sequence, max_tokens and the rest
    stop_reason: int | str | None = None
    adapters: list[str] | None = None  # an adapter task: the adapters loaded after it


class Results(msgspec.Struct, tag="results", frozen=True):
    """Several requests' chunks and results from one step, in one frame: a step of a batch of
    B streamed requests is one message, not B (the per-message cost on both sides dominates)."""

    items: list[TokenChunk | GenerateResult]


RequestMessage = GenerateRequest | Abort | Wake | TokenChunk | GenerateResult | Results | Ready


# omit_defaults: a field left at its default is not sent, so an engine of an earlier release
# (an upgrade's adopted fork server) reads a config that uses nothing it lacks
class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Everything a child needs, resolved by the daemon and passed at exec time."""

    name: str
    group: str
    rank: int
    replicas: int
    incarnation: int
    model: str  # "builtin:echo", "builtin:tiny-llama" or a directory
    dtype: str | None
    gpus: list[int]
    data_parallel: bool
    max_batch_size: int
    threads: int
    control_endpoint: str
    request_endpoint: str
    heartbeat_interval_s: float
    rendezvous: str | None = None  # "host:port" of a data-parallel group's TCP store
    python: str | None = None  # the child's interpreter (spec `python:`); None: engined's own
    backend: str = "transformers"  # transformers | vllm (builtin:echo ignores it)
    engine_args: dict[str, Any] = {}  # passed to the backend (vLLM's EngineArgs)
    frontend_args: dict[str, Any] = {}  # vLLM's chat frontend options (tool/reasoning parsers)
    memory_limit: int | None = None  # bytes the engine may hold once loaded (engine.memory)
    # LoRA adapters loaded while the engine is built, before READY: name -> absolute directory
    # (PEFT's format); one that cannot be loaded fails the build (exit 78). vLLM engines only
    # (and builtin:echo, which prefixes its output with "[name] ")
    adapters: dict[str, str] = {}
    # the spec's sleep_mode as vLLM's level (1, 2), for engines that sleep in place (vLLM
    # builds with its sleep mode then); 0: it sleeps by being stopped
    sleep_level: int = 0


_control_encoder = msgspec.msgpack.Encoder()
_control_decoder = msgspec.msgpack.Decoder(ControlMessage)
_request_decoder = msgspec.msgpack.Decoder(RequestMessage)


def encode(message: msgspec.Struct) -> bytes:
    return _control_encoder.encode(message)


def decode_control(frame: bytes) -> ControlMessage:
    """Raises msgspec.DecodeError / ValidationError for anything malformed."""
    if len(frame) > MAX_FRAME_BYTES:
        raise msgspec.DecodeError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    return _control_decoder.decode(frame)


def decode_request(frame: bytes) -> RequestMessage:
    if len(frame) > MAX_FRAME_BYTES:
        raise msgspec.DecodeError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    return _request_decoder.decode(frame)


def messages_of(msg: RequestMessage) -> list[RequestMessage]:
    """A request-channel message as the messages it carries (a Results frame holds several)."""
    return list(msg.items) if isinstance(msg, Results) else [msg]


def encode_config(config: EngineConfig) -> str:
    return msgspec.json.encode(config).decode()


def decode_config(text: str | bytes) -> EngineConfig:
    return msgspec.json.decode(text, type=EngineConfig)
