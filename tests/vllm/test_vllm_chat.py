"""vLLM's own chat frontend inside a vLLM engine (engine/vllm_chat.py), driven directly in the vLLM
interpreter: a stream that moves to another engine after any number of tokens says, in all, what
the unmoved stream says (the new engine's parser replays the delivered text first, so it is
where the first one's was, and no content, reasoning or tool call is said twice), for vLLM's
tool-call parser (hermes) and a reasoning parser (granite's, which reads its markers as text:
the tiny model's tokenizer has no think tokens, which most of vLLM's parsers need)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
SCRIPT = r'''
import json, sys
from types import SimpleNamespace
from transformers import AutoTokenizer
from engined.engine.vllm_chat import ChatFrontend

checkpoint, case = sys.argv[1], json.loads(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(checkpoint)
config = SimpleNamespace(model=checkpoint, hf_config=SimpleNamespace(model_type="llama"))
frontend = ChatFrontend(tokenizer, config, case["frontend_args"])
body, text = case["body"], case["text"]
ids = tokenizer.encode(text, add_special_tokens=False)
pieces = [tokenizer.decode(ids[:i + 1])[len(tokenizer.decode(ids[:i])):]
          for i in range(len(ids))]

def run(chat, start):
    return [chat.delta(p, [t], False) for p, t in zip(pieces[start:], ids[start:])] + [
        chat.delta("", [], True)]

def said(deltas):
    content, reasoning, names, arguments = "", "", [], {}
    for delta in deltas:
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning") or ""
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if function.get("name"):
                names.append(function["name"])
            arguments[call["index"]] = arguments.get(call["index"], "") + (
                function.get("arguments") or "")
    return [content, reasoning, names, arguments]

unmoved = said(run(frontend.open(body), 0))
moved = {}
for cut in range(1, len(ids)):
    before = run(frontend.open(body), 0)[:cut]
    after = frontend.open(body)
    after.replay("".join(pieces[:cut]), ids[:cut])
    moved[cut] = said(before + run(after, cut))
whole, _ = frontend.open({**body, "stream": False}).message(text, ids, "stop")
print(json.dumps({"unmoved": unmoved, "moved": moved, "tokens": len(ids),
                  "whole": [whole.get("content"), whole.get("reasoning")]}))
'''


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def _frontend(vllm_python: str, checkpoint: Path, tmp_path: Path,
              case: dict[str, Any]) -> dict[str, Any]:
    """SCRIPT's result for `case` (frontend_args, body, the model's text) in the vLLM
    interpreter, with engine/ importable as engined.engine."""
    root = tmp_path / "root"
    (root / "engined").mkdir(parents=True)
    (root / "engined" / "__init__.py").write_text("")
    (root / "engined" / "engine").symlink_to(REPO / "engine")
    out = subprocess.run([vllm_python, "-c", SCRIPT, str(checkpoint), json.dumps(case)],
                         cwd=tmp_path, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin",
                                            "HF_HUB_OFFLINE": "1",
                                            "VLLM_LOGGING_LEVEL": "ERROR"},
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["moved"]) == result["tokens"] - 1 > 10
    for cut, said in result["moved"].items():
        assert said == result["unmoved"], (cut, said)
    return result


def test_a_moved_tool_call_stream_says_what_the_unmoved_one_says(vllm_python: str,
                                                                 tiny_checkpoint: Path,
                                                                 tmp_path: Path):
    result = _frontend(vllm_python, tiny_checkpoint, tmp_path, {
        "frontend_args": {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"},
        "body": {"messages": [{"role": "user", "content": "weather?"}], "tools": [TOOL],
                 "stream": True},
        "text": ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": '
                 '{"city": "Paris"}}\n</tool_call>')})
    assert result["unmoved"] == ["Let me check.", "", ["get_weather"],
                                 {"0": '{"city": "Paris"}'}], result["unmoved"]
    assert len(result["moved"]) > 20


def test_reasoning_is_split_from_the_answer_by_vllms_reasoning_parser(vllm_python: str,
                                                                      tiny_checkpoint: Path,
                                                                      tmp_path: Path):
    """`frontend_args: {reasoning_parser: ...}` (vLLM's --reasoning-parser): the thinking is the
    message's `reasoning`, the rest its `content`, streamed or whole, and a stream moved after
    any token says the same in all; `include_reasoning: false` leaves the reasoning out."""
    case = {"frontend_args": {"reasoning_parser": "granite"},
            "body": {"messages": [{"role": "user", "content": "2 + 2?"}], "stream": True},
            "text": "Here is my thought process: two and two make four. "
                    "Here is my response: The answer is 4."}
    result = _frontend(vllm_python, tiny_checkpoint, tmp_path, case)
    # streamed: vLLM's streaming parser decides where a marker split over tokens falls (its
    # granite parser leaves a piece of the response marker in the reasoning); what it says is
    # said once, wherever the stream moved (checked above)
    content, reasoning, calls, arguments = result["unmoved"]
    assert content.strip() == "The answer is 4." and (calls, arguments) == ([], {}), content
    assert reasoning.strip().startswith("two and two make four."), reasoning
    assert result["whole"] == [" The answer is 4.", " two and two make four. "], result["whole"]
    case["body"]["include_reasoning"] = False
    hidden = _frontend(vllm_python, tiny_checkpoint, tmp_path / "hidden", case)
    assert hidden["unmoved"] == [content, "", [], {}], hidden["unmoved"]
    assert hidden["whole"] == [" The answer is 4.", None], hidden["whole"]
