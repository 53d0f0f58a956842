"""Every request body engined reads, declared once: the gateway's OpenAI routes for its own
engines (completions, chat, responses, tokenize, detokenize) and the control socket's
(`POST /v1/generate`, start/stop/restart). Types and limits are msgspec declarations, so a bad
field is refused with its path (`messages[2].content`, `stop[0]`) before anything runs; what a
type cannot say (a prompt batch's shape, Unicode, min_tokens against the budget, a seed's 64
bits) is checked where the body is read (supervisor.request_fields).

A command engine's body is not read here: its own server reads it (gateway.proxy).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta, Struct

from engined.engine.protocol import MAX_LOGPROBS

MAX_PROMPT_CHARS = 1 << 20  # characters of text, or token ids
MAX_TOKENS_LIMIT = 1 << 20
MAX_MESSAGES = 4096
MAX_STOP = 16  # stop strings (OpenAI allows 4, vLLM any number: each is checked per token)
MAX_STOP_CHARS = 1024
MAX_BIASED_TOKENS = 300  # OpenAI's limit for logit_bias
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 128  # prompts of a batch x n
MAX_WAIT_S = 86400.0
DEFAULT_WAIT_S = 120.0  # how long start, stop and restart wait for their result
GENERATE_TIMEOUT_S = 300.0

Tokens = Annotated[int, Meta(ge=1, le=MAX_TOKENS_LIMIT)]
TokenId = Annotated[int, Meta(ge=0, lt=1 << 31)]
TokenIds = Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_CHARS)]
Top = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
Text = Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
# a prompt: text, token ids, or a batch of either (msgspec holds one array type per union, so a
# batch's items are `int | str | token ids` here and their mix is refused by request_fields)
Prompt = Text | Annotated[list[int | Text | TokenIds], Meta(max_length=MAX_PROMPT_CHARS)]
Messages = Annotated[list[dict[str, Any]], Meta(min_length=1, max_length=MAX_MESSAGES)]
BiasKey = Annotated[str, Meta(pattern=r"^[0-9]{1,9}$")]


class Sampled(Struct, kw_only=True, forbid_unknown_fields=True):
    """What every generation body may say about sampling: OpenAI's fields and vLLM's extras,
    with vLLM's names. None: the route's default."""

    max_tokens: Tokens | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    seed: int | None = None  # 64 bits (msgspec bounds only int64 ranges: request_fields)
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP)] | None = None
    stream: bool | None = None
    top_k: Annotated[int, Meta(ge=-1, le=MAX_TOKENS_LIMIT)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=100.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: Annotated[dict[BiasKey, Annotated[float, Meta(ge=-100.0, le=100.0)]],
                          Meta(max_length=MAX_BIASED_TOKENS)] | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=MAX_TOKENS_LIMIT)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _OpenAI(Sampled, kw_only=True):
    """What completions and chat share beyond sampling."""

    model: str | None = None
    user: str | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] | None = None
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: Annotated[dict[str, Any], Meta(min_length=1)] | None = None
    return_token_ids: bool | None = None  # vLLM's: the prompt's and each choice's token ids
    prompt_logprobs: Top | None = None  # vLLM's: the (templated) prompt's, beside the answer


class CompletionBody(_OpenAI, kw_only=True):
    """`POST /v1/completions`."""

    prompt: Prompt | None = None
    max_tokens: Annotated[int, Meta(ge=0, le=MAX_TOKENS_LIMIT)] | None = None  # 0: echo only
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    logprobs: Top | None = None


class ChatBody(_OpenAI, kw_only=True):
    """`POST /v1/chat/completions`; `messages` are read by request_fields (or, on a vLLM engine,
    by vLLM's frontend in the engine: VllmChatBody)."""

    messages: Messages | None = None
    max_completion_tokens: Tokens | None = None
    logprobs: bool | None = None
    top_logprobs: Top | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class VllmChatBody(ChatBody, kw_only=True):
    """A chat for an engine that reads it with vLLM's own frontend: vLLM's chat fields too."""

    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    reasoning_effort: str | None = None
    echo: bool | None = None  # the answer begins with the last message, when it has the role


class ResponsesBody(Sampled, kw_only=True):
    """`POST /v1/responses` (OpenAI's Responses API), as engined's own engines serve it."""

    model: str | None = None
    user: str | None = None
    input: Text | Annotated[list[Any], Meta(min_length=1, max_length=MAX_MESSAGES)] | None = None
    instructions: Text | None = None
    max_output_tokens: Tokens | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    truncation: str | None = None
    service_tier: str | None = None
    top_logprobs: Top | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class TokenizeBody(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `POST /tokenize`: a completion's `prompt` or a chat's `messages`."""

    model: str | None = None
    prompt: Text | None = None
    messages: Messages | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False
    add_generation_prompt: bool | None = None


class DetokenizeBody(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `POST /detokenize`."""

    model: str | None = None
    tokens: TokenIds


class GenerateBody(Sampled, kw_only=True):
    """The control socket's `POST /v1/generate`: the engine protocol's request, from `prompt`
    or `messages`, on `engine` (a replica or group; any when null), within `timeout_s`."""

    prompt: Prompt | None = None
    messages: Messages | None = None
    engine: str | None = None
    timeout_s: Annotated[float, Meta(ge=0.001, le=3600.0)] = GENERATE_TIMEOUT_S


class ActionBody(Struct, kw_only=True, forbid_unknown_fields=True):
    """The control socket's start, stop and restart: wait (up to `timeout_s`) for the result;
    `all_at_once`: a group's replicas together rather than one at a time."""

    wait: bool = True
    timeout_s: Annotated[float, Meta(ge=0.0, le=MAX_WAIT_S)] = DEFAULT_WAIT_S
    all_at_once: bool = False


class UpgradeBody(Struct, kw_only=True, forbid_unknown_fields=True):
    """The control socket's `POST /v1/upgrade`: how long engines that are starting or stopping
    may take to settle before the upgrade is refused (nothing changes then)."""

    settle_s: Annotated[float, Meta(ge=0.0, le=MAX_WAIT_S)] = 30.0


class BadField(ValueError):
    """A field the request cannot have: which one (`param`) and why, for the client."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


B = TypeVar("B", bound=Struct)
_AT = re.compile(r"^(?P<why>.*) - at `(?P<key>key` in `)?\$(?P<path>[^`]*)`$", re.DOTALL)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>.*)`$", re.DOTALL)


def read(body: dict[str, Any], kind: type[B]) -> B:
    """`body` (a JSON object) as `kind`; BadField naming the field's path and what is wrong."""
    try:
        return msgspec.convert(body, kind)
    except msgspec.ValidationError as exc:
        raise bad_field(str(exc)) from None


def bad_field(error: str) -> BadField:
    """msgspec's `Expected `int` >= 1 - at `$.max_tokens`` as BadField("max_tokens", ...)."""
    found = _AT.match(error)
    why, path = (found["why"], found["path"].lstrip(".")) if found else (error, "")
    unknown = _UNKNOWN.match(why)
    if unknown:  # vLLM's words for a field it does not know
        name = f"{path}.{unknown['name']}" if path else unknown["name"]
        return BadField(name, f"unrecognized request argument supplied: {name}")
    path = path.replace("[...]", "")  # a dict value: msgspec does not name its key
    why = why[:1].lower() + why[1:].replace(" | null`", "`")  # null is every field's default
    if found and found["key"]:
        why = f"a key: {why}"
    return BadField(path or "body", f"'{path}': {why}" if path else why)
