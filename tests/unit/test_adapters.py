"""LoRA adapters' pure parts (engine.adapters, engine.vllm_lora): what a directory must be, the
registry's answers (idempotent loads, fresh slots, refusals naming the adapter), the vLLM engine
arguments an engine with adapters gets, and what a backend without adapters answers to the
adapter tasks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engined.engine import protocol as proto
from engined.engine.adapters import Adapters, check_config_adapters, read_adapter
from engined.engine.backend import Backend, EngineConfigError, RequestRejected
from engined.engine.requests import RequestTable
from engined.engine.vllm_lora import lora_kwargs, lora_rank


def _adapter(root: Path, name: str, config: Any) -> str:
    directory = root / name
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return str(directory)


def test_an_adapter_directory_is_read_for_its_rank(tmp_path: Path):
    path = _adapter(tmp_path, "a", {"peft_type": "LORA", "r": 8})
    adapter = read_adapter("a", path + "/")
    assert (adapter.name, adapter.path, adapter.rank) == ("a", path, 8)


@pytest.mark.parametrize("config, words", [
    ({"peft_type": "LORA"}, "has no LoRA rank r (got None)"),
    ({"r": 0}, "has no LoRA rank r (got 0)"),
    ({"r": True}, "has no LoRA rank r"),
    ({"peft_type": "IA3", "r": 8}, "peft_type 'IA3', not LORA"),
    ([8], "is not a JSON object"),
])
def test_a_config_that_is_not_a_plain_lora_is_refused(tmp_path: Path, config: Any, words: str):
    with pytest.raises(RequestRejected, match="adapter 'x': .*" + words.replace("(", r"\(")
                       .replace(")", r"\)")):
        read_adapter("x", _adapter(tmp_path, "x", config))


@pytest.mark.parametrize("name", ["", " a", "a\n", "b\x00"])
def test_a_name_must_be_printable_and_trimmed(tmp_path: Path, name: str):
    with pytest.raises(RequestRejected, match="adapter name"):
        read_adapter(name, _adapter(tmp_path, "a", {"r": 8}))


def test_the_registry_loads_idempotently_and_refuses_a_second_directory(tmp_path: Path):
    one = _adapter(tmp_path, "one", {"r": 8})
    two = _adapter(tmp_path, "two", {"r": 16})
    loaded = Adapters()
    first = loaded.prepare("a", one)
    assert first is not None and first.slot == 1
    loaded.add(first)
    assert loaded.prepare("a", one) is None  # already loaded from there
    with pytest.raises(RequestRejected, match=f"adapter 'a' is already loaded from {one}"):
        loaded.prepare("a", two)
    second = loaded.prepare("b", two)
    assert second is not None and second.slot == 2
    loaded.add(second)
    assert loaded.names() == ["a", "b"]
    assert loaded.remove("a") == first
    with pytest.raises(RequestRejected, match=r"adapter 'a' is not loaded in this engine "
                                              r"\(loaded: b\)"):
        loaded.get("a")
    again = loaded.prepare("a", two)  # a fresh slot: vLLM never sees the old weights under it
    assert again is not None and again.slot == 3
    with pytest.raises(RequestRejected, match=r"\(loaded: none\)"):
        Adapters().remove("a")


def test_config_adapters_that_are_not_are_configuration_errors(tmp_path: Path):
    assert [a.rank for a in check_config_adapters({"a": _adapter(tmp_path, "a", {"r": 32})})] \
        == [32]
    with pytest.raises(EngineConfigError, match="adapter 'b': .* is not a directory"):
        check_config_adapters({"b": str(tmp_path / "nope")})


@pytest.mark.parametrize("needed, rank", [(0, 16), (8, 16), (16, 16), (17, 32), (64, 64),
                                          (300, 320), (512, 512), (600, 600)])
def test_max_lora_rank_is_the_smallest_vllm_takes_that_fits(needed: int, rank: int):
    assert lora_rank(needed) == rank


def _config(adapters: dict[str, str], engine_args: dict[str, Any],
            max_batch_size: int = 8) -> proto.EngineConfig:
    return proto.EngineConfig(
        name="e-0", group="e", rank=0, replicas=1, incarnation=1, model="builtin:tiny-llama",
        dtype=None, gpus=[], data_parallel=False, max_batch_size=max_batch_size, threads=1,
        control_endpoint="ipc:///c", request_endpoint="ipc:///r", heartbeat_interval_s=1.0,
        backend="vllm", engine_args=engine_args, adapters=adapters)


def test_vllm_engine_args_for_adapters(tmp_path: Path):
    many = {f"a{i}": _adapter(tmp_path, f"a{i}", {"r": 8 if i else 32}) for i in range(6)}
    assert lora_kwargs(_config({}, {})) == {}
    assert lora_kwargs(_config({}, {"enable_lora": True})) == {
        "enable_lora": True, "max_loras": 4, "max_lora_rank": 16, "max_cpu_loras": 4}
    assert lora_kwargs(_config(many, {})) == {
        "enable_lora": True, "max_loras": 6, "max_lora_rank": 32, "max_cpu_loras": 6}
    assert lora_kwargs(_config(many, {}, max_batch_size=2)) == {
        "enable_lora": True, "max_loras": 2, "max_lora_rank": 32, "max_cpu_loras": 6}
    assert lora_kwargs(_config(many, {"max_loras": 1, "max_lora_rank": 64})) == {
        "enable_lora": True, "max_loras": 1, "max_lora_rank": 64, "max_cpu_loras": 6}
    with pytest.raises(EngineConfigError, match="engine_args.enable_lora is false"):
        lora_kwargs(_config(many, {"enable_lora": False}))


class _Plain(Backend):
    """A backend without adapters: Backend's defaults."""

    device, dtype, kind, burst_window = "cpu", "float32", "transformers", False


def test_a_backend_without_adapters_refuses_the_tasks_and_requests():
    sent: list[Any] = []
    table = RequestTable(_Plain(), "e-0", 1, sent.append)
    table.admit(proto.GenerateRequest("l", task=proto.TASK_LOAD_ADAPTER, adapter="a",
                                      adapter_path="/x"))
    table.admit(proto.GenerateRequest("u", task=proto.TASK_UNLOAD_ADAPTER, adapter="a"))
    table.admit(proto.GenerateRequest("g", "hi", adapter="a"))
    assert [(r.id, r.rejected, r.error) for r in sent] == [
        (rid, True, "LoRA adapters need backend: vllm (this engine runs transformers)")
        for rid in ("l", "u", "g")]
    assert _Plain().adapters() == []
