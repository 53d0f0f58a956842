"""End to end: the OpenAI-compatible gateway, driven by the official `openai` client: models,
completions and chat (streamed and not), usage, errors, auth, request ids, backpressure, and
requests that survive their replica's death."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import openai
import pytest

from testkit.driver import free_port, http_json

ECHO = {"name": "echo", "replicas": 2, "model": "builtin:echo",
        "env": {"ENGINED_ECHO_TOKEN_MS": "20"}}
TEXT = "the quick brown fox jumps over the lazy dog"


def _client(port: int, key: str = "none", retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key,
                         max_retries=retries, timeout=60)


@pytest.fixture
def gateway(engined):
    def start(engines=None, supervisor=None, **kwargs):
        port = free_port()
        d = engined(engines or [ECHO], supervisor={"gateway": f"127.0.0.1:{port}",
                                                   **(supervisor or {})}, **kwargs)
        d.port = port
        return d, _client(port)
    return start


# The read-only tests below share one daemon: ECHO behind the gateway, one model served.
SHARED = pytest.mark.xdist_group("gateway-shared")


@pytest.fixture(scope="module")
def shared(module_engined):
    port = free_port()
    d = module_engined([ECHO], supervisor={"gateway": f"127.0.0.1:{port}"})
    d.port = port
    return d, _client(port)


@pytest.fixture
def ready_shared(shared):
    d, client = shared
    assert d.alive(), "the module's shared daemon is gone"
    d.wait_all_ready()
    return d, client


@pytest.mark.smoke
def test_models_completions_and_chat_streamed_and_not(gateway):
    d, client = gateway([ECHO, {"name": "other", "model": "builtin:echo",
                                "served_model_name": "other-model"}])
    assert sorted(m.id for m in client.models.list()) == ["echo", "other-model"]

    done = client.completions.create(model="echo", prompt=TEXT, max_tokens=9)
    assert (done.choices[0].text, done.choices[0].finish_reason) == ("the quick", "length")
    assert (done.usage.prompt_tokens, done.usage.completion_tokens,
            done.usage.total_tokens) == (len(TEXT), 9, len(TEXT) + 9)
    assert done.object == "text_completion" and done.model == "echo"

    chunks = list(client.completions.create(model="echo", prompt=TEXT, max_tokens=100,
                                            stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(TEXT) and not chunks[-1].choices
    assert len(chunks) > 5  # tokens as they came

    chat = client.chat.completions.create(model="other-model", messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
    assert (chat.choices[0].message.role, chat.choices[0].message.content) == (
        "assistant", "hello")
    assert chat.object == "chat.completion" and chat.usage.completion_tokens == 5

    stream = list(client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "streamed chat"}], stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "streamed chat"
    assert stream[-1].choices[0].finish_reason == "stop"

    stopped = client.completions.create(model="echo", prompt=TEXT, stop=[" brown"])
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == ("the quick", "stop")
    kept = client.completions.create(model="echo", prompt=TEXT, stop=[" brown"],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == "the quick brown"


@pytest.mark.smoke
@SHARED
def test_errors_are_openai_shaped(ready_shared):
    d, client = ready_shared
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="x")
    assert err.value.code == "model_not_found" and "echo" in err.value.message
    for kwargs, param in [({"n": 2, "temperature": 0}, "n"), ({"logprobs": 21}, "logprobs"),
                          ({"max_tokens": 0}, "max_tokens"), ({"temperature": 3}, "temperature"),
                          ({"stop": ["a"] * 17}, "stop")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="echo", prompt="x", **kwargs)
        assert err.value.param == param, (kwargs, err.value.body)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert err.value.param == "tools"
    with pytest.raises(openai.BadRequestError) as err:  # structured outputs need vLLM
        client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_object"})
    assert err.value.param == "response_format" and "builtin:echo" in err.value.message
    raw = client.completions.with_raw_response.create(model="echo", prompt="id",
                                                      extra_headers={"X-Request-Id": "abc-123"})
    assert raw.headers["x-request-id"] == "abc-123"
    assert raw.parse().id == "cmpl-abc-123"
    assert d.engines()["echo-0"]["restarts"] == 0


def test_a_bearer_token_from_api_key_file_reread_on_reload(gateway, short_tmp: Path):
    key = short_tmp / "api-key"
    key.write_text("s3cret\n")
    d, anonymous = gateway(supervisor={"api_key_file": str(key)})
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    assert [m.id for m in _client(d.port, "s3cret").models.list()] == ["echo"]
    key.write_text("rotated\n")
    assert d.ctl("reload").returncode == 0
    with pytest.raises(openai.AuthenticationError):
        _client(d.port, "s3cret").models.list()
    done = _client(d.port, "rotated").completions.create(model="echo", prompt="ok")
    assert done.choices[0].text == "ok"


def test_a_full_queue_is_429_with_retry_after(gateway):
    slow = {**ECHO, "replicas": 1, "queue_limit": 1, "env": {"ENGINED_ECHO_TOKEN_MS": "100"}}
    d, client = gateway([slow])
    first = threading.Thread(target=lambda: client.completions.create(
        model="echo", prompt="x" * 30, max_tokens=30), daemon=True)
    first.start()
    d.wait_for(lambda: (d.engine("echo-0")["queue"] or {}).get("running") == 1, 10,
               "the first request running")
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model="echo", prompt="second")
    assert err.value.response.headers["retry-after"] == "1"
    first.join(timeout=60)


def test_no_replica_in_time_is_503(gateway):
    d, client = gateway([{**ECHO, "replicas": 1, "request_timeout": "1s"}])
    assert d.ctl("stop", "echo").returncode == 0
    began = time.monotonic()
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model="echo", prompt="anyone?")
    assert err.value.status_code == 503 and err.value.response.headers["retry-after"]
    # not before its request_timeout (exactly at it: tests/lifecycle/test_timing_pins.py
    # test_no_routable_replica_is_503_exactly_at_the_deadline)
    assert time.monotonic() - began >= 1.0


def _idle(d) -> None:
    """Until no replica is still counted as running an earlier request (heartbeats lag), so
    that `_serving` finds the next one's replica."""
    d.wait_for(lambda: not any((e["queue"] or {}).get("running") for e in d.engines().values()),
               10, "no replica still counted as running")


def _serving(d) -> str:
    """The replica a single request in flight is running on."""
    def find() -> str | None:
        running = [n for n, e in d.engines().items() if (e["queue"] or {}).get("running")]
        return running[0] if len(running) == 1 else None
    return d.wait_for(find, 10, "one replica running the request")


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP])
def test_a_stream_whose_replica_dies_goes_on_elsewhere(gateway, fault):
    slow = {**ECHO, "env": {"ENGINED_ECHO_TOKEN_MS": "60"}, "stop_timeout": "2s"}
    d, client = gateway([slow])
    stream = client.completions.create(model="echo", prompt=TEXT, max_tokens=100, stream=True,
                                       stream_options={"include_usage": True})
    chunks, killed = [], None
    for chunk in stream:
        chunks.append(chunk)
        if killed is None and sum(len(c.choices[0].text) for c in chunks if c.choices) >= 5:
            killed = _serving(d)
            os.kill(d.engine(killed)["pid"], fault)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == TEXT  # identical to the answer without a fault
    assert chunks[-1].usage.prompt_tokens == len(TEXT)
    assert chunks[-1].usage.completion_tokens == len(TEXT)
    d.wait_for(lambda: d.engine(killed)["restarts"] == 1, 30, f"{killed} restarted")
    assert "moving it" in d.stderr_text()
    port = d.port
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10):
        pass


def test_a_request_whose_replica_dies_before_its_first_token_is_resent(gateway):
    slow = {**ECHO, "replicas": 2,
            "env": {"ENGINED_ECHO_TOKEN_MS": "40", "ENGINED_FAULT_INJECTION": "1"}}
    d, client = gateway([slow])
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(done=client.completions.create(
        model="echo", prompt=TEXT, max_tokens=100)), daemon=True)
    worker.start()
    victim = _serving(d)
    os.kill(d.engine(victim)["pid"], signal.SIGKILL)
    worker.join(timeout=60)
    assert result["done"].choices[0].text == TEXT  # not streamed: the client saw nothing


def test_gateway_metrics(gateway):
    port = free_port()
    d, client = gateway(supervisor={"http": f"127.0.0.1:{port}"})
    client.completions.create(model="echo", prompt="counted")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="echo", prompt="x", logprobs=30)
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'engined_gateway_requests_total{model="echo",outcome="ok"} 1.0' in text
    assert 'engined_gateway_migrations_total{model="echo"} 0.0' in text
    assert 'engined_gateway_time_to_first_token_seconds_count{model="echo"} 1.0' in text
    assert 'engined_gateway_request_duration_seconds_bucket{le="+Inf",model="echo"}' in text


def test_a_batch_of_prompts_and_n_samples_are_choices_and_each_survives_a_death(gateway):
    """prompt: [a, b] with n = 2 is four choices (prompt index x n + sample), answered whole or
    streamed; each choice is its own engine request, so a replica's death mid-stream moves only
    what ran there, and every choice still ends exactly as without the fault."""
    slow = {**ECHO, "env": {"ENGINED_ECHO_TOKEN_MS": "60"}, "stop_timeout": "2s"}
    d, client = gateway([slow])
    prompts = ["first prompt of the batch", "the second one, a little longer"]
    done = client.completions.create(model="echo", prompt=prompts, n=2, max_tokens=200)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    assert [c.text for c in done.choices] == [prompts[0]] * 2 + [prompts[1]] * 2
    assert done.usage.prompt_tokens == sum(len(p) for p in prompts)  # each prompt once
    assert done.usage.completion_tokens == 2 * sum(len(p) for p in prompts)

    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    killed = None
    for chunk in client.completions.create(model="echo", prompt=prompts, n=2, max_tokens=200,
                                           stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
        if killed is None and sum(map(len, texts.values())) >= 20:
            killed = d.wait_for(lambda: next((n for n, e in d.engines().items() if (
                e.get("queue") or {}).get("running")), None), 10, "a replica running a choice")
            os.kill(d.engine(killed)["pid"], signal.SIGKILL)
        if chunk.usage:
            usage = chunk.usage
    assert texts == {0: prompts[0], 1: prompts[0], 2: prompts[1], 3: prompts[1]}
    assert finishes == {i: "stop" for i in range(4)}
    assert usage.completion_tokens == 2 * sum(len(p) for p in prompts)
    assert killed is not None and "moving it" in d.stderr_text()

    chat = client.chat.completions.create(model="echo", n=3, messages=[
        {"role": "user", "content": "say this"}])
    assert [(c.index, c.message.content) for c in chat.choices] == [
        (0, "say this"), (1, "say this"), (2, "say this")]


def test_logprobs_and_echo_as_vllm_answers_them_and_kept_across_a_death(gateway):
    """Completions' logprobs (the token, then the top N), echo with the prompt's logprobs (its
    first position has none), max_tokens 0 with echo (lm-eval's scoring request), chat's
    logprobs and top_logprobs; a stream whose replica is SIGKILLed goes on with one logprob per
    token, none repeated, its text offsets continuous (builtin:echo is certain of each next
    character: logprob 0, the code points after it at the floor)."""
    slow = {**ECHO, "env": {"ENGINED_ECHO_TOKEN_MS": "30"}, "stop_timeout": "2s"}
    d, client = gateway([slow])
    done = client.completions.create(model="echo", prompt="abc", max_tokens=3, logprobs=2)
    lp = done.choices[0].logprobs
    assert (lp.tokens, lp.token_logprobs, lp.text_offset) == (["a", "b", "c"], [0.0] * 3,
                                                                [0, 1, 2])
    assert lp.top_logprobs[0] == {"a": 0.0, "b": -9999.0}

    echoed = client.completions.create(model="echo", prompt="xyz", max_tokens=2, echo=True,
                                       logprobs=0)
    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text == "xyzxy"
    assert lp.tokens == list("xyzxy") and lp.token_logprobs == [None, 0.0, 0.0, 0.0, 0.0]
    assert lp.top_logprobs[0] is None and lp.text_offset == [0, 1, 2, 3, 4]
    scored = client.completions.create(model="echo", prompt="xyz", max_tokens=0, echo=True,
                                       logprobs=1, temperature=0)
    assert (scored.choices[0].text, scored.choices[0].logprobs.tokens) == ("xyz", list("xyz"))

    chat = client.chat.completions.create(model="echo", messages=[
        {"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [(c.token, c.logprob, c.bytes) for c in content] == [("h", 0.0, [104]),
                                                                ("i", 0.0, [105])]
    assert [t.token for t in content[0].top_logprobs] == ["h", "i"]

    tokens, offsets, killed = [], [], None
    _idle(d)
    for chunk in client.completions.create(model="echo", prompt=TEXT, max_tokens=100,
                                           logprobs=1, echo=True, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                offsets += choice.logprobs.text_offset
        if killed is None and len(tokens) >= len(TEXT) + 5:
            killed = _serving(d)
            os.kill(d.engine(killed)["pid"], signal.SIGKILL)
    assert "".join(tokens) == TEXT + TEXT  # the prompt once, then each token once
    assert offsets == list(range(2 * len(TEXT)))
    assert killed is not None and "moving it" in d.stderr_text()

    # vLLM's prompt_logprobs: the prompt's logprobs beside the answer, not in its text; a stream
    # has no place for them (vLLM's 400)
    prompted = client.completions.create(model="echo", prompt="xyz", max_tokens=2,
                                         extra_body={"prompt_logprobs": 1})
    assert prompted.choices[0].text == "xy", prompted
    assert prompted.choices[0].prompt_logprobs == [None, *(  # the token is the top 1
        {str(ord(c)): {"logprob": 0.0, "rank": 1, "decoded_token": c}} for c in "yz")]
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model="echo", prompt="xyz", max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    # and a chat's: its templated prompt's (echo's "template" is the last message)
    chatted = client.chat.completions.create(model="echo", messages=[
        {"role": "user", "content": "hi"}], extra_body={"prompt_logprobs": 0}).model_dump()
    assert chatted["prompt_logprobs"] == [None, {"105": {"logprob": 0.0, "rank": 1,
                                                         "decoded_token": "i"}}], chatted


def test_return_token_ids_as_vllm_answers_them_and_kept_across_a_death(gateway):
    """vLLM's return_token_ids on engined's own engines: the prompt's ids and each choice's,
    whole and streamed, completions and chat (builtin:echo's ids are code points); a stream whose
    replica is SIGKILLed goes on with each id once, none repeated."""
    slow = {**ECHO, "env": {"ENGINED_ECHO_TOKEN_MS": "30"}, "stop_timeout": "2s"}
    d, client = gateway([slow])
    ids = {"return_token_ids": True}
    done = client.completions.create(model="echo", prompt="abc", max_tokens=3, extra_body=ids)
    choice = done.choices[0].model_dump()
    assert (choice["text"], choice["token_ids"], choice["prompt_token_ids"]) == (
        "abc", [97, 98, 99], [97, 98, 99])
    plain = client.completions.create(model="echo", prompt="abc", max_tokens=3)
    assert plain.choices[0].model_dump()["token_ids"] is None  # only when asked
    chat = client.chat.completions.create(model="echo", messages=[
        {"role": "user", "content": "hi"}], extra_body=ids).model_dump()
    assert (chat["prompt_token_ids"], chat["choices"][0]["token_ids"]) == ([104, 105],
                                                                           [104, 105])
    events = [c.model_dump() for c in client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "hi"}], stream=True,
        extra_body=ids)]
    assert events[0]["prompt_token_ids"] == [104, 105]  # the opener's, as vLLM's
    assert [t for e in events for c in e["choices"] for t in c.get("token_ids") or ()] == [
        104, 105]

    prompt, got, killed = None, [], None
    _idle(d)
    for chunk in client.completions.create(model="echo", prompt=TEXT, max_tokens=100,
                                           stream=True, extra_body=ids):
        for c in chunk.model_dump()["choices"]:
            prompt = prompt or c.get("prompt_token_ids")
            got += c.get("token_ids") or []
        if killed is None and len(got) >= 5:
            killed = _serving(d)
            os.kill(d.engine(killed)["pid"], signal.SIGKILL)
    assert prompt == [ord(c) for c in TEXT] and got == prompt  # each id once, across the move
    assert killed is not None and "moving it" in d.stderr_text()


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    return http_json("POST", f"http://127.0.0.1:{port}{path}", body)


@SHARED
def test_tokenize_and_detokenize_with_the_engines_own_tokenizer(ready_shared):
    """vLLM's /tokenize (a prompt or a chat, token strings if asked) and /detokenize, answered
    by an engine of the model (builtin:echo: a token is a code point); `model` may be left out
    when one model is served; bad input is a 400 naming the field."""
    d, client = ready_shared
    assert _post(d.port, "/tokenize", {"model": "echo", "prompt": "hé"}) == (
        200, {"count": 2, "max_model_len": 1 << 20, "tokens": [104, 233], "token_strs": None})
    code, body = _post(d.port, "/tokenize", {"prompt": "ab", "return_token_strs": True})
    assert (code, body["tokens"], body["token_strs"]) == (200, [97, 98], ["a", "b"])
    code, body = _post(d.port, "/tokenize", {"model": "echo", "messages": [
        {"role": "user", "content": "hi"}]})
    assert (code, body["tokens"]) == (200, [104, 105])  # echo's "template": the last message
    assert _post(d.port, "/detokenize", {"model": "echo", "tokens": [104, 105]}) == (
        200, {"prompt": "hi"})
    for path, body, param in [("/tokenize", {"model": "echo", "prompt": 3}, "prompt"),
                              ("/detokenize", {"model": "echo", "tokens": [1, "x"]},
                               "tokens[1]"),
                              ("/tokenize", {"model": "echo", "prompt": "x", "nope": 1}, "nope")]:
        code, answer = _post(d.port, path, body)
        assert (code, answer["error"]["param"]) == (400, param), (path, answer)
    code, answer = _post(d.port, "/tokenize", {"model": "nope", "prompt": "x"})
    assert code == 404 and answer["error"]["code"] == "model_not_found"


def test_the_responses_api_whole_and_streamed_and_kept_across_a_death(gateway):
    """POST /v1/responses with the official client: a string or messages with instructions in,
    one assistant message out (output_text, usage, incomplete at max_output_tokens), streamed
    as the API's events; a stream whose replica is SIGKILLed goes on, its text exact; what is
    not supported is a 400 naming the field."""
    slow = {**ECHO, "env": {"ENGINED_ECHO_TOKEN_MS": "30"}, "stop_timeout": "2s"}
    d, client = gateway([slow])
    done = client.responses.create(model="echo", input="say this back")
    assert (done.status, done.output_text, done.object) == ("completed", "say this back",
                                                             "response")
    assert (done.usage.input_tokens, done.usage.output_tokens) == (13, 13)
    short = client.responses.create(model="echo", instructions="be brief", max_output_tokens=4,
                                    input=[{"role": "user", "content": [
                                        {"type": "input_text", "text": "last words"}]}])
    assert (short.status, short.output_text) == ("incomplete", "last")
    assert short.incomplete_details.reason == "max_output_tokens"

    kinds, text, killed = [], "", None
    _idle(d)
    for event in client.responses.create(model="echo", input=TEXT, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
            if killed is None and len(text) >= 5:
                killed = _serving(d)
                os.kill(d.engine(killed)["pid"], signal.SIGKILL)
        if event.type == "response.completed":
            final = event.response
    assert text == TEXT and final.output_text == TEXT
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert killed is not None and "moving it" in d.stderr_text()
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="echo", input="x", previous_response_id="resp_1")
    assert err.value.param == "previous_response_id"


@SHARED
def test_a_request_too_large_for_the_engine_is_a_400_not_a_wait(ready_shared):
    """A body the gateway takes (8 MiB) that the engine's frame limit (4 MiB) does not: 400
    naming why at once, instead of a request the engine drops and a client that waits."""
    d, client = ready_shared
    ids = list(range(1000, 1000 + 900_000))  # ~5.4 MB of JSON, over 4 MiB as msgpack
    code, body = _post(d.port, "/v1/completions", {"model": "echo", "prompt": ids,
                                                   "max_tokens": 1})
    assert (code, body["error"]["code"]) == (400, "request_too_large"), body
    code, body = _post(d.port, "/detokenize", {"model": "echo", "tokens": ids})
    assert (code, body["error"]["code"]) == (400, "request_too_large"), body
    assert client.completions.create(model="echo", prompt="still fine").choices[0].text
    assert d.engines()["echo-0"]["restarts"] == 0
