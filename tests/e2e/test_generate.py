"""End to end: requests through the daemon, as a user sends them: `enginectl generate [--stream]`
and POST /v1/generate (JSON, or NDJSON when streamed), sampling options, chat, stop strings,
client errors, and a client that goes away mid-stream."""

from __future__ import annotations

import json
import select
import time

import pytest

from testkit.driver import http_request

SLOW_ECHO = {"name": "echo", "replicas": 1, "model": "builtin:echo",
             "env": {"ENGINED_ECHO_TOKEN_MS": "100"}}


def _post(d, body: dict) -> tuple[int, bytes]:
    code, _, raw = http_request(d.socket, "POST", "/v1/generate", json.dumps(body).encode(),
                                {"Content-Type": "application/json"}, timeout_s=120)
    return code, raw


def _lines(raw: bytes) -> list[dict]:
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


# The read-only tests share one daemon: SLOW_ECHO.
SHARED = pytest.mark.xdist_group("generate-shared")


@pytest.fixture(scope="module")
def shared(module_engined):
    return module_engined([SLOW_ECHO])


@pytest.fixture
def ready_shared(shared):
    assert shared.alive(), "the module's shared daemon is gone"
    shared.wait_all_ready()
    return shared


@SHARED
def test_enginectl_stream_prints_tokens_as_they_come(ready_shared):
    d = ready_shared
    proc = d.ctl_popen("generate", "--stream", "abcdefghij", stdout=-1, stderr=-1)
    arrivals: list[tuple[float, bytes]] = []
    try:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if not ready:
                continue
            data = proc.stdout.buffer.read1(64) if hasattr(proc.stdout, "buffer") else b""
            if not data:
                break
            arrivals.append((time.monotonic(), data))
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = b"".join(data for _, data in arrivals).decode()
    assert (proc.returncode, text) == (0, "abcdefghij\n"), (proc.returncode, text)
    assert len(arrivals) >= 3, arrivals  # not all at once: ten tokens, 100 ms apart
    assert arrivals[-1][0] - arrivals[0][0] > 0.3, arrivals


@pytest.mark.smoke
def test_ndjson_stream_stop_strings_chat_and_usage(engined):
    d = engined([{**SLOW_ECHO, "env": {"ENGINED_ECHO_TOKEN_MS": "5"}}])
    code, raw = _post(d, {"prompt": "hello world, bye", "max_tokens": 64, "stream": True,
                          "stop": "wor"})
    lines = _lines(raw)
    assert code == 200 and lines[-1]["done"] is True, lines
    assert "".join(x["text"] for x in lines) == "hello "
    assert (lines[-1]["finish_reason"], lines[-1]["prompt_tokens"]) == ("stop", 16)
    assert all(x["token_ids"] for x in lines[:-1])  # every chunk carries its ids

    code, raw = _post(d, {"messages": [{"role": "user", "content": "hi there"}],
                          "max_tokens": 4})
    body = json.loads(raw)
    assert (code, body["text"], body["finish_reason"], body["completion_tokens"]) == (
        200, "hi t", "length", 4), body

    out = d.ctl("generate", "--stop", "c", "--max-tokens", "10", "abcdef")
    assert (out.returncode, out.stdout) == (0, "ab\n"), out


@SHARED
def test_bad_requests_are_400_naming_the_field(ready_shared):
    d = ready_shared
    for body, fragment in [
        ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "not both"),
        ({"messages": []}, "'messages': expected `array` of length >= 1"),
        ({"prompt": "x", "stop": ["a", 7]}, "'stop[1]': expected `str`, got `int`"),
        ({"messages": [{"role": "robot", "content": "y"}]}, "messages[0]"),
        ({"prompt": "x", "stop": ["a"] * 17}, "'stop'"),
        ({"prompt": "x", "seed": 2**64}, "'seed'"),
        ({"prompt": "x", "temperature": 3}, "'temperature'"),
        ({"prompt": "x", "stream": "yes"}, "'stream'"),
    ]:
        code, raw = _post(d, body)
        assert code == 400 and fragment in json.loads(raw)["error"], (body, code, raw)
    assert d.engine("echo-0")["restarts"] == 0


def test_a_client_that_goes_away_mid_stream_aborts_its_request(engined):
    import socket

    d = engined([SLOW_ECHO])
    body = json.dumps({"prompt": "x" * 100, "max_tokens": 100, "stream": True}).encode()
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(30)
    sock.connect(d.socket)
    sock.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: engined\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                 b"\r\n\r\n" + body)
    got = b""
    while b'"text"' not in got:  # the first chunk is out: the request is running
        got += sock.recv(4096)
    d.wait_for(lambda: (d.engine("echo-0")["queue"] or {}).get("running") == 1, 10,
               "the request running")
    sock.close()
    # 100 tokens of 100 ms would run 10 s: it is aborted as soon as the client is gone
    d.wait_for(lambda: (d.engine("echo-0")["queue"] or {}).get("running") == 0, 5,
               "the request aborted")
    out = d.ctl("generate", "--max-tokens", "3", "next")
    assert (out.returncode, out.stdout.strip()) == (0, "nex"), out


def test_a_client_that_goes_away_before_a_result_aborts_its_request(engined):
    """Not streamed, nothing to write yet: the daemon notices the hang-up all the same."""
    import socket

    d = engined([SLOW_ECHO])
    body = json.dumps({"prompt": "y" * 100, "max_tokens": 100}).encode()
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(d.socket)
    sock.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: engined\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                 b"\r\n\r\n" + body)
    d.wait_for(lambda: (d.engine("echo-0")["queue"] or {}).get("running") == 1, 10,
               "the request running")
    sock.close()
    d.wait_for(lambda: (d.engine("echo-0")["queue"] or {}).get("running") == 0, 5,
               "the request aborted")
