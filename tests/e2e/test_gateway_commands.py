"""The gateway in front of command engines (servers engined did not write), driven by the
official `openai` client: the upstream's model name is rewritten, and a request whose server
dies moves to another replica: resent before its first token, continued mid-stream from the
token ids already delivered (`openai: vllm`), an error event where the server gives no ids.

The servers are testkit/commandserver.py, whose next token is a function of the whole sequence,
so a continued answer must equal the answer without a fault, character for character."""

from __future__ import annotations

import os
import signal
import socket
import threading

import openai
import psutil
import pytest

from testkit.commandserver import next_token
from testkit.driver import PYTHON, REPO_ROOT, free_port, http_json

SERVER = str(REPO_ROOT / "testkit" / "commandserver.py")
PROGRESS = {"busy": "fake:num_requests_running", "counter": "fake:generation_tokens"}
PROMPT = "a prompt for the fake server"


def expected(prompt_ids: list[int], n: int) -> str:
    sequence, out = list(prompt_ids), []
    for _ in range(n):
        token = next_token(sequence)
        sequence.append(token)
        out.append(token)
    return bytes(out).decode()


def fleet(openai_mode: object = "vllm", tick: str = "0.005", replicas: int = 2,
          **keys: object) -> list[dict[str, object]]:
    return [{"name": "fake", "replicas": replicas,
             "command": [PYTHON, SERVER, "--port", "{port}", "--tick", tick],
             "port": "auto", "openai": openai_mode, "progress": PROGRESS,
             "probe": {"interval": "200ms", "timeout": "300ms", "failures": 3},
             "stop_timeout": "2s", **keys}]


@pytest.fixture
def gateway(engined):
    def start(engines):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        d = engined(engines, supervisor={"gateway": f"127.0.0.1:{port}"})
        return d, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                max_retries=0, timeout=60)
    return start


# The read-only tests share one daemon: fleet() behind the gateway.
SHARED = pytest.mark.xdist_group("gateway-commands-shared")


@pytest.fixture(scope="module")
def shared(module_engined):
    port = free_port()
    d = module_engined(fleet(), supervisor={"gateway": f"127.0.0.1:{port}"})
    assert d.alive()
    return d, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                            max_retries=0, timeout=60)


@pytest.fixture
def ready_shared(shared):
    d, client = shared
    assert d.alive(), "the module's shared daemon is gone"
    d.wait_all_ready()
    return d, client


def serving(d) -> str:
    def find():
        busy = [n for n, e in d.engines().items() if (e.get("queue") or {}).get("running")]
        return busy[0] if len(busy) == 1 else None
    return d.wait_for(find, 15, "one replica running the request")


@pytest.mark.smoke
@SHARED
def test_completions_chat_and_models_through_a_command_engine(ready_shared):
    d, client = ready_shared
    assert [m.id for m in client.models.list()] == ["fake"]
    done = client.completions.create(model="fake", prompt=PROMPT, max_tokens=12)
    assert done.choices[0].text == expected(list(PROMPT.encode()), 12)
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(PROMPT), 12)
    assert done.model == "fake"  # the client's name, not the upstream's ("fake-model")
    chunks = list(client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=7, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected(list(b"<user>hi"), 7)
    assert chunks[-1].usage.completion_tokens == 7


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP])
def test_a_stream_whose_server_dies_continues_on_another_replica(gateway, fault):
    d, client = gateway(fleet(tick="0.03"))
    n = 80
    stream = client.completions.create(model="fake", prompt=PROMPT, max_tokens=n, stream=True,
                                       stream_options={"include_usage": True})
    chunks, victim = [], None
    for chunk in stream:
        chunks.append(chunk)
        if victim is None and sum(len(c.choices[0].text) for c in chunks if c.choices) >= 5:
            victim = serving(d)
            os.kill(d.engine(victim)["pid"], fault)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected(list(PROMPT.encode()), n)  # identical to the answer without a fault
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(PROMPT), n)
    d.wait_for(lambda: d.engine(victim)["restarts"] == 1, 30, f"{victim} restarted")
    assert "moving it" in d.stderr_text()


def test_a_chat_stream_continues_from_its_templated_prompt(gateway):
    d, client = gateway(fleet(tick="0.03"))
    n = 60
    chunks, victim = [], None
    for chunk in client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "tell me"}], max_tokens=n,
            stream=True):
        chunks.append(chunk)
        if victim is None and sum(len(c.choices[0].delta.content or "")
                                  for c in chunks if c.choices) >= 5:
            victim = serving(d)
            os.kill(d.engine(victim)["pid"], signal.SIGKILL)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected(list(b"<user>tell me"), n)


def test_a_frozen_core_under_a_gateway_request_is_a_stall_and_the_request_moves(gateway):
    d, client = gateway(fleet(tick="0.03", stall_timeout="1500ms"))
    n = 80
    chunks, victim = [], None
    for chunk in client.completions.create(model="fake", prompt=PROMPT, max_tokens=n,
                                           stream=True):
        chunks.append(chunk)
        if victim is None and len(chunks) >= 5:
            victim = serving(d)
            server = psutil.Process(d.engine(victim)["pid"])
            core = next(p for p in server.children() if "--core" in p.cmdline())
            core.send_signal(signal.SIGSTOP)  # /health stays 200: only progress tells
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected(list(PROMPT.encode()), n)
    assert d.engine(victim)["last_exit"]["reason"] == "stall"


def test_a_plain_openai_server_cannot_continue_a_stream_and_says_so(gateway):
    d, client = gateway(fleet(openai_mode=True, tick="0.03"))
    chunks, victim = [], None
    with pytest.raises(openai.APIError) as raised:
        for chunk in client.completions.create(model="fake", prompt=PROMPT, max_tokens=80,
                                               stream=True):
            chunks.append(chunk)
            if victim is None and len(chunks) >= 5:
                victim = serving(d)
                os.kill(d.engine(victim)["pid"], signal.SIGKILL)
    assert "gives no token ids" in str(raised.value)
    # before its first token, a request moves on a plain server too
    done = client.completions.create(model="fake", prompt=PROMPT, max_tokens=5)
    assert done.choices[0].text == expected(list(PROMPT.encode()), 5)


def test_a_stream_past_its_request_timeout_ends_with_a_timeout_event(gateway):
    """The deadline ends a stream mid-way: what came before reaches the client, then an error
    event with code `timeout`; the server is left serving."""
    d, client = gateway(fleet(tick="0.1", replicas=1, request_timeout="1500ms"))
    chunks = []
    with pytest.raises(openai.APIError) as raised:
        for chunk in client.completions.create(model="fake", prompt=PROMPT, max_tokens=200,
                                               stream=True):
            chunks.append(chunk)
    assert "request_timeout" in str(raised.value)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text and expected(list(PROMPT.encode()), 200).startswith(text)
    assert len(text) < 200
    done = client.completions.create(model="fake", prompt=PROMPT, max_tokens=3)
    assert done.choices[0].text == expected(list(PROMPT.encode()), 3)
    assert d.engine("fake-0")["restarts"] == 0


def test_a_command_engine_without_openai_is_not_served(gateway):
    d, client = gateway(fleet(openai_mode=False))
    assert list(client.models.list()) == []
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="fake", prompt="x", max_tokens=2)


def test_a_rolling_restart_waits_for_a_command_engines_gateway_requests(gateway):
    """The gateway reaches a command engine over HTTP, not the engine channels: the router
    counts those requests too, so `enginectl restart GROUP` lets a stream on a server finish
    before it stops that server (in the daemon's own log: the request's end, then the SIGTERM;
    nothing moved)."""
    d, client = gateway(fleet(tick="0.05", replicas=1, stop_timeout="60s"))
    old = d.engine("fake-0")["pid"]
    n = 40
    stream = client.completions.create(model="fake", prompt=PROMPT, max_tokens=n, stream=True)
    chunks, restart = [], None
    for chunk in stream:
        chunks.append(chunk)
        if restart is None:  # the request is on fake-0 now: roll the group
            serving(d)
            restart = threading.Thread(target=lambda: d.ctl("restart", "fake", "--timeout",
                                                             "120"), daemon=True)
            restart.start()
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected(list(PROMPT.encode()), n)
    assert restart is not None
    restart.join(timeout=180)
    after = d.engine("fake-0")
    assert after["pid"] != old and after["restarts_by_reason"] == {"manual": 1}, after
    log = d.stderr_text()
    assert "moving it" not in log
    finished = log.index(" /v1/completions fake ok in ")
    stopped = log.index(f"[stop] fake-0 pid {old}: SIGTERM")
    assert finished < stopped, log[finished - 200:stopped + 200]


# --- everything the server serves, passed through ---------------------------------------------

@SHARED
def test_the_clients_body_reaches_the_server_as_it_came_and_its_answer_comes_back(ready_shared):
    """The gateway reads only what it needs: every other field (vLLM's extras, n, logprobs)
    reaches the server unchanged; only the model name is the server's own, and the answer comes
    back with the client's name and whatever else the server put in it."""
    d, client = ready_shared
    extras = {"top_k": 3, "min_p": 0.1, "repetition_penalty": 1.0, "min_tokens": 2,
              "ignore_eos": True, "stop_token_ids": [0], "logit_bias": {"97": 5}}
    done = client.completions.create(model="fake", prompt=PROMPT, max_tokens=4, n=2,
                                     logprobs=2, presence_penalty=0.5, extra_body=extras)
    got = done.model_extra["fake_received"]
    assert got == {"model": "fake-model", "prompt": PROMPT, "max_tokens": 4, "n": 2,
                   "logprobs": 2, "presence_penalty": 0.5, **extras}, got
    assert done.model == "fake" and [c.index for c in done.choices] == [0, 1]
    assert {c.text for c in done.choices} == {expected(list(PROMPT.encode()), 4)}
    chat = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        response_format={"type": "json_object"}, extra_body={"top_k": 1})
    got = chat.model_extra["fake_received"]
    assert got["tools"][0]["function"]["name"] == "f" and got["top_k"] == 1
    assert got["response_format"] == {"type": "json_object"} and chat.model == "fake"


@SHARED
def test_the_servers_errors_reach_the_client_as_it_sent_them(ready_shared):
    d, client = ready_shared
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="fake", prompt="x", max_tokens=-1)
    assert err.value.status_code == 400 and "max_tokens must be at least 1" in str(err.value)
    assert d.engine("fake-0")["restarts"] == d.engine("fake-1")["restarts"] == 0


@SHARED
def test_the_rest_of_the_servers_api_is_reachable_through_the_gateway(ready_shared):
    d, client = ready_shared
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    assert http_json("POST", f"{base}/tokenize", {"model": "fake", "prompt": "ab"}) == (
        200, {"tokens": [97, 98], "count": 2,
              "fake_received": {"model": "fake-model", "prompt": "ab"}})
    code, body = http_json("POST", f"{base}/detokenize", {"model": "fake", "tokens": [104, 105]})
    assert (code, body["prompt"]) == (200, "hi")
    assert http_json("GET", f"{base}/version") == (200, {"version": "fake-1.0"})
    emb = client.embeddings.create(model="fake", input="ab")
    assert emb.model == "fake" and emb.data[0].embedding == [97 / 255, 98 / 255]
    code, body = http_json("POST", f"{base}/v1/responses", {"model": "fake", "input": "abc"})
    assert (code, body["output_text"], body["model"]) == (200, "cba", "fake")
    assert client.models.retrieve("fake").id == "fake"
    code, body = http_json("POST", f"{base}/v1/nothing", {"model": "fake"})
    assert code == 404 and "no route /v1/nothing" in body["error"]["message"]  # the server's


def test_a_request_that_cannot_move_mid_stream_is_resent_before_its_first_byte(gateway):
    """n = 2 cannot continue on another replica, but a whole answer that was not sent yet is
    simply sent again; a stream of it that already began gets an error event naming the field."""
    d, client = gateway(fleet(tick="0.03"))
    import threading as _threading

    victim: list[str] = []

    def kill_the_server() -> None:
        victim.append(serving(d))
        os.kill(d.engine(victim[0])["pid"], signal.SIGKILL)

    killer = _threading.Thread(target=kill_the_server)
    killer.start()
    done = client.completions.create(model="fake", prompt=PROMPT, max_tokens=60, n=2)
    killer.join(timeout=60)
    assert [c.text for c in done.choices] == [expected(list(PROMPT.encode()), 60)] * 2
    d.wait_for(lambda: d.engine(victim[0])["restarts"] == 1, 30, f"{victim[0]} restarted")
    assert "moving it" in d.stderr_text()

    d.wait_for(lambda: not any((e.get("queue") or {}).get("running")
                               for e in d.engines().values()), 15,
               "no replica still counted as running the first request")
    chunks, victim2 = [], None
    with pytest.raises(openai.APIError) as err:
        for chunk in client.completions.create(model="fake", prompt=PROMPT, max_tokens=80,
                                               n=2, stream=True):
            chunks.append(chunk)
            if victim2 is None and len(chunks) >= 3:
                victim2 = serving(d)
                os.kill(d.engine(victim2)["pid"], signal.SIGKILL)
    assert "cannot continue elsewhere: 'n' is set" in str(err.value), err.value


@pytest.mark.parametrize("mode", ["vllm", True])
def test_broken_answers_from_the_server_are_clear_errors_and_harm_nothing(gateway, mode):
    """A server that streams malformed events, cuts its JSON short, or never ends its body:
    the client gets a clear error (the stream's, or a 502/503), the replica is left to its
    probes (not restarted for it), and the next request is served."""
    d, client = gateway(fleet(openai_mode=mode, replicas=1, request_timeout="3s"))
    seen = {}
    for prompt, stream in (("!garbage", True), ("!truncated", False), ("!endless", True)):
        with pytest.raises(openai.APIError) as raised:
            answer = client.completions.create(model="fake", prompt=prompt, max_tokens=5,
                                               stream=stream)
            if stream:
                list(answer)
        seen[prompt] = str(raised.value)
    assert "request_timeout" in seen["!endless"], seen
    # what went wrong is named: the broken event, the body cut short
    assert "fake-0: JSONDecodeError" in seen["!garbage"], seen
    assert "fake-0:" in seen["!truncated"] and "received 46 of 500 bytes" in seen["!truncated"]
    done = client.completions.create(model="fake", prompt=PROMPT, max_tokens=3)
    assert done.choices[0].text == expected(list(PROMPT.encode()), 3)
    e = d.engine("fake-0")
    assert e["restarts"] == 0 and e["state"] == "READY", e
    assert "Traceback" not in d.stderr_text(), d.stderr_text()[-3000:]
