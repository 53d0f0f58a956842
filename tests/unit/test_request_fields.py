"""One reading of a generation request's fields for both front doors (the control socket's
POST /v1/generate and the gateway's OpenAI routes): the same limits and messages, as a table."""

from __future__ import annotations

from typing import Any

import pytest

from engined.supervisor import request_fields as fields
from engined.supervisor.control import generate_request
from engined.supervisor.gateway.openai import ApiError, parse_completion

BIG = fields.MAX_PROMPT_CHARS + 1


@pytest.mark.parametrize("body, param, fragment", [
    ({}, "prompt", "'prompt' must be a non-empty string or a list of token ids"),
    ({"prompt": ""}, "prompt", "'prompt' must be a non-empty string"),
    ({"prompt": "x" * BIG}, "prompt", f"at most {fields.MAX_PROMPT_CHARS} characters"),
    ({"prompt": "\ud800"}, "prompt", "valid Unicode"),
    ({"prompt": [1, -1]}, "prompt", "non-negative integers"),
    ({"prompt": ["a", "b"]}, "prompt", "a batch of prompts is not supported"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "'max_tokens' must be an integer"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens", "'max_tokens' must be an integer"),
    ({"prompt": "x", "temperature": 3}, "temperature", "'temperature' must be a number in"),
    ({"prompt": "x", "top_p": 0}, "top_p", "'top_p' must be a number in"),
    ({"prompt": "x", "seed": 2**63}, "seed", "'seed' must be a 64-bit integer"),
    ({"prompt": "x", "seed": True}, "seed", "'seed' must be a 64-bit integer"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop", "at most 16 non-empty strings"),
    ({"prompt": "x", "stop": [""]}, "stop", "at most 16 non-empty strings"),
    ({"prompt": "x", "stream": "yes"}, "stream", "'stream' must be true or false"),
])
def test_both_doors_refuse_the_same_fields_with_the_same_words(body: dict[str, Any], param: str,
                                                               fragment: str) -> None:
    with pytest.raises(ApiError) as gateway:
        parse_completion({"model": "m", **body})
    assert gateway.value.status == 400 and gateway.value.param == param
    assert fragment in gateway.value.message, gateway.value.message
    with pytest.raises(Exception) as control:  # aiohttp's HTTPBadRequest
        generate_request(body)
    assert getattr(control.value, "status", None) == 400
    assert control.value.reason == gateway.value.message


def test_messages_are_read_alike_and_only_the_defaults_differ() -> None:
    chat = [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
            {"role": "user", "content": "hi"}]
    messages = fields.messages(chat)
    assert [(m.role, m.content) for m in messages] == [("system", "be brief"), ("user", "hi")]
    with pytest.raises(fields.BadField, match=r"messages\[0\] must have a role"):
        fields.messages([{"role": "robot", "content": "x"}])
    control = generate_request({"prompt": "hi", "seed": -1})
    gateway = parse_completion({"model": "m", "prompt": "hi", "seed": -1})
    assert control.sampling.seed == gateway.sampling.seed == 2**63 - 1  # folded alike
    assert (control.sampling.max_tokens, control.sampling.temperature) == (64, 0.0)
    assert (gateway.sampling.max_tokens, gateway.sampling.temperature) == (16, 1.0)
