"""Logprobs through the gateway, as a table both model backends must pass (the transformers
engine in tests/e2e/test_tiny_llama.py, the vLLM engine in the vLLM tier), with the official
`openai` client.

The logprobs are the model's raw distribution (before temperature, penalties and logit_bias:
vLLM's default), so the cases can be exact without knowing the random weights:
- greedy: every generated token is the likeliest, so its logprob is the top one's, and the
  top N are N distinct tokens in descending order;
- teacher forcing: "hello" then "aaaa" forced by a logit_bias gives each "a" the same logprob as
  scoring the text "helloaaaa" with echo and max_tokens 0 (lm-eval's loglikelihood request)
  gives its prompt positions (the byte-level tokenizer reads text back to the same ids);
- streamed and whole answers carry the same tokens and logprobs; chat's shape is chat's.
"""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path

import openai

TOLERANCE = 1e-3  # the same forward, batched differently (float32 on CPU)


def check_logprobs(client: openai.OpenAI, model: str, checkpoint: Path) -> None:
    vocab = json.loads((checkpoint / "tokenizer.json").read_text())["model"]["vocab"]
    a = vocab["a"]

    greedy = client.completions.create(model=model, prompt="hello", max_tokens=8,
                                       temperature=0, logprobs=3)
    choice = greedy.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == greedy.usage.completion_tokens, lp
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) == 3, (value, top)  # the token is one of the top 3
        assert math.isclose(value, max(top.values()), abs_tol=1e-6), (value, top)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]

    chunks = list(client.completions.create(model=model, prompt="hello", max_tokens=8,
                                            temperature=0, logprobs=3, stream=True))
    streamed = [v for c in chunks for ch in c.choices if ch.logprobs
                for v in ch.logprobs.token_logprobs]
    assert len(streamed) == len(lp.token_logprobs), (streamed, lp.token_logprobs)
    assert all(math.isclose(x, y, abs_tol=TOLERANCE) for x, y in zip(streamed,
                                                                     lp.token_logprobs))

    forced = client.completions.create(model=model, prompt="hello", max_tokens=4,
                                       temperature=0, logprobs=0, logit_bias={str(a): 100})
    assert forced.choices[0].text == "aaaa", forced
    generated = forced.choices[0].logprobs.token_logprobs
    scored = client.completions.create(model=model, prompt="helloaaaa", max_tokens=0,
                                       echo=True, logprobs=0, temperature=0)
    slp = scored.choices[0].logprobs
    assert scored.choices[0].text == "helloaaaa" and slp.token_logprobs[0] is None, slp
    assert "".join(slp.tokens) == "helloaaaa" or len(slp.tokens) == 10  # BOS, if any, first
    assert all(math.isclose(x, y, abs_tol=TOLERANCE)
               for x, y in zip(slp.token_logprobs[-4:], generated)), (slp, generated)

    chat = client.chat.completions.create(model=model, messages=[
        {"role": "user", "content": "hi"}], max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens, content
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0, entry
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-6)


def check_tokenize(port: int, model: str, checkpoint: Path) -> None:
    """/tokenize and /detokenize answered by the engine's own tokenizer: the byte-level
    vocabulary's ids for "hello", vLLM's shape, and back to the text."""
    vocab = json.loads((checkpoint / "tokenizer.json").read_text())["model"]["vocab"]

    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                         json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            return json.loads(resp.read())

    plain = post("/tokenize", {"model": model, "prompt": "hello", "add_special_tokens": False,
                               "return_token_strs": True})
    assert plain["tokens"] == [vocab[c] for c in "hello"], plain
    assert plain["token_strs"] == list("hello") and plain["count"] == 5, plain
    assert plain["max_model_len"] > 5, plain
    assert post("/detokenize", {"model": model, "tokens": plain["tokens"]}) == {
        "prompt": "hello"}
    chat = post("/tokenize", {"model": model, "messages": [{"role": "user", "content": "hi"}]})
    assert chat["count"] > 2 and chat["count"] == len(chat["tokens"]), chat
