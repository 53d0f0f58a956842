"""The OpenAI API's shapes for engined's own engines: requests to the engine protocol, results to
OpenAI's answers (a command engine's requests pass through to its own server: gateway.proxy).

Sampling takes OpenAI's fields and vLLM's extras (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids; penalties and logit_bias too); `n` and batches of prompts (see
gateway.choices); logprobs as vLLM answers them: completions' `logprobs` (the top N, with `echo`
the prompt's too) and vLLM's `prompt_logprobs`, chat's `logprobs` and `top_logprobs`, from the
model's raw distribution. What is not supported (best_of > n, suffix, tools, non-text response
formats) is a 400 naming the field, never silently ignored. The defaults are
OpenAI's: temperature 1, top_p 1, completions' max_tokens 16 (chat: up to the engine's limit,
bounded here by MAX_TOKENS_DEFAULT_CHAT).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from engined.engine import protocol as proto
from engined.supervisor import __version__, bodies
from engined.supervisor import request_fields as fields

MAX_TOKENS_DEFAULT_COMPLETION = 16  # OpenAI's
MAX_TOKENS_DEFAULT_CHAT = 1024
TEMPERATURE_DEFAULT = 1.0  # OpenAI's


class ApiError(Exception):
    """An OpenAI-shaped error answer."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (status, message, kind,
                                                                        param, code)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def outcome(exc: ApiError) -> str:
    """How a request that ended with `exc` is counted (engined_gateway_requests_total)."""
    if exc.code == "timeout" or exc.code == "no_replica":
        return "timeout"
    return "rejected" if exc.status in (400, 429) else "error"


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass(frozen=True)
class Job:
    """One client request, as the gateway runs it on an engine (maybe several, if it moves)."""

    kind: str  # "completion" | "chat"
    model: str
    prompt: str
    prompt_ids: list[int] | None
    messages: list[proto.ChatMessage] | None
    sampling: proto.Sampling
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # top logprobs per token in the answer (None: no logprobs)
    echo: bool = False  # the answer begins with the prompt (completions)
    echo_only: bool = False  # max_tokens 0 with echo: the prompt alone (one token generated)
    chat: dict[str, Any] | None = None  # a chat the engine reads itself (vLLM's frontend)
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's ids and the answer's
    echoed: str = ""  # chat's `echo` (vLLM's): the last message's content, before the answer

    @property
    def resumable(self) -> bool:
        """Whether a stream can go on from its delivered tokens on another engine: not under
        a structured-output grammar (its state is the engine's; a new engine would start the
        grammar again after the delivered text). It is still resent before its first byte."""
        forced = self.chat is not None and self.chat.get("tool_choice") not in (
            None, "none", "auto")  # a tool call's grammar
        return self.sampling.response_format is None and \
            self.sampling.structured_outputs is None and not forced

    def request(self, request_id: str, resume: list[int]) -> proto.GenerateRequest:
        """The engine request. A streamed one is streamed from the engine too, so a request
        that moves resumes after the tokens the client has seen. A client that waits for the
        whole answer has seen nothing until it ends: its engine request is not streamed (that
        costs the engine a message per token), and one that moves starts again."""
        return proto.GenerateRequest(request_id, prompt=self.prompt, prompt_ids=self.prompt_ids,
                                     messages=self.messages, sampling=self.sampling,
                                     stream=self.stream, resume=resume,
                                     echo=(self.echo or self.token_ids) and not resume,
                                     chat=self.chat)


@dataclass(frozen=True)
class Batch:
    """A client request as independent jobs, one per choice: for each prompt of a batch, `n`
    samples (choice index = prompt index x n + sample). Each is relayed on its own, so each
    survives an engine's death on its own."""

    jobs: list[Job]
    n: int

    @property
    def first(self) -> Job:
        return self.jobs[0]


# --- requests ---------------------------------------------------------------------------------

STRUCTURED_FIELDS = ("response_format", "structured_outputs")
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


def parse_completion(body: dict[str, Any], backend: str = "") -> Batch:
    """A completion request; ApiError 400 naming the field."""
    try:
        return _completion(bodies.read(body, bodies.CompletionBody))
    except fields.BadField as exc:
        raise bad(exc.param, exc.message) from None


def parse_chat(body: dict[str, Any], backend: str = "") -> Batch:
    """A chat completion request; ApiError 400 naming the field. For a vLLM engine (`backend`)
    the engine reads the chat itself with vLLM's frontend (tools, tool messages, reasoning):
    only what the gateway needs is checked here."""
    frontend = backend == "vllm"
    try:
        chat = bodies.read(body, bodies.VllmChatBody if frontend else bodies.ChatBody)
        return _chat(chat, body if frontend else None)
    except fields.BadField as exc:
        raise bad(exc.param, exc.message) from None


def _completion(body: bodies.CompletionBody) -> Batch:
    model = _model(body.model)
    n = _n(body)
    for field_, ok in (("best_of", (None, 1, n)), ("suffix", (None, ""))):
        if getattr(body, field_) not in ok:
            raise bad(field_, f"'{field_}' is not supported")
    prompts = fields.prompts(body.prompt, bodies.MAX_CHOICES)
    echo = bool(body.echo)
    echo_only = echo and body.max_tokens == 0  # the prompt alone (lm-eval's scoring)
    if body.max_tokens == 0 and not echo:
        raise bad("max_tokens", "'max_tokens': expected `int` >= 1 (0 with 'echo' only)")
    logprobs, prompt_logprobs = body.logprobs, body.prompt_logprobs
    _no_prompt_logprobs_streamed(body)
    if echo and logprobs is not None:  # the echoed prompt comes with its logprobs
        prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    sampling = msgspec.structs.replace(
        fields.sampling(body, 1 if echo_only else body.max_tokens,
                        MAX_TOKENS_DEFAULT_COMPLETION, TEMPERATURE_DEFAULT),
        logprobs=logprobs, prompt_logprobs=prompt_logprobs, **_structured(body))
    jobs = [Job("completion", model, text, ids, None, seeded(sampling, j), bool(body.stream),
                _include_usage(body), logprobs, echo, echo_only,
                token_ids=bool(body.return_token_ids))
            for text, ids in prompts for j in range(n)]
    return _batch(jobs, n)


def _chat(body: bodies.ChatBody, frontend: dict[str, Any] | None) -> Batch:
    """`frontend`: the client's body, for an engine that reads the chat with vLLM's frontend."""
    model = _model(body.model)
    if frontend is not None:
        messages: list[proto.ChatMessage] = []
        if body.messages is None:
            raise bad("messages", "'messages' is required: a non-empty list of objects")
        if body.functions is not None or body.function_call is not None:
            raise bad("functions", "'functions' is OpenAI's deprecated form: send 'tools'")
    else:
        for field_ in ("tools", "functions", "tool_choice", "function_call"):
            if getattr(body, field_) not in (None, [], "none"):
                raise bad(field_, f"'{field_}' needs an engine with backend: vllm (and its "
                                  f"frontend_args tool_call_parser)")
        messages = fields.messages(body.messages)
    budget: int | None = body.max_completion_tokens
    key = "max_completion_tokens"
    if budget is None:
        budget, key = body.max_tokens, "max_tokens"
    n = _n(body)
    logprobs = _chat_logprobs(body)
    _no_prompt_logprobs_streamed(body)
    echo = body if isinstance(body, bodies.VllmChatBody) and body.echo else None
    prompt_logprobs = body.prompt_logprobs
    if echo and prompt_logprobs is None and not body.stream:  # vLLM's: echo scores the prompt
        prompt_logprobs = body.top_logprobs or 0
    sampling = msgspec.structs.replace(
        fields.sampling(body, budget, MAX_TOKENS_DEFAULT_CHAT, TEMPERATURE_DEFAULT, key),
        logprobs=logprobs, prompt_logprobs=prompt_logprobs, **_structured(body))
    echoed = _chat_echo(echo, frontend) if echo else ""
    jobs = [Job("chat", model, "", None, messages, seeded(sampling, j), bool(body.stream),
                _include_usage(body), logprobs, chat=frontend,
                token_ids=bool(body.return_token_ids), echoed=echoed)
            for j in range(n)]
    return _batch(jobs, n)


def _chat_echo(body: bodies.VllmChatBody, frontend: dict[str, Any] | None) -> str:
    """vLLM's chat `echo`: the last message's content when its role is the answer's (the
    assistant's after a generation prompt, else the last message's own), text parts joined
    by newlines."""
    if not frontend or not body.messages:
        return ""
    last = frontend["messages"][-1]
    role = "assistant" if body.add_generation_prompt is not False else last.get("role")
    content = last.get("content") if last.get("role") == role else None
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def _no_prompt_logprobs_streamed(body: bodies.CompletionBody | bodies.ChatBody) -> None:
    if body.prompt_logprobs and body.stream:  # vLLM's rule: a stream has no place for them
        raise bad("prompt_logprobs", "'prompt_logprobs' are not available when 'stream' is true")


def _structured(body: bodies.CompletionBody | bodies.ChatBody) -> dict[str, Any]:
    """response_format and vLLM's structured_outputs, checked for shape only: the vLLM backend
    reads them with vLLM's own code (a schema it cannot compile is its 400)."""
    out: dict[str, Any] = {}
    fmt = body.response_format
    if fmt is not None:
        if fmt.get("type") not in RESPONSE_FORMATS:
            raise bad("response_format", f"'response_format' must be an object whose type is "
                                         f"one of {', '.join(RESPONSE_FORMATS)}")
        if fmt["type"] == "json_schema" and not isinstance(fmt.get("json_schema"), dict):
            raise bad("response_format", "response_format of type json_schema needs "
                                         "'json_schema': {name, schema}")
        if fmt != {"type": "text"}:
            out["response_format"] = fmt
    if body.structured_outputs is not None:
        out["structured_outputs"] = body.structured_outputs
    return out


def check_backend(batch: Batch, backend: str) -> None:
    """What only a vLLM engine does, refused for the others with a 400 naming the field."""
    if backend == "vllm":
        return
    sampling = batch.first.sampling
    for name in STRUCTURED_FIELDS:
        if getattr(sampling, name) is not None:
            raise bad(name, f"'{name}' (structured outputs) needs an engine with backend: "
                            f"vllm; this model's engines are {backend}")


def _chat_logprobs(body: bodies.ChatBody) -> int | None:
    """Chat's `logprobs: true` with `top_logprobs` N (0 by default), as the top count."""
    top = body.top_logprobs
    if top is not None and top > 0 and not body.logprobs:
        raise bad("top_logprobs", "when using 'top_logprobs', 'logprobs' must be set to true")
    return (top or 0) if body.logprobs else None


def _n(body: bodies.CompletionBody | bodies.ChatBody) -> int:
    n = body.n or 1
    if n > 1 and body.temperature == 0:
        raise bad("n", f"n must be 1 when using greedy sampling, got {n}")  # vLLM's rule
    return n


def _batch(jobs: list[Job], n: int) -> Batch:
    if len(jobs) > bodies.MAX_CHOICES:
        raise bad("n", f"a request makes at most {bodies.MAX_CHOICES} choices (prompts x n), got "
                       f"{len(jobs)}")
    return Batch(jobs, n)


def seeded(sampling: proto.Sampling, j: int) -> proto.Sampling:
    """The j-th of n samples: its own seed (seed + j) when the request has one, so the n are
    different and each is reproducible."""
    if j == 0 or sampling.seed is None:
        return sampling
    return msgspec.structs.replace(sampling, seed=(sampling.seed + j) % fields.SEED_RANGE)


def _model(model: str | None) -> str:
    if not model:
        raise bad("model", "'model' is required: one of GET /v1/models")
    return model


def _include_usage(body: bodies.CompletionBody | bodies.ChatBody) -> bool:
    options = body.stream_options
    return bool(options is not None and options.include_usage)


# --- answers ----------------------------------------------------------------------------------
# Every field vLLM's server answers with, in its order, with vLLM's values where engined knows
# them and vLLM's null where vLLM gives null (ids on request, KV transfer, routed experts,
# metrics, reasoning, tool calls' and audio's fields: nothing engined's own engines produce).

StopReason = int | str | None  # what ended a choice: its stop string, stop token id, or None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def json(self) -> dict[str, Any]:
        """A whole answer's usage, as vLLM's: the details null (no cached-prompt counts)."""
        return {**self.stream_json(), "prompt_tokens_details": None,
                "completion_tokens_details": None}

    def stream_json(self) -> dict[str, Any]:
        """A stream's usage chunk's: vLLM leaves its null fields out there."""
        return {"prompt_tokens": self.prompt_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "completion_tokens": self.completion_tokens}


def fingerprint(spec_key: str) -> str:
    """`system_fingerprint`: which server and backend configuration answered, as vLLM's
    (`vllm-<version>-<hash8>` of its config) is: engined's version and a hash of what decides the
    answers (model, dtype, backend, engine_args, interpreter), stable while they are."""
    return f"engined-{__version__}-{hashlib.sha256(spec_key.encode()).hexdigest()[:8]}"


LOGPROB_FLOOR = -9999.0  # what OpenAI's JSON shows for an impossible token (vLLM's clamp)


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR) if value == value else LOGPROB_FLOOR  # NaN: the floor


@dataclass
class Echoed:
    """What one choice has said so far: its text, and its tokens' logprobs (with `echo`, the
    prompt's first)."""

    text: str = ""
    positions: list[proto.Position] | None = None
    prompt: proto.PromptEcho | None = None
    message: dict[str, Any] | None = None  # a chat the engine read itself: its message
    token_ids: list[int] | None = None  # its tokens' ids (return_token_ids)


@dataclass(frozen=True)
class Ending:
    """How a choice ended: OpenAI's finish_reason, and vLLM's stop_reason (the stop string or
    stop token id that ended it; None at the end of sequence, max_tokens, ...)."""

    finish_reason: str
    stop_reason: StopReason = None


class Logprobs:
    """One choice's logprobs in OpenAI's shapes, as vLLM answers them: completions' tokens,
    token_logprobs, top_logprobs (the token, then the top N) and text_offset (continuing over a
    stream's chunks); chat's content list (the first N of the position)."""

    def __init__(self, job: Job) -> None:
        self.chat, self.top = job.kind == "chat", job.logprobs or 0
        self.offset = 0

    def render(self, positions: list[proto.Position]) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._chat(p) for p in positions]}
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for position in positions:
            head = position[0] if position else None
            token = head.token if head is not None else ""
            tokens.append(token)
            if head is None or head.rank == 0:  # the prompt's first token: nothing before it
                values.append(None)
                tops.append(None)
            else:
                values.append(_logprob(head.logprob))
                tops.append({e.token: _logprob(e.logprob) for e in position[:self.top + 1]})
            offsets.append(self.offset)
            self.offset += len(token)
        return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens,
                "top_logprobs": tops}

    def _chat(self, position: proto.Position) -> dict[str, Any]:
        head = position[0] if position else proto.TokenLogprob(0, LOGPROB_FLOOR, 0, "")
        entry = _chat_token(head)
        entry["top_logprobs"] = [_chat_token(e) for e in position[:self.top]]
        return entry


def _chat_token(entry: proto.TokenLogprob) -> dict[str, Any]:
    return {"token": entry.token, "logprob": _logprob(entry.logprob),
            "bytes": list(entry.token.encode("utf-8", errors="replace"))}


def prompt_logprobs_json(prompt: proto.PromptEcho | None) -> list[Any] | None:
    """vLLM's `prompt_logprobs` field: per prompt position None (the first) or
    {token id: {logprob, rank, decoded_token}}."""
    if prompt is None or prompt.logprobs is None:
        return None
    return [None if not p or p[0].rank == 0 else
            {str(e.token_id): {"logprob": _logprob(e.logprob), "rank": e.rank,
                               "decoded_token": e.token} for e in p} for p in prompt.logprobs]


class Answer:
    """Builds one request's OpenAI answer, as vLLM's server shapes it: the whole one, or its SSE
    chunks (a choice's last token comes with its finish_reason; chat opens each choice with
    its role; only a stream's last event carries system_fingerprint)."""

    def __init__(self, job: Job, request_id: str, system_fingerprint: str | None = None) -> None:
        self.job = job
        self.created = int(time.time())
        prefix = "chatcmpl" if job.kind == "chat" else "cmpl"
        self.id = f"{prefix}-{request_id}"
        self.object = "chat.completion" if job.kind == "chat" else "text_completion"
        self.fingerprint = system_fingerprint

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.job.model}

    def full(self, choices: list[tuple[Echoed, Ending]], usage: Usage) -> dict[str, Any]:
        """The whole answer: (what it said, how it ended) of each choice, in index order."""
        out = []
        for index, (said, ending) in enumerate(choices):
            text, positions = self.shown(said)
            logprobs = (Logprobs(self.job).render(positions)
                        if self.job.logprobs is not None else None)
            if self.job.kind == "chat":
                message = {**_message(text), **(said.message or {})}
                if self.job.echoed:
                    message["content"] = self.job.echoed + (message["content"] or "")
                out.append({"index": index, "message": message, "logprobs": logprobs,
                            "finish_reason": ending.finish_reason,
                            "stop_reason": ending.stop_reason, "token_ids": self._ids(said),
                            "routed_experts": None})
            else:
                out.append({"index": index, "text": text, "logprobs": logprobs,
                            "finish_reason": ending.finish_reason,
                            "stop_reason": ending.stop_reason, "token_ids": self._ids(said),
                            "prompt_logprobs": prompt_logprobs_json(said.prompt),
                            "prompt_token_ids": self._prompt_ids(said.prompt),
                            "routed_experts": None})
        answer = {**self._head(self.object), "choices": out, "service_tier": None,
                  "system_fingerprint": self.fingerprint, "usage": usage.json()}
        if self.job.kind == "chat":
            prompt = choices[0][0].prompt if choices else None
            answer.update(prompt_logprobs=prompt_logprobs_json(prompt),
                          prompt_token_ids=self._prompt_ids(prompt), prompt_text=None)
        answer.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        return answer

    def shown(self, said: Echoed) -> tuple[str, list[proto.Position]]:
        """The choice's text and logprobs as the client sees them: with `echo`, the prompt's
        first (and, for max_tokens 0, only the prompt's)."""
        text, positions = ("", []) if self.job.echo_only else (said.text,
                                                               list(said.positions or []))
        if self.job.echo and self.job.kind == "completion" and said.prompt is not None:
            prompt = said.prompt
            echoed = prompt.logprobs or [[] for _ in prompt.token_ids]
            text, positions = prompt.text + text, [*echoed, *positions]
        return text, positions

    def _ids(self, said: Echoed) -> list[int] | None:
        """A choice's token ids, when the request asked for them (none for echo's prompt
        alone)."""
        if not self.job.token_ids:
            return None
        return [] if self.job.echo_only else list(said.token_ids or ())

    def _prompt_ids(self, prompt: proto.PromptEcho | None) -> list[int] | None:
        return list(prompt.token_ids) if self.job.token_ids and prompt is not None else None

    def opener(self, index: int, prompt: proto.PromptEcho | None = None) -> dict[str, Any]:
        """Chat's first event of a choice: its role, no content yet, and with
        return_token_ids the prompt's ids (vLLM's)."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice],
                "prompt_token_ids": self._prompt_ids(prompt), "prompt_text": None}

    def echo_chunk(self, index: int) -> dict[str, Any]:
        """Chat's `echo` in a stream: the echoed message after the choice's opener (vLLM's
        event, with no token_ids)."""
        choice = {"index": index, "delta": {"content": self.job.echoed}, "logprobs": None,
                  "finish_reason": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def chunk(self, text: str, index: int = 0, logprobs: dict[str, Any] | None = None,
              ending: Ending | None = None, prompt_token_ids: list[int] | None = None,
              parsed: dict[str, Any] | None = None,
              token_ids: list[int] | None = None) -> dict[str, Any]:
        """A choice's new text (and its logprobs); with `ending`, its last event, with vLLM's
        stop_reason (and system_fingerprint, unless a usage event ends the stream). A
        completion's first event with `echo` names the prompt's ids, as vLLM's does. `parsed`:
        the delta a vLLM engine's frontend made of `text` (tool calls, reasoning)."""
        choice: dict[str, Any]
        if self.job.kind == "chat":
            choice = {"index": index, "delta": {"content": text} if parsed is None
                      else dict(parsed), "logprobs": logprobs, "finish_reason": None}
            if ending is not None:
                choice.update(finish_reason=ending.finish_reason,
                              stop_reason=ending.stop_reason)
            choice["token_ids"] = token_ids if self.job.token_ids else None
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": None if ending is None else ending.finish_reason,
                      "stop_reason": None if ending is None else ending.stop_reason,
                      "prompt_token_ids": prompt_token_ids,
                      "token_ids": token_ids if self.job.token_ids else None}
            obj = "text_completion"
        out = {**self._head(obj), "choices": [choice]}
        if ending is not None and not self.job.include_usage and self.fingerprint is not None:
            out["system_fingerprint"] = self.fingerprint
        return out

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.job.kind == "chat" else "text_completion"
        out = {**self._head(obj), "choices": [], "usage": usage.stream_json()}
        if self.fingerprint is not None:
            out["system_fingerprint"] = self.fingerprint
        return out


def _message(content: str) -> dict[str, Any]:
    """A chat answer's message as vLLM's (tool_calls left out when there are none)."""
    return {"role": "assistant", "content": content, "refusal": None, "annotations": None,
            "audio": None, "function_call": None, "reasoning": None}
