"""One reading of a generation request's fields for both front doors (the control socket's
POST /v1/generate and the gateway's OpenAI routes): bodies declared once (supervisor.bodies),
the same limits and messages, each naming the field's path, as a table."""

from __future__ import annotations

from typing import Any

import pytest

from engined.supervisor import bodies
from engined.supervisor import request_fields as fields
from engined.supervisor.control.api import generate_request
from engined.supervisor.gateway.openai import ApiError, parse_chat, parse_completion

BIG = fields.MAX_PROMPT_CHARS + 1


@pytest.mark.parametrize("body, param, fragment", [
    ({}, "prompt", "'prompt' must be a non-empty string or a list of token ids"),
    ({"prompt": ""}, "prompt", "'prompt' must be a non-empty string"),
    ({"prompt": "x" * BIG}, "prompt", f"'prompt': expected `str` of length <= {BIG - 1}"),
    ({"prompt": "\ud800"}, "prompt", "valid Unicode"),
    ({"prompt": [1, -1]}, "prompt", "non-negative integers"),
    ({"prompt": [1.5]}, "prompt[0]", "'prompt[0]': expected `int | str | array`, got `float`"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "'max_tokens': expected `int` >= 1"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens",
     "'max_tokens': expected `int`, got `float`"),
    ({"prompt": "x", "temperature": 3}, "temperature", "'temperature': expected `float` <= 2.0"),
    ({"prompt": "x", "top_p": 0}, "top_p", "'top_p': expected `float` > 0.0"),
    ({"prompt": "x", "seed": 2**63}, "seed", "'seed': expected a 64-bit integer"),
    ({"prompt": "x", "seed": True}, "seed", "'seed': expected `int`, got `bool`"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop", "'stop': expected `array` of length <= 16"),
    ({"prompt": "x", "stop": ["a", ""]}, "stop[1]", "'stop[1]': expected `str` of length >= 1"),
    ({"prompt": "x", "stop": ["a", 3]}, "stop[1]", "'stop[1]': expected `str`, got `int`"),
    ({"prompt": "x", "stream": "yes"}, "stream", "'stream': expected `bool`, got `str`"),
    ({"prompt": "x", "top_k": -2}, "top_k", "'top_k': expected `int` >= -1"),
    ({"prompt": "x", "min_p": 1.5}, "min_p", "'min_p': expected `float` <= 1.0"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "expected `float` > 0.0"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty", "expected `float` <= 2.0"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias",
     "'logit_bias': a key: expected `str` matching regex"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias",
     "'logit_bias': expected `float` <= 100.0"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens",
     "'min_tokens' (5) must not exceed 'max_tokens' (4)"),
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos", "'ignore_eos': expected `bool`"),
    ({"prompt": "x", "stop_token_ids": [2, -1]}, "stop_token_ids[1]",
     "'stop_token_ids[1]': expected `int` >= 0"),
    ({"prompt": "x", "stop_token_ids": [1] * 65}, "stop_token_ids",
     "'stop_token_ids': expected `array` of length <= 64"),
    ({"prompt": "x", "nucleus": 0.5}, "nucleus", "unrecognized request argument supplied: nucleus"),
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
    # the same words (completions may add a hint of their own: max_tokens 0 with echo)
    assert gateway.value.message.startswith(control.value.reason), control.value.reason


def test_messages_are_read_alike_and_only_the_defaults_differ() -> None:
    chat = [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
            {"role": "user", "content": "hi"}]
    messages = fields.messages(chat)
    assert [(m.role, m.content) for m in messages] == [("system", "be brief"), ("user", "hi")]
    with pytest.raises(fields.BadField, match=r"messages\[0\] must have a role"):
        fields.messages([{"role": "robot", "content": "x"}])
    control = generate_request({"prompt": "hi", "seed": -1})
    gateway = parse_completion({"model": "m", "prompt": "hi", "seed": -1}).first
    assert control.sampling.seed == gateway.sampling.seed == 2**63 - 1  # folded alike
    assert (control.sampling.max_tokens, control.sampling.temperature) == (64, 0.0)
    assert (gateway.sampling.max_tokens, gateway.sampling.temperature) == (16, 1.0)


def test_vllms_sampling_fields_reach_the_engine_protocol() -> None:
    """What vLLM's serving benchmark sends (repetition_penalty 1.0, ignore_eos) and vLLM's
    other extras are read, with vLLM's names and meanings (-1 and 0 both turn top_k off)."""
    extras = {"top_k": -1, "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.5,
              "frequency_penalty": -0.5, "logit_bias": {"7": -100}, "min_tokens": 2,
              "ignore_eos": True, "stop_token_ids": [2, 3]}
    job = parse_completion({"model": "m", "prompt": "hi", "max_tokens": 8, **extras}).first
    control = generate_request({"prompt": "hi", "max_tokens": 8, **extras})
    for sampling in (job.sampling, control.sampling):
        assert (sampling.top_k, sampling.min_p, sampling.repetition_penalty) == (0, 0.05, 1.1)
        assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.5)
        assert sampling.logit_bias == {7: -100.0} and sampling.stop_token_ids == [2, 3]
        assert (sampling.min_tokens, sampling.ignore_eos) == (2, True)


def test_the_gateway_makes_one_job_per_choice_and_the_control_socket_one_request() -> None:
    """A batch of prompts and n samples are a job per choice (prompt index x n + sample), each
    with its own seed (seed + sample); vLLM's rule holds: no n > 1 when greedy."""
    batch = parse_completion({"model": "m", "prompt": ["ab", [5, 6]], "n": 3,
                              "temperature": 0.7, "seed": 10})
    assert batch.n == 3 and len(batch.jobs) == 6
    assert [(j.prompt, j.prompt_ids) for j in batch.jobs[::3]] == [("ab", None), ("", [5, 6])]
    assert [j.sampling.seed for j in batch.jobs] == [10, 11, 12, 10, 11, 12]
    with pytest.raises(ApiError, match="n must be 1 when using greedy sampling, got 2") as err:
        parse_completion({"model": "m", "prompt": "x", "n": 2, "temperature": 0})
    assert err.value.param == "n"
    with pytest.raises(ApiError, match="at most 128 choices"):
        parse_completion({"model": "m", "prompt": ["x"] * 65, "n": 2})
    with pytest.raises(Exception, match="a batch of prompts is not supported"):
        generate_request({"prompt": ["a", "b"]})  # the control socket: one engine request


@pytest.mark.parametrize("body, param, fragment", [
    ({"messages": []}, "messages", "'messages': expected `array` of length >= 1"),
    ({"messages": [{"role": "user", "content": "hi"}, 3]}, "messages[1]",
     "'messages[1]': expected `object`, got `int`"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "messages[0].content must be text"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"usage": True}},
     "stream_options.usage", "unrecognized request argument supplied: stream_options.usage"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21}, "top_logprobs",
     "'top_logprobs': expected `int` <= 20"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n", "'n': expected `int` >= 1"),
])
def test_a_chats_bad_field_is_named_by_its_path(body: dict[str, Any], param: str,
                                                fragment: str) -> None:
    with pytest.raises(ApiError) as raised:
        parse_chat({"model": "m", **body})
    assert (raised.value.status, raised.value.param) == (400, param)
    assert fragment in raised.value.message, raised.value.message


@pytest.mark.parametrize("body, fragment", [
    ({"wait": "yes"}, "'wait': expected `bool`, got `str`"),
    ({"timeout_s": -1}, "'timeout_s': expected `float` >= 0.0"),
    ({"timeout_s": True}, "'timeout_s': expected `float`, got `bool`"),
    ({"all_at_once": 1}, "'all_at_once': expected `bool`, got `int`"),
    ({"wiat": False}, "unrecognized request argument supplied: wiat"),
])
def test_the_control_sockets_action_bodies_are_declared_too(body: dict[str, Any],
                                                             fragment: str) -> None:
    with pytest.raises(bodies.BadField) as raised:
        bodies.read(body, bodies.ActionBody)
    assert raised.value.message == fragment
    assert bodies.read({}, bodies.ActionBody) == bodies.ActionBody(
        wait=True, timeout_s=bodies.DEFAULT_WAIT_S, all_at_once=False)
