"""vLLM's sampling fields on engined's own engines, as a table both backends must pass (the
transformers engine in tests/e2e/test_tiny_llama.py, the vLLM engine in the vLLM tier), through
the control socket's POST /v1/generate, which reads them as the gateway does.

The tiny-llama model's logits lie within about ±7, so a logit_bias of 100 decides a token for
sure, and the cases are exact: a forced token repeats, a presence penalty of 2 cannot unseat it,
a frequency penalty of 2 must within 64 tokens, an end of sequence pushed to the top ends the
answer at once unless min_tokens or ignore_eos hold it off, and a stop token id ends it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Post = Callable[[dict[str, Any]], tuple[int, dict[str, Any]]]


def token_ids(checkpoint: Path) -> tuple[int, int, int]:
    """The ids of "a", "b" and the end of sequence in the tiny-llama checkpoint's vocabulary."""
    vocab = json.loads((checkpoint / "tokenizer.json").read_text())["model"]["vocab"]
    return vocab["a"], vocab["b"], vocab["</s>"]


def check_sampling_fields(post: Post, engine: str, checkpoint: Path) -> None:
    a, b, eos = token_ids(checkpoint)

    def run(**fields: Any) -> dict[str, Any]:
        code, body = post({"prompt": "hello", "temperature": 0, "engine": engine, **fields})
        assert code == 200, (fields, body)
        return body

    plain = run(max_tokens=8)
    # what vLLM's serving benchmark sends, and OpenAI's neutral values: no change
    neutral = run(max_tokens=8, repetition_penalty=1.0, top_k=-1, min_p=0.0,
                  presence_penalty=0, frequency_penalty=0, logit_bias={}, ignore_eos=False)
    assert neutral["text"] == plain["text"], (neutral, plain)
    # top_k 1 leaves sampling only the most likely token: greedy
    top1 = run(max_tokens=8, temperature=1.0, seed=3, top_k=1)
    assert top1["text"] == plain["text"], (top1, plain)
    # a biased token is all there is; a presence penalty of 2 cannot change that
    forced = run(max_tokens=6, logit_bias={str(a): 100})
    assert (forced["text"], forced["finish_reason"]) == ("a" * 6, "length"), forced
    present = run(max_tokens=64, logit_bias={str(a): 100}, presence_penalty=2)
    assert present["text"] == "a" * 64, present
    # ... a frequency penalty of 2 a token does, within 64 of them
    frequent = run(max_tokens=64, logit_bias={str(a): 100}, frequency_penalty=2)
    text = frequent["text"]
    assert text.startswith("a" * 20) and set(text) != {"a"}, frequent
    # the end of sequence pushed to the top: the answer ends at once (the end of sequence is
    # a token of the answer, with no text, as vLLM counts it) ...
    ended = run(max_tokens=5, logit_bias={str(eos): 100})
    assert (ended["text"], ended["completion_tokens"], ended["finish_reason"]) == (
        "", 1, "stop"), ended
    # ... unless min_tokens holds it off that long, or ignore_eos ignores it
    held = run(max_tokens=5, logit_bias={str(eos): 100}, min_tokens=3)
    assert (held["completion_tokens"], held["finish_reason"]) == (4, "stop"), held
    ignored = run(max_tokens=5, logit_bias={str(eos): 100}, ignore_eos=True)
    assert (ignored["completion_tokens"], ignored["finish_reason"]) == (5, "length"), ignored
    # a stop token id ends it too, and min_tokens holds that off as well
    stopped = run(max_tokens=6, logit_bias={str(a): 100, str(b): 80}, stop_token_ids=[a],
                  min_tokens=2)
    assert (stopped["text"], stopped["finish_reason"]) == ("bb", "stop"), stopped
    # what no backend can do is a 400 naming the field, before any engine sees it
    code, body = post({"prompt": "hi", "engine": engine, "min_tokens": 9, "max_tokens": 4})
    assert code == 400 and "'min_tokens' (9) must not exceed 'max_tokens' (4)" in body["error"]
