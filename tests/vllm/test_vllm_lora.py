"""LoRA adapters on real vLLM (its CPU build: PunicaWrapperCPU), in one engine child driven over
ZeroMQ as the daemon drives it (no daemon: this is the engine's side): real PEFT adapters of
tiny-llama (testkit.lora) change its greedy output, deterministically; the config's adapter is
loaded before READY, another loads and unloads at run time, and what vLLM cannot take is
refused with words naming the adapter. One vLLM start for the whole file (each costs seconds).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from engined.engine import protocol as proto
from testkit.enginechild import Channels, Engine, exit_of, spawn_engine
from testkit.lora import make_tiny_llama_adapter

pytestmark = pytest.mark.vllm

READY_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 60.0
PROMPT = "hello there"


def _gen(rid: str, adapter: str | None = None) -> proto.GenerateRequest:
    return proto.GenerateRequest(rid, PROMPT, sampling=proto.Sampling(max_tokens=16),
                                 adapter=adapter)


def _text(engine: Engine, rid: str) -> str:
    result = engine.result(rid, REQUEST_TIMEOUT_S)
    assert result.error is None and result.completion_tokens > 0, result
    return result.text


@pytest.fixture(scope="module")
def lora_engine(vllm_python: str, tiny_cache: Path, tiny_checkpoint: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Path]]:
    """A vLLM engine of tiny-llama with adapter `one` from its config; the adapters' root."""
    root = tmp_path_factory.mktemp("lora")
    make_tiny_llama_adapter(root / "one", tiny_checkpoint, seed=1)
    channels = Channels(Path(tmp_path_factory.mktemp("ch", numbered=True)))
    proc = spawn_engine(channels, tiny_cache, "builtin:tiny-llama", python=vllm_python,
                        log=root / "engine.log", backend="vllm",
                        engine_args={"enforce_eager": True, "max_model_len": 1024},
                        adapters={"one": str(root / "one")},
                        extra_env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        try:
            identity, ready = channels.wait_ready(READY_TIMEOUT_S)
        except AssertionError:
            proc.kill()
            raise AssertionError((root / "engine.log").read_text()[-4000:]) from None
        assert ready.adapters == ["one"], ready
        yield Engine(channels, identity), root
        os.kill(proc.pid, signal.SIGTERM)
        code, _ = exit_of(proc, 60)
        assert code == 128 + signal.SIGTERM, (root / "engine.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        channels.close()


def test_an_adapter_changes_greedy_output_deterministically_and_per_request(
        lora_engine: tuple[Engine, Path]):
    engine, _ = lora_engine
    engine.send(_gen("base"))
    base = _text(engine, "base")
    engine.send(_gen("one", "one"))
    one = _text(engine, "one")
    assert one != base, (one, base)
    # in one batch, each request with its own adapter (or none), as each answered alone
    for rid, adapter in (("one-again", "one"), ("base-again", None), ("one-third", "one")):
        engine.send(_gen(rid, adapter))
    assert [_text(engine, rid) for rid in ("one-again", "base-again", "one-third")] == [
        one, base, one]


def test_adapters_load_and_unload_at_run_time(lora_engine: tuple[Engine, Path],
                                              tiny_checkpoint: Path):
    engine, root = lora_engine
    two = make_tiny_llama_adapter(root / "two", tiny_checkpoint, seed=2, rank=16)
    loaded = engine.ask(proto.GenerateRequest("l-two", task=proto.TASK_LOAD_ADAPTER,
                                              adapter="two", adapter_path=str(two)))
    assert loaded.error is None and loaded.adapters == ["one", "two"], loaded
    for adapter in ("two", "one", None):
        engine.send(_gen(f"run-{adapter}", adapter))
    texts = {adapter: _text(engine, f"run-{adapter}") for adapter in ("two", "one", None)}
    assert len(set(texts.values())) == 3, texts

    unloaded = engine.ask(proto.GenerateRequest("u-two", task=proto.TASK_UNLOAD_ADAPTER,
                                                adapter="two"))
    assert unloaded.error is None and unloaded.adapters == ["one"], unloaded
    refused = engine.ask(_gen("two-gone", "two"))
    assert refused.rejected and refused.error == (
        "adapter 'two' is not loaded in this engine (loaded: one)"), refused
    engine.send(_gen("one-still", "one"))
    assert _text(engine, "one-still") == texts["one"]


def test_what_vllm_cannot_load_is_refused_naming_the_adapter(lora_engine: tuple[Engine, Path],
                                                             tiny_checkpoint: Path):
    engine, root = lora_engine
    big = make_tiny_llama_adapter(root / "big", tiny_checkpoint, seed=3, rank=32)
    refused = engine.ask(proto.GenerateRequest("l-big", task=proto.TASK_LOAD_ADAPTER,
                                               adapter="big", adapter_path=str(big)))
    assert refused.rejected and refused.error == (
        f"adapter 'big' ({big}) has rank 32, more than this engine's max_lora_rank 16 (set "
        f"engine_args.max_lora_rank)"), refused
    # weights that are not safetensors: vLLM's (safetensors') words
    corrupt = make_tiny_llama_adapter(root / "corrupt", tiny_checkpoint, seed=4)
    (corrupt / "adapter_model.safetensors").write_bytes(b"not safetensors")
    refused = engine.ask(proto.GenerateRequest("l-corrupt", task=proto.TASK_LOAD_ADAPTER,
                                               adapter="corrupt", adapter_path=str(corrupt)))
    assert refused.rejected and (refused.error or "").startswith(
        f"adapter 'corrupt' ({corrupt}): vLLM cannot load it: "), refused
    # an adapter of a larger model: torch's words when vLLM activates it, and nothing of it
    # stays loaded
    larger = root / "larger-model"
    larger.mkdir()
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    config.update(hidden_size=512, intermediate_size=1024, head_dim=128)
    (larger / "config.json").write_text(json.dumps(config))
    wrong = make_tiny_llama_adapter(root / "wrong", larger, seed=5)
    failed = engine.ask(proto.GenerateRequest("l-wrong", task=proto.TASK_LOAD_ADAPTER,
                                              adapter="wrong", adapter_path=str(wrong)))
    assert (failed.error or "").startswith("adapter 'wrong': load_adapter failed: "), failed
    listed = engine.ask(proto.GenerateRequest("l-one", task=proto.TASK_LOAD_ADAPTER,
                                              adapter="one", adapter_path=str(root / "one")))
    assert listed.error is None and listed.adapters == ["one"], listed
    unknown = engine.ask(_gen("nope", "nope"))
    assert unknown.rejected and "adapter 'nope' is not loaded" in (unknown.error or ""), unknown
    engine.send(_gen("fine"))
    assert _text(engine, "fine")  # the engine serves on
