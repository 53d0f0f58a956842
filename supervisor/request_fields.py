"""What a generation request asks for, read one way at both front doors: the control socket's
`POST /v1/generate` and the gateway's OpenAI routes. Their bodies are declared once
(supervisor.bodies: types, limits, the field path of what is wrong); here is what a declaration
cannot say, and the engine protocol's request made of them: a prompt (text, token ids, or a
batch of either) or chat messages; the sampling fields with each door's defaults (the control
socket is greedy with 64 tokens, OpenAI's completions sample with 16).
"""

from __future__ import annotations

from typing import Any

from engined.engine import protocol as proto
from engined.supervisor.bodies import (
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    BadField,
    Sampled,
)

SEED_RANGE = 2**63  # what the engines take; OpenAI's int64 seeds are folded into it
ROLES = ("system", "developer", "user", "assistant")  # developer: OpenAI's newer "system"

__all__ = ["BadField", "MAX_MESSAGES", "MAX_PROMPT_CHARS", "messages", "prompt", "prompts",
           "sampling", "text"]


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


def sampling(body: Sampled, budget: int | None, default: int,
             temperature_default: float, budget_key: str = "max_tokens") -> proto.Sampling:
    """The engine protocol's sampling from a declared body: `budget` is its token budget
    (`budget_key` names it: max_tokens, max_completion_tokens, max_output_tokens), `default`
    and `temperature_default` the route's."""
    budget = default if budget is None else budget
    least = body.min_tokens or 0
    if least > budget:
        raise BadField("min_tokens", f"'min_tokens' ({least}) must not exceed "
                                     f"'{budget_key}' ({budget})")
    return proto.Sampling(
        max_tokens=budget,
        temperature=_or(body.temperature, temperature_default), top_p=_or(body.top_p, 1.0),
        seed=seed(body.seed), stop=stop(body.stop),
        top_k=0 if body.top_k in (None, -1) else body.top_k,  # -1 and 0 both mean off
        min_p=_or(body.min_p, 0.0), repetition_penalty=_or(body.repetition_penalty, 1.0),
        presence_penalty=_or(body.presence_penalty, 0.0),
        frequency_penalty=_or(body.frequency_penalty, 0.0),
        logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
        min_tokens=least, ignore_eos=bool(body.ignore_eos),
        stop_token_ids=list(body.stop_token_ids or ()),
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        skip_special_tokens=body.skip_special_tokens is not False)


def _or(value: float | None, default: float) -> float:
    return default if value is None else float(value)


def seed(value: int | None) -> int | None:
    """OpenAI's signed 64-bit seed, folded into the engines' range."""
    if value is None:
        return None
    if not -SEED_RANGE <= value < SEED_RANGE:
        raise BadField("seed", "'seed': expected a 64-bit integer or null")
    return value % SEED_RANGE


def stop(value: str | list[str] | None) -> list[str]:
    found = [] if value is None else [value] if isinstance(value, str) else list(value)
    for i, one in enumerate(found):
        if not is_unicode(one):
            raise BadField("stop", f"'stop[{i}]' must be valid Unicode")
    return found


def is_unicode(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
