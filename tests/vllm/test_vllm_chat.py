"""vLLM's own chat frontend inside a vLLM engine (engine/vllm_chat.py), driven directly in the vLLM
interpreter: a stream that moves to another engine after any number of tokens says, in all, what
the unmoved stream says (the new engine's parser replays the delivered text first, so it is
where the first one's was, and no content or tool call is said twice)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
SCRIPT = r'''
import json, sys
from types import SimpleNamespace
from transformers import AutoTokenizer
from engined.engine.vllm_chat import ChatFrontend

checkpoint = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(checkpoint)
config = SimpleNamespace(model=checkpoint, hf_config=SimpleNamespace(model_type="llama"))
frontend = ChatFrontend(tokenizer, config, {"enable_auto_tool_choice": True,
                                            "tool_call_parser": "hermes"})
tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [tool], "stream": True}
text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>')
ids = tokenizer.encode(text, add_special_tokens=False)
pieces = [tokenizer.decode(ids[:i + 1])[len(tokenizer.decode(ids[:i])):]
          for i in range(len(ids))]

def run(chat, start):
    return [chat.delta(p, [t], False) for p, t in zip(pieces[start:], ids[start:])] + [
        chat.delta("", [], True)]

def said(deltas):
    content, names, arguments = "", [], {}
    for delta in deltas:
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if function.get("name"):
                names.append(function["name"])
            arguments[call["index"]] = arguments.get(call["index"], "") + (
                function.get("arguments") or "")
    return [content, names, arguments]

unmoved = said(run(frontend.open(body), 0))
moved = {}
for cut in range(1, len(ids)):
    before = run(frontend.open(body), 0)[:cut]
    after = frontend.open(body)
    after.replay("".join(pieces[:cut]), ids[:cut])
    moved[cut] = said(before + run(after, cut))
print(json.dumps({"unmoved": unmoved, "moved": moved, "tokens": len(ids)}))
'''


def test_a_moved_tool_call_stream_says_what_the_unmoved_one_says(vllm_python: str,
                                                                 tiny_checkpoint: Path,
                                                                 tmp_path: Path):
    import json

    root = tmp_path / "root"
    (root / "engined").mkdir(parents=True)
    (root / "engined" / "__init__.py").write_text("")
    (root / "engined" / "engine").symlink_to(REPO / "engine")
    out = subprocess.run([vllm_python, "-c", SCRIPT, str(tiny_checkpoint)], cwd=tmp_path,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin",
                              "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR"},
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    unmoved = result["unmoved"]
    assert unmoved == ["Let me check.", ["get_weather"], {"0": '{"city": "Paris"}'}], unmoved
    assert len(result["moved"]) == result["tokens"] - 1 > 20
    for cut, said in result["moved"].items():
        assert said == unmoved, (cut, said)
