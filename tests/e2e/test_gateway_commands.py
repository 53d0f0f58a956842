"""The gateway in front of command engines (servers engined did not write), driven by the
official `openai` client: the upstream's model name is rewritten, and a request whose server
dies moves to another replica: resent before its first token, continued mid-stream from the
token ids already delivered (`openai: vllm`), an error event where the server gives no ids.

The servers are tests/commandserver.py, whose next token is a function of the whole sequence,
so a continued answer must equal the answer without a fault, character for character."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

import openai
import psutil
import pytest
from driver import PYTHON, REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests"))
from commandserver import next_token  # noqa: E402

SERVER = str(REPO_ROOT / "tests" / "commandserver.py")
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


def serving(d) -> str:
    def find():
        busy = [n for n, e in d.engines().items() if (e.get("queue") or {}).get("running")]
        return busy[0] if len(busy) == 1 else None
    return d.wait_for(find, 15, "one replica running the request")


def test_completions_chat_and_models_through_a_command_engine(gateway):
    d, client = gateway(fleet())
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
    finished = log.index(" completion fake ok in ")
    stopped = log.index(f"[stop] fake-0 pid {old}: SIGTERM")
    assert finished < stopped, log[finished - 200:stopped + 200]
