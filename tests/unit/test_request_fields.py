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
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "'max_tokens' must be an integer"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens", "'max_tokens' must be an integer"),
    ({"prompt": "x", "temperature": 3}, "temperature", "'temperature' must be a number in"),
    ({"prompt": "x", "top_p": 0}, "top_p", "'top_p' must be a number in"),
    ({"prompt": "x", "seed": 2**63}, "seed", "'seed' must be a 64-bit integer"),
    ({"prompt": "x", "seed": True}, "seed", "'seed' must be a 64-bit integer"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop", "at most 16 non-empty strings"),
    ({"prompt": "x", "stop": [""]}, "stop", "at most 16 non-empty strings"),
    ({"prompt": "x", "stream": "yes"}, "stream", "'stream' must be true or false"),
    ({"prompt": "x", "top_k": -2}, "top_k", "'top_k' must be an integer in [-1,"),
    ({"prompt": "x", "min_p": 1.5}, "min_p", "'min_p' must be a number in [0, 1]"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "must be a number in"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty", "must be a number in [-2, 2]"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "'logit_bias' must map"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "numbers in [-100, 100]"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens",
     "'min_tokens' (5) must not exceed 'max_tokens' (4)"),
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos", "'ignore_eos' must be true or false"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids", "list of at most 64 token ids"),
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
