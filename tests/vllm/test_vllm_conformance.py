"""engined's own OpenAI answers against vLLM's: the same greedy requests to `vllm serve` (vLLM's
OpenAI server, a command engine of the daemon, asked on its own port) and to the gateway in
front of a `backend: vllm` engine of the same daemon, on the same checkpoint with the same
engine arguments (float32, eager, max_model_len 1024, 8 sequences, one thread).

The gateway renders these answers itself from the engine's tokens and logprobs, so everything
a client reads must be vLLM's: the text, finish_reason and stop_reason, usage, the tokens and
their logprobs (float32 on CPU on both sides: within TOLERANCE), and the shape of every field
(the keys at every level and their JSON types), whole and streamed (a stream's concatenated text
and logprobs, its finish reasons, the shapes of each choice's first, middle and last events
and of the usage event).

What may differ is `VOLATILE`, each entry for a reason of its own, a sampled request's values
(n=2 with a seed: only its shapes are compared), and how a stream's text is cut into events:
vLLM's server holds back text that may begin a stop string in events of their own, and merges
the outputs of several steps into one event when it falls behind its engine (a loaded box: see
`both`).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from test_vllm_engine import DEFAULTS, SUPERVISOR, vllm_engine
from test_vllm_serve import READY_TIMEOUT_S, serve_engine

from testkit.driver import Daemon, free_port, running_daemon

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2 * READY_TIMEOUT_S + 600)]

TOLERANCE = 1e-3  # the same float32 forward on both sides (identical in practice)
REQUEST_TIMEOUT_S = 120.0
# Keys whose values may differ (their presence and JSON type are still compared):
VOLATILE = {
    "id",  # each server names its own requests
    "created",  # a clock reading: the two answers may straddle a second
    "model",  # vLLM serves the checkpoint's path; the gateway, the group's name (checked)
    "system_fingerprint",  # names the server that answered: vLLM's version and config hash,
    #                        engined's version and its spec's hash
}
OURS = "ours"  # the backend: vllm group's name, the gateway's model


@dataclass
class Pair:
    daemon: Daemon
    direct: int  # vllm serve's own port
    gateway: int
    upstream_model: str  # vllm serve's model name
    vocab: dict[str, int] = field(default_factory=dict)


@pytest.fixture(scope="module")
def pair(vllm_python: str, tiny_cache: Path, tiny_checkpoint: Path) -> Iterator[Pair]:
    served = serve_engine(vllm_python, tiny_checkpoint)  # --dtype float32 --enforce-eager ...
    # without its tool-call parser (engined's own engines take no tools): with one, vLLM's chat
    # stream shows a last event with no text as `delta: {}`, without one as `{"content": ""}`
    command = served["command"]
    at = command.index("--enable-auto-tool-choice")
    assert command[at:at + 3] == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    served["command"] = command[:at] + command[at + 3:]
    ours = vllm_engine(OURS, vllm_python, tiny_cache, replicas=1,
                       model={"path": str(tiny_checkpoint), "dtype": "float32"})
    assert ours["engine_args"] == {"enforce_eager": True, "max_model_len": 1024}, ours
    assert "--max-model-len" in served["command"] and ours["max_batch_size"] == 8
    gateway = free_port()
    with running_daemon([served, ours], {**SUPERVISOR, "gateway": f"127.0.0.1:{gateway}"},
                        DEFAULTS, prefix="egc") as daemon:
        daemon.wait_all_ready(READY_TIMEOUT_S)
        port = daemon.engine("served-0")["port"]
        models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models",
                                                   timeout=30).read())
        vocab = json.loads((tiny_checkpoint / "tokenizer.json").read_text())["model"]["vocab"]
        yield Pair(daemon, port, gateway, models["data"][0]["id"], vocab)


# --- requests ---------------------------------------------------------------------------------


def post(port: int, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, the JSON answer, or a stream's events as a list)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            raw = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    if not body.get("stream"):
        return status, json.loads(raw)
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.strip()]
    assert events and events[-1] == "[DONE]", raw[-2000:]
    return status, [json.loads(e) for e in events[:-1]]


MERGED_RETRIES = 5


def both(pair: Pair, path: str, body: dict[str, Any]) -> tuple[Any, Any]:
    """vLLM's answer and the gateway's, both 200. A stream of vLLM's whose choice came in fewer
    events than the gateway's is asked for again: vLLM's server merges the outputs its engine got
    ahead with when it falls behind (on a slow or loaded box; a short answer's all), and a
    merged event's logprobs list several tokens where the gateway's event lists one, or is the
    choice's first and last event alike and says nothing of either's shape."""
    ours = post(pair.gateway, path, {**body, "model": OURS})
    for _ in range(MERGED_RETRIES):
        direct = post(pair.direct, path, {**body, "model": pair.upstream_model})
        if not (body.get("stream") and direct[0] == ours[0] == 200 and merged(direct[1],
                                                                               ours[1])):
            break
    assert direct[0] == ours[0] == 200, (path, body, direct, ours)
    return direct[1], ours[1]


def merged(vllm: list[dict[str, Any]], ours: list[dict[str, Any]]) -> bool:
    """vLLM's server put the outputs of several of its engine's steps into one event for some
    choice (it sent fewer events than the gateway did, one per token)."""
    theirs, mine = choices_of(vllm)[0], choices_of(ours)[0]
    return any(len(c.events) < len(mine.get(i, c).events) for i, c in theirs.items())


# --- comparisons ------------------------------------------------------------------------------


def shape(value: Any, tokens: bool = False) -> Any:
    """The keys at every level and the JSON types; a list's shape is the set of its items'.
    `tokens`: dicts whose keys are tokens, not field names (the entries of a completion's
    `top_logprobs`: which tokens they name is a value, compared as one where exact)."""
    if isinstance(value, dict):
        if tokens:
            return {"<token>": sorted({json.dumps(shape(v), sort_keys=True)
                                       for v in value.values()})}
        completion_logprobs = "text_offset" in value
        return {key: shape(item, completion_logprobs and key == "top_logprobs")
                for key, item in value.items()}
    if isinstance(value, list):
        return sorted({json.dumps(shape(item, tokens), sort_keys=True) for item in value})
    if isinstance(value, bool) or value is None:
        return repr(value) if value is None else "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def same_values(vllm: Any, ours: Any, where: str = "") -> None:
    """Equal but for VOLATILE keys; floats within TOLERANCE."""
    if isinstance(vllm, dict):
        assert isinstance(ours, dict) and set(vllm) == set(ours), (where, vllm, ours)
        for key in set(vllm) - VOLATILE:
            same_values(vllm[key], ours[key], f"{where}.{key}")
    elif isinstance(vllm, list):
        assert isinstance(ours, list) and len(vllm) == len(ours), (where, vllm, ours)
        for i, (a, b) in enumerate(zip(vllm, ours)):
            same_values(a, b, f"{where}[{i}]")
    elif isinstance(vllm, float) and not isinstance(ours, bool):
        assert isinstance(ours, (int, float)) and abs(vllm - ours) <= TOLERANCE, (where, vllm,
                                                                                  ours)
    else:
        assert vllm == ours and type(vllm) is type(ours), (where, vllm, ours)


def same_shape(vllm: Any, ours: Any, where: str) -> None:
    assert shape(vllm) == shape(ours), (where, json.dumps(vllm)[:3000],
                                        json.dumps(ours)[:3000])


@dataclass
class Choice:
    """One choice of a stream: its events in order, and what they say put together."""

    events: list[dict[str, Any]] = field(default_factory=list)

    def said(self, chat: bool) -> dict[str, Any]:
        texts, logprobs, finishes, stops = [], [], [], []
        for event in self.events:
            choice = event["choices"][0]
            texts.append(choice["delta"].get("content") or "" if chat else choice["text"])
            if choice.get("logprobs") is not None:
                logprobs.append(choice["logprobs"])
            finishes.append(choice["finish_reason"])
            stops.append(choice.get("stop_reason"))
        if chat:
            merged: Any = [e for lp in logprobs for e in lp["content"]]
        else:
            merged = {key: [v for lp in logprobs for v in lp[key]]
                      for key in ("text_offset", "token_logprobs", "tokens", "top_logprobs")}
        return {"text": "".join(texts), "logprobs": merged if logprobs else None,
                "finish_reasons": finishes, "stop_reasons": stops}


def choices_of(events: list[dict[str, Any]]) -> tuple[dict[int, Choice], list[dict[str, Any]]]:
    """A stream's events by choice index, and its usage events (no choices)."""
    by_index: dict[int, Choice] = {}
    usage = []
    for event in events:
        assert "error" not in event, event
        if not event["choices"]:
            usage.append(event)
            continue
        (choice,) = event["choices"]
        by_index.setdefault(choice["index"], Choice()).events.append(event)
    return by_index, usage


def compare_streams(vllm: list[dict[str, Any]], ours: list[dict[str, Any]], chat: bool,
                    exact: bool) -> None:
    theirs, their_usage = choices_of(vllm)
    mine, my_usage = choices_of(ours)
    assert sorted(theirs) == sorted(mine), (vllm, ours)
    for index in theirs:
        a, b = theirs[index].events, mine[index].events
        where = f"choice {index}"
        same_shape(a[0], b[0], f"{where}: first event")
        same_shape(a[-1], b[-1], f"{where}: last event")
        if len(a) > 2 and len(b) > 2:  # vLLM may have merged them all away
            same_shape(a[1:-1], b[1:-1], f"{where}: middle events")
        said_a, said_b = theirs[index].said(chat), mine[index].said(chat)
        # one finish reason, on the choice's last event
        assert said_a["finish_reasons"][:-1] == [None] * (len(a) - 1), said_a
        assert said_b["finish_reasons"][:-1] == [None] * (len(b) - 1), said_b
        if exact:
            same_values(said_a["text"], said_b["text"], f"{where}: text")
            same_values(said_a["logprobs"], said_b["logprobs"], f"{where}: logprobs")
            same_values(said_a["finish_reasons"][-1:], said_b["finish_reasons"][-1:], where)
            same_values(said_a["stop_reasons"][-1:], said_b["stop_reasons"][-1:], where)
    assert len(their_usage) == len(my_usage) <= 1, (their_usage, my_usage)
    for a, b in zip(their_usage, my_usage):
        same_shape(a, b, "usage event")
        if exact:
            same_values(a, b, "usage event")


# --- the cases --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: dict[str, Any]
    exact: bool = True  # greedy: the same values too (else: the same shapes only)
    streams: bool = True  # streamed too (else vLLM refuses it streamed: see below)


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
CASES = [
    Case("plain", COMPLETIONS, {"prompt": "hello there", "max_tokens": 6}),
    Case("token ids", COMPLETIONS, {"prompt": "<ids of hello>", "max_tokens": 5}),
    Case("stop list", COMPLETIONS, {"prompt": "hello there", "max_tokens": 12,
                                    "stop": ["<2 chars of the answer>", "never"]}),
    Case("stop kept", COMPLETIONS, {"prompt": "hello there", "max_tokens": 12,
                                    "stop": ["<2 chars of the answer>", "never"],
                                    "include_stop_str_in_output": True}),
    Case("stop token id", COMPLETIONS, {"prompt": "hello there", "max_tokens": 12,
                                        "stop_token_ids": ["<the answer's 3rd token>"]}),
    Case("end of sequence", COMPLETIONS, {"prompt": "hello", "max_tokens": 5, "logprobs": 1,
                                          "logit_bias": {"<eos>": 100}}),
    Case("batch of 2", COMPLETIONS, {"prompt": ["one", "two"], "max_tokens": 3}),
    Case("n=2 seeded", COMPLETIONS, {"prompt": "abc", "max_tokens": 4, "temperature": 0.8,
                                     "n": 2, "seed": 7}, exact=False),
    Case("logprobs=3", COMPLETIONS, {"prompt": "hello", "max_tokens": 5, "logprobs": 3}),
    Case("echo logprobs=1", COMPLETIONS, {"prompt": "hello", "max_tokens": 3, "echo": True,
                                          "logprobs": 1}),
    Case("echo max_tokens=0", COMPLETIONS, {"prompt": "hello", "max_tokens": 0, "echo": True,
                                            "logprobs": 1}),
    Case("prompt_logprobs", COMPLETIONS, {"prompt": "hello", "max_tokens": 2,
                                          "prompt_logprobs": 2}, streams=False),
    Case("return_token_ids", COMPLETIONS, {"prompt": "hello", "max_tokens": 5,
                                           "return_token_ids": True}),
    Case("chat", CHAT, {"messages": HI, "max_tokens": 5}),
    Case("chat return_token_ids", CHAT, {"messages": HI, "max_tokens": 4,
                                         "return_token_ids": True}),
    Case("chat prompt_logprobs", CHAT, {"messages": HI, "max_tokens": 3, "prompt_logprobs": 2},
         streams=False),
    Case("chat logprobs", CHAT, {"messages": HI, "max_tokens": 4, "logprobs": True,
                                 "top_logprobs": 2}),
    Case("chat system+user", CHAT, {"messages": [{"role": "system", "content": "be brief"},
                                                 *HI], "max_tokens": 5}),
    Case("chat end of sequence", CHAT, {"messages": HI, "max_tokens": 5, "logprobs": True,
                                        "logit_bias": {"<eos>": 100}}),
    Case("chat n=2 seeded", CHAT, {"messages": HI, "max_tokens": 4, "temperature": 0.8,
                                   "n": 2, "seed": 7}, exact=False),
    Case("chat echo, continued", CHAT, {"messages": [*HI, {"role": "assistant",
                                                           "content": "Sure,"}],
                                        "max_tokens": 4, "echo": True,
                                        "add_generation_prompt": False,
                                        "continue_final_message": True}),
    Case("chat echo, a user's last", CHAT, {"messages": HI, "max_tokens": 4, "echo": True}),
]
MODES = {"whole": {}, "streamed": {"stream": True},
         "streamed with usage": {"stream": True, "stream_options": {"include_usage": True}}}


def resolve(pair: Pair, case: Case) -> dict[str, Any]:
    """The case's body with its placeholders filled in from the model (its vocabulary, and the
    greedy answer to "hello there" as vLLM gives it, so the stops are really met)."""
    body: dict[str, Any] = {"temperature": 0, **case.body}
    if body.get("prompt") == "<ids of hello>":
        body["prompt"] = [pair.vocab[c] for c in "hello"]
    if "logit_bias" in body:
        body["logit_bias"] = {str(pair.vocab["</s>"]): 100}
    if "stop" in body or "stop_token_ids" in body:
        _, answer = post(pair.direct, COMPLETIONS, {
            "model": pair.upstream_model, "prompt": "hello there", "max_tokens": 12,
            "temperature": 0, "return_token_ids": True})
        text, ids = answer["choices"][0]["text"], answer["choices"][0]["token_ids"]
        assert len(text) == len(ids) == 12, answer  # one character a token, no eos
        if "stop" in body:
            body["stop"] = [text[3:5], "never"]
        else:
            body["stop_token_ids"] = [ids[2]]
    return body


@pytest.mark.parametrize(("case", "mode"), [
    pytest.param(case, mode, id=f"{case.name}, {mode}") for case in CASES for mode in MODES
    if case.streams or mode == "whole"])
def test_the_gateway_answers_as_vllm_serve_does(pair: Pair, case: Case, mode: str):
    body = {**resolve(pair, case), **MODES[mode]}
    chat = case.path == CHAT
    vllm, ours = both(pair, case.path, body)
    if not body.get("stream"):
        same_shape(vllm, ours, "answer")
        if case.exact:
            same_values(vllm, ours)
        assert ours["model"] == OURS and ours["system_fingerprint"].startswith("engined-")
        choices = vllm["choices"]
    else:
        compare_streams(vllm, ours, chat, case.exact)
        assert all(e["model"] == OURS for e in ours)
        choices = [e["choices"][0] for e in vllm if e["choices"] and
                   e["choices"][0]["finish_reason"]]
    # each case exercises what it says it does
    if case.exact and "stop" in body:
        assert all(c["stop_reason"] == body["stop"][0] for c in choices), choices
    if case.exact and "stop_token_ids" in body:
        assert all(c["stop_reason"] == body["stop_token_ids"][0] for c in choices), choices
    if "logit_bias" in body:
        assert all(c["finish_reason"] == "stop" for c in choices), choices
    if body.get("echo") and chat and body.get("add_generation_prompt") is False:
        said = ([c["message"]["content"] for c in ours["choices"]] if not body.get("stream")
                else ["".join(e["choices"][0]["delta"].get("content") or "" for e in ours
                              if e["choices"] and e["choices"][0]["index"] == i)
                      for i in range(body.get("n", 1))])
        assert len(said) == body.get("n", 1) and all(s.startswith("Sure,") for s in said), said


def test_what_vllm_serve_refuses_the_gateway_refuses(pair: Pair):
    """A 400 naming the same field where vLLM names one. The error's other fields are each
    server's own: the message's words, and `type` and `code`, where engined keeps OpenAI's
    values (invalid_request_error, a string code or null) and vLLM has its exception's name and
    the HTTP status."""
    for path, body in [
            (COMPLETIONS, {"prompt": "hello", "max_tokens": 2, "prompt_logprobs": 2,
                           "stream": True}),  # a stream has no place for them
            (COMPLETIONS, {"prompt": "hello", "max_tokens": 2, "temperature": 0, "n": 2}),
            (CHAT, {"messages": HI, "max_tokens": 2, "top_logprobs": 2}),  # without logprobs
            (CHAT, {"messages": HI, "max_tokens": 2, "prompt_logprobs": 1, "stream": True}),
    ]:
        direct = post(pair.direct, path, {**body, "model": pair.upstream_model})
        ours = post(pair.gateway, path, {**body, "model": OURS})
        assert direct[0] == ours[0] == 400, (body, direct, ours)
        assert direct[1]["error"]["param"] in (None, ours[1]["error"]["param"]), (
            body, direct, ours)
