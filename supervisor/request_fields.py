"""What a generation request asks for, read one way at both front doors: the control socket's
`POST /v1/generate` and the gateway's OpenAI routes. The same fields (a prompt, as text or token
ids, or chat messages; the token budget, temperature, top_p, seed, stop strings, stream), the
same limits and the same messages; each door keeps only its defaults (the control socket is
greedy with 64 tokens, OpenAI's completions sample with 16) and how it answers a `BadField`.
"""

from __future__ import annotations

from typing import Any

from engined.engine import protocol as proto

MAX_PROMPT_CHARS = 1 << 20  # characters of text, or token ids
MAX_TOKENS_LIMIT = 1 << 20
MAX_MESSAGES = 4096
MAX_STOP = 16  # stop strings (OpenAI allows 4, vLLM any number: each is checked per token)
MAX_STOP_CHARS = 1024
SEED_RANGE = 2**63  # what the engines take; OpenAI's int64 seeds are folded into it
ROLES = ("system", "developer", "user", "assistant")  # developer: OpenAI's newer "system"


class BadField(ValueError):
    """A field the request cannot have: which one (`param`) and why, for the client."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


def prompt(value: Any) -> tuple[str, list[int] | None]:
    """(text, None) or ("", token ids). A batch of one prompt is that prompt."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str) and value:
        text(value, "prompt")
        return value, None
    if isinstance(value, list) and value and all(type(i) is int for i in value):
        if len(value) > MAX_PROMPT_CHARS or any(i < 0 for i in value):
            raise BadField("prompt", f"'prompt' token ids must be at most {MAX_PROMPT_CHARS} "
                                     f"non-negative integers")
        return "", list(value)
    if isinstance(value, list) and len(value) > 1:
        raise BadField("prompt", "a batch of prompts is not supported: send one request per "
                                 "prompt")
    raise BadField("prompt", "'prompt' must be a non-empty string or a list of token ids")


def prompts(value: Any, limit: int) -> list[tuple[str, list[int] | None]]:
    """A prompt, or a batch of them (strings, or lists of token ids): each as `prompt` reads it."""
    if isinstance(value, list) and len(value) > 1 and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(type(t) is int for t in p))
            for p in value):
        if len(value) > limit:
            raise BadField("prompt", f"a batch of at most {limit} prompts")
        out = []
        for item in value:
            try:
                out.append(prompt(item if isinstance(item, str) else [item]))
            except BadField as exc:
                raise BadField("prompt", f"in a batch: {exc.message}") from None
        return out
    return [prompt(value)]


def text(value: str, param: str) -> str:
    if len(value) > MAX_PROMPT_CHARS:
        raise BadField(param, f"'{param}' must be at most {MAX_PROMPT_CHARS} characters")
    if not is_unicode(value):
        raise BadField(param, f"'{param}' must be valid Unicode (JSON allows lone surrogate "
                              f"escapes such as \\ud800; text cannot hold them)")
    return value


def messages(value: Any) -> list[proto.ChatMessage]:
    """A chat: [{role, content}], content as text or OpenAI's text parts."""
    if not isinstance(value, list) or not value or len(value) > MAX_MESSAGES:
        raise BadField("messages", f"'messages' must be a non-empty list (at most "
                                   f"{MAX_MESSAGES})")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadField(f"messages[{i}].role", f"messages[{i}] must have a role: system, "
                                                  f"user or assistant")
        content = message.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise BadField(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadField(f"messages[{i}].content", f"messages[{i}].content must be text")
        text(content, f"messages[{i}].content")
        role = "system" if message["role"] == "developer" else message["role"]
        out.append(proto.ChatMessage(role, content))
    return out


# vLLM's sampling fields beyond OpenAI's, with its names (the engine protocol's Sampling)
SAMPLING_FIELDS = ("top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "logit_bias", "min_tokens", "ignore_eos",
                   "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens")
MAX_BIASED_TOKENS = 300  # OpenAI's limit for logit_bias
MAX_STOP_TOKEN_IDS = 64


def sampling(body: dict[str, Any], max_tokens_key: str, max_tokens_default: int,
             temperature_default: float) -> proto.Sampling:
    budget = max_tokens(body, max_tokens_key, max_tokens_default)
    least = integer(body, "min_tokens", 0, 0, MAX_TOKENS_LIMIT)
    if least > budget:
        raise BadField("min_tokens", f"'min_tokens' ({least}) must not exceed "
                                     f"'{max_tokens_key}' ({budget})")
    return proto.Sampling(
        max_tokens=budget,
        temperature=number(body, "temperature", temperature_default, 0.0, 2.0),
        top_p=number(body, "top_p", 1.0, 1e-9, 1.0), seed=seed(body), stop=stop(body),
        top_k=top_k(body), min_p=number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=number(body, "repetition_penalty", 1.0, 1e-9, 100.0),
        presence_penalty=number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=logit_bias(body), min_tokens=least, ignore_eos=flag(body, "ignore_eos"),
        stop_token_ids=token_ids(body, "stop_token_ids", MAX_STOP_TOKEN_IDS),
        include_stop_str_in_output=flag(body, "include_stop_str_in_output"),
        skip_special_tokens=flag(body, "skip_special_tokens", True))


def integer(body: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadField(key, f"'{key}' must be an integer in [{low}, {high}]")
    return value


def top_k(body: dict[str, Any]) -> int:
    value = integer(body, "top_k", 0, -1, MAX_TOKENS_LIMIT)
    return 0 if value == -1 else value  # -1 and 0 both mean off (vLLM's older and newer)


def flag(body: dict[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadField(key, f"'{key}' must be true or false")
    return value


def logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's {"token id": bias}: ids as strings (JSON keys), biases in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    out: dict[int, float] = {}
    if isinstance(value, dict) and len(value) <= MAX_BIASED_TOKENS:
        for key, bias in value.items():
            if not (isinstance(key, str) and key.isdigit() and len(key) <= 9) or isinstance(
                    bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                break
            out[int(key)] = float(bias)
        else:
            return out
    raise BadField("logit_bias", f"'logit_bias' must map at most {MAX_BIASED_TOKENS} token ids "
                                 f"to numbers in [-100, 100]")


def token_ids(body: dict[str, Any], key: str, limit: int) -> list[int]:
    value = body.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > limit or not all(
            type(t) is int and 0 <= t < 1 << 31 for t in value):
        raise BadField(key, f"'{key}' must be a list of at most {limit} token ids")
    return list(value)


def max_tokens(body: dict[str, Any], key: str, default: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 1 <= value <= MAX_TOKENS_LIMIT:
        raise BadField(key, f"'{key}' must be an integer in [1, {MAX_TOKENS_LIMIT}]")
    return value


def number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadField(key, f"'{key}' must be a number in [{low:g}, {high:g}]")
    return float(value)


def seed(body: dict[str, Any]) -> int | None:
    value = body.get("seed")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) \
            or not -SEED_RANGE <= value < SEED_RANGE:
        raise BadField("seed", "'seed' must be a 64-bit integer or null")
    return value % SEED_RANGE


def stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    found = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(found, list) or len(found) > MAX_STOP or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS and is_unicode(s)
            for s in found):
        raise BadField("stop", f"'stop' must be a string or a list of at most {MAX_STOP} "
                               f"non-empty strings")
    return found


def stream(body: dict[str, Any]) -> bool:
    value = body.get("stream", False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadField("stream", "'stream' must be true or false")
    return value


def is_unicode(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
