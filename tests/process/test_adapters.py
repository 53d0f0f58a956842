"""Process level: LoRA adapters in an engine child (engine.adapters), on builtin:echo, which
"loads" an adapter directory and prefixes its output with "[name] ": the config's adapters are
loaded before READY (which lists them), a request names the one it generates with, the
load_adapter / unload_adapter tasks change them at run time, and what cannot be loaded is
refused with words that name the adapter and the cause. A backend without adapters (the
transformers one) fails its build with exit 78 before it loads a model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engined.engine import contract
from engined.engine import protocol as proto
from testkit.enginechild import LOAD_TIMEOUT_S, Channels, Engine, exit_of, spawn_engine
from testkit.lora import make_tiny_llama_adapter


@pytest.fixture
def adapter_dirs(tmp_path: Path, tiny_checkpoint: Path) -> dict[str, Path]:
    """Three real PEFT adapters of tiny-llama (echo reads only their adapter_config.json)."""
    return {name: make_tiny_llama_adapter(tmp_path / name, tiny_checkpoint, seed=seed)
            for seed, name in enumerate(("alpha", "beta", "gamma"))}


def _gen(rid: str, prompt: str, adapter: str | None = None, **fields) -> proto.GenerateRequest:
    return proto.GenerateRequest(rid, prompt, sampling=proto.Sampling(max_tokens=64),
                                 adapter=adapter, **fields)


def _load(rid: str, name: str, path: Path | str) -> proto.GenerateRequest:
    return proto.GenerateRequest(rid, task=proto.TASK_LOAD_ADAPTER, adapter=name,
                                 adapter_path=str(path))


def _unload(rid: str, name: str) -> proto.GenerateRequest:
    return proto.GenerateRequest(rid, task=proto.TASK_UNLOAD_ADAPTER, adapter=name)


def _refused(result: proto.GenerateResult, *words: str) -> None:
    assert result.rejected and result.finish_reason == "error", result
    assert result.error is not None and all(w in result.error for w in words), result.error


def test_config_adapters_are_loaded_before_ready_and_answer_by_name(
        channels: Channels, tiny_cache: Path, children, adapter_dirs: dict[str, Path]):
    proc = spawn_engine(channels, tiny_cache, "builtin:echo", adapters={
        "alpha": str(adapter_dirs["alpha"]), "beta": str(adapter_dirs["beta"])})
    children.append(proc)
    identity, ready = channels.wait_ready(LOAD_TIMEOUT_S)
    assert ready.adapters == ["alpha", "beta"]
    progress = [m.detail for m in channels.queued_control()
                if isinstance(m, proto.Progress) and m.phase == "adapters"]
    assert progress == [f"alpha from {adapter_dirs['alpha']}",
                        f"beta from {adapter_dirs['beta']}"], progress
    echo = Engine(channels, identity)

    assert echo.ask(_gen("base", "hello")).text == "hello"
    assert echo.ask(_gen("a", "hello", "alpha")).text == "[alpha] hello"
    assert echo.ask(_gen("b", "hello", "beta")).text == "[beta] hello"
    # the prefix is output like the rest: streamed, counted, and resumed exactly
    echo.send(_gen("s", "hi", "beta", stream=True))
    assert echo.result("s").completion_tokens == 9 and echo.text("s") == "[beta] hi"
    resumed = echo.ask(_gen("r", "hi", "alpha", resume=[ord(c) for c in "[alp"]))
    assert resumed.text == "ha] hi", resumed
    chat = echo.ask(proto.GenerateRequest("c", messages=[proto.ChatMessage("user", "yo")],
                                          adapter="beta"))
    assert chat.text == "[beta] yo"

    _refused(echo.ask(_gen("x", "hello", "gamma")),
             "adapter 'gamma' is not loaded in this engine (loaded: alpha, beta)")
    _refused(echo.ask(proto.GenerateRequest("t", "hi", task=proto.TASK_TOKENIZE,
                                            adapter="gamma")), "'gamma'")
    assert echo.ask(proto.GenerateRequest("t2", "hi", task=proto.TASK_TOKENIZE,
                                          adapter="alpha")).token_ids == [104, 105]


def test_adapters_load_and_unload_at_run_time(channels: Channels, tiny_cache: Path, children,
                                              adapter_dirs: dict[str, Path], tmp_path: Path):
    proc = spawn_engine(channels, tiny_cache, "builtin:echo",
                        adapters={"alpha": str(adapter_dirs["alpha"])})
    children.append(proc)
    identity, ready = channels.wait_ready(LOAD_TIMEOUT_S)
    echo = Engine(channels, identity)
    gamma = adapter_dirs["gamma"]

    loaded = echo.ask(_load("l1", "gamma", gamma))
    assert (loaded.error, loaded.rejected, loaded.adapters) == (None, False, ["alpha", "gamma"])
    assert echo.ask(_gen("g", "hey", "gamma")).text == "[gamma] hey"
    again = echo.ask(_load("l2", "gamma", gamma))  # the same directory: already loaded
    assert again.error is None and again.adapters == ["alpha", "gamma"], again
    _refused(echo.ask(_load("l3", "gamma", adapter_dirs["beta"])),
             "adapter 'gamma' is already loaded from", str(gamma))

    unloaded = echo.ask(_unload("u1", "gamma"))
    assert unloaded.error is None and unloaded.adapters == ["alpha"], unloaded
    _refused(echo.ask(_gen("g2", "hey", "gamma")),
             "adapter 'gamma' is not loaded in this engine (loaded: alpha)")
    _refused(echo.ask(_unload("u2", "gamma")), "adapter 'gamma' is not loaded")
    # loaded again, from another directory now that the name is free
    assert echo.ask(_load("l4", "gamma", adapter_dirs["beta"])).error is None
    assert echo.ask(_gen("g3", "hey", "gamma")).text == "[gamma] hey"
    assert proc.poll() is None


def _bad_adapters(tmp_path: Path, good: Path) -> dict[str, tuple[str, str]]:
    """name -> (path, words its refusal says), one per way a directory is no adapter."""
    empty = tmp_path / "empty"
    empty.mkdir()
    prefix = tmp_path / "prefix"
    prefix.mkdir()
    (prefix / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    return {"missing": (str(tmp_path / "nope"), f"{tmp_path / 'nope'} is not a directory"),
            "relative": ("alpha", "must be an absolute directory"),
            "empty": (str(empty), f"{empty} is not a LoRA adapter directory"),
            "prefix": (str(prefix), "peft_type 'PREFIX_TUNING', not LORA"),
            "broken": (str(broken), "cannot read"),
            "file": (str(good / "adapter_config.json"), "is not a directory")}


def test_what_is_not_an_adapter_is_refused_naming_it(channels: Channels, tiny_cache: Path,
                                                     children, adapter_dirs: dict[str, Path],
                                                     tmp_path: Path):
    proc = spawn_engine(channels, tiny_cache, "builtin:echo")
    children.append(proc)
    identity, ready = channels.wait_ready(LOAD_TIMEOUT_S)
    assert ready.adapters == []
    echo = Engine(channels, identity)
    for name, (path, words) in _bad_adapters(tmp_path, adapter_dirs["alpha"]).items():
        _refused(echo.ask(_load(f"l-{name}", name, path)), f"adapter {name!r}", words)
    _refused(echo.ask(_load("l-blank", "", adapter_dirs["alpha"])), "adapter name ''")
    assert echo.ask(_gen("fine", "still serving")).text == "still serving"


def test_a_config_adapter_that_is_none_exits_78_before_ready(channels: Channels,
                                                            tiny_cache: Path, children,
                                                            adapter_dirs: dict[str, Path],
                                                            tmp_path: Path):
    proc = spawn_engine(channels, tiny_cache, "builtin:echo", adapters={
        "alpha": str(adapter_dirs["alpha"]), "ghost": str(tmp_path / "ghost")})
    children.append(proc)
    code, out = exit_of(proc)
    assert code == contract.EXIT_CONFIG, out
    assert (f"{contract.CONFIG_LINE_PREFIX}adapter 'ghost': {tmp_path / 'ghost'} is not a "
            f"directory") in out, out
    assert not channels.requests.poll(0), "no READY after a config error"


def test_a_backend_without_adapters_exits_78_before_loading_its_model(
        channels: Channels, tiny_cache: Path, children, adapter_dirs: dict[str, Path]):
    proc = spawn_engine(channels, tiny_cache, "builtin:tiny-llama",
                        adapters={"alpha": str(adapter_dirs["alpha"])})
    children.append(proc)
    code, out = exit_of(proc)
    assert code == contract.EXIT_CONFIG, out
    assert (f"{contract.CONFIG_LINE_PREFIX}cannot load adapter 'alpha': LoRA adapters need "
            f"backend: vllm (this engine runs transformers)") in out, out
    assert "[load]" not in out, "refused before anything was loaded"
