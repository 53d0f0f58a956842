"""Process level: the request protocol every backend speaks, on real echo and tiny-llama children
driven over ZeroMQ as the daemon drives them: streaming, stop strings (across a resumed request's
seam too), chat, resume after delivered tokens, aborts, sampling, rejected requests."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from engined.engine import protocol as proto
from testkit.enginechild import LOAD_TIMEOUT_S, Channels, Engine, spawn_engine


def _start(channels: Channels, cache: Path, children: list, model: str,
           env: dict[str, str] | None = None) -> Engine:
    proc = spawn_engine(channels, cache, model, extra_env=env)
    children.append(proc)
    identity, _ = channels.wait_ready(LOAD_TIMEOUT_S)
    return Engine(channels, identity)


def _req(rid: str, prompt: str = "", **kwargs: Any) -> proto.GenerateRequest:
    sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in proto.Sampling.__struct_fields__}
    return proto.GenerateRequest(rid, prompt, sampling=proto.Sampling(**sampling), **kwargs)


# --- echo: the exact oracle -------------------------------------------------------------------

@pytest.fixture
def echo(channels: Channels, tiny_cache: Path, children) -> Engine:
    return _start(channels, tiny_cache, children, "builtin:echo",
                  {"ENGINED_ECHO_TOKEN_MS": "30"})


def test_streaming_delivers_tokens_before_the_request_ends(echo: Engine):
    echo.send(_req("s", "abcdefghij", max_tokens=32, stream=True))
    result = echo.result("s")
    chunks = echo.chunks("s")
    assert "".join(c.text for _, c in chunks) + result.text == "abcdefghij"
    assert [i for _, c in chunks for i in c.token_ids] + result.token_ids == \
        [ord(c) for c in "abcdefghij"]
    final_at = next(t for t, m in echo.events["s"] if m is result)
    assert len(chunks) >= 5 and chunks[0][0] < final_at - 0.1  # one token per 30 ms step
    assert (result.finish_reason, result.prompt_tokens, result.completion_tokens) == (
        "stop", 10, 10)


def test_max_tokens_ends_with_length_and_usage(echo: Engine):
    echo.send(_req("n", "abcdefghij", max_tokens=4))
    result = echo.result("n")
    assert (result.text, result.token_ids, result.finish_reason) == (
        "abcd", [97, 98, 99, 100], "length")
    assert (result.prompt_tokens, result.completion_tokens) == (10, 4)
    assert echo.chunks("n") == []  # not streamed: one result


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_text_before_it(echo: Engine, stream: bool):
    echo.send(_req("x", "hello world, bye", max_tokens=64, stop=["wor", "zzz"], stream=stream))
    result = echo.result("x")
    assert result.finish_reason == "stop"
    assert (echo.text("x") if stream else result.text) == "hello "
    for _, chunk in echo.chunks("x"):  # a prefix of the stop string was never sent
        assert "w" not in chunk.text


def test_a_resumed_request_continues_after_the_delivered_tokens(echo: Engine):
    delivered = [ord(c) for c in "abc"]
    echo.send(_req("r", "abcdefg", max_tokens=5, resume=delivered))
    result = echo.result("r")
    assert (result.text, result.finish_reason) == ("de", "length")
    assert (result.prompt_tokens, result.completion_tokens) == (7, 5)  # usage: the whole request


def test_a_stop_string_spanning_the_resume_seam_is_caught(echo: Engine):
    echo.send(_req("seam", "abcdef", max_tokens=10, stop=["cd"], resume=[97, 98, 99],
                   stream=True))
    result = echo.result("seam")
    assert (echo.text("seam"), result.finish_reason) == ("", "stop")


def test_chat_messages_go_through_the_template(echo: Engine):
    echo.send(proto.GenerateRequest("c", messages=[proto.ChatMessage("system", "be brief"),
                                                   proto.ChatMessage("user", "hi there")],
                                    sampling=proto.Sampling(max_tokens=32)))
    assert echo.result("c").text == "hi there"  # echo's template: the last message


def test_an_aborted_request_gets_nothing_more(echo: Engine):
    echo.send(_req("long", "x" * 200, max_tokens=200, stream=True))
    deadline = time.monotonic() + 30
    while not echo.chunks("long"):
        assert time.monotonic() < deadline
        echo.pump(1.0)
    echo.send(proto.Abort("long"))
    echo.send(_req("after", "ok", max_tokens=4))
    echo.result("after")  # the engine went on serving
    while echo.pump(0.3):
        pass
    assert not any(isinstance(m, proto.GenerateResult) for _, m in echo.events["long"])
    assert len(echo.chunks("long")) < 150


def test_invalid_requests_are_rejected_not_crashed(echo: Engine):
    echo.send(_req("zero", "abc", max_tokens=1, resume=[97]))  # nothing left to generate
    echo.send(proto.GenerateRequest("empty", "", sampling=proto.Sampling(max_tokens=4)))
    echo.send(proto.GenerateRequest("ids", prompt_ids=[-5], sampling=proto.Sampling()))
    # sampling fields no backend can use (a daemon's doors refuse them first)
    bad = {"topk": {"top_k": -2}, "minp": {"min_p": 2.0}, "rep": {"repetition_penalty": 0.0},
           "pres": {"presence_penalty": 5.0}, "mint": {"max_tokens": 2, "min_tokens": 3},
           "bias": {"logit_bias": {3: 500.0}}, "stopid": {"stop_token_ids": [-1]}}
    for rid, fields in bad.items():
        echo.send(_req(rid, "abc", **fields))
    for rid in ("zero", "empty", "ids", *bad):
        result = echo.result(rid)
        assert result.rejected and result.error and result.finish_reason == "error", result
    echo.send(_req("fine", "still serving", max_tokens=64))
    assert echo.result("fine").text == "still serving"


# --- tiny-llama: the transformers backend -----------------------------------------------------

@pytest.fixture
def tiny(channels: Channels, tiny_cache: Path, children) -> Engine:
    return _start(channels, tiny_cache, children, "builtin:tiny-llama")


def test_hf_streams_resumes_from_token_ids_and_reproduces_seeded_samples(tiny: Engine):
    tiny.send(_req("full", "hello engined", max_tokens=16, stream=True))
    full = tiny.result("full")
    ids = [i for _, c in tiny.chunks("full") for i in c.token_ids] + full.token_ids
    assert len(ids) == full.completion_tokens > 4 and len(tiny.chunks("full")) >= 2
    # greedy, resumed after 5 delivered ids: exactly the rest of the uninterrupted run
    tiny.send(_req("rest", "hello engined", max_tokens=16, resume=ids[:5]))
    rest = tiny.result("rest")
    assert rest.token_ids == ids[5:] and rest.completion_tokens == full.completion_tokens
    # a seeded sample is reproducible on one engine
    for rid in ("s1", "s2"):
        tiny.send(_req(rid, "hello engined", max_tokens=12, temperature=0.9, seed=7))
    assert tiny.result("s1").token_ids == tiny.result("s2").token_ids
    # a chat through the checkpoint's own template
    tiny.send(proto.GenerateRequest("chat", messages=[proto.ChatMessage("user", "hi")],
                                    sampling=proto.Sampling(max_tokens=8)))
    chat = tiny.result("chat")
    assert chat.error is None and chat.prompt_tokens == len("<|user|>\nhi\n<|assistant|>\n")
    # a token id outside the vocabulary is the client's error
    tiny.send(proto.GenerateRequest("bad", prompt_ids=[10**6], sampling=proto.Sampling()))
    assert tiny.result("bad").rejected
