"""The vLLM example specs resolve as documented (no vLLM needed: this module is in the default
run). `engined --check` also requires each `python:` interpreter to exist on the host, so the
full check runs only where the example's venv is there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engined.supervisor.spec import parse_fleet
from testkit.driver import REPO_ROOT

EXAMPLES = REPO_ROOT / "etc" / "examples"


def _parse(name: str):
    path = EXAMPLES / name
    return parse_fleet(path.read_text(), str(path), base_dir=str(path.parent))


def test_cpu_example_resolves():
    fleet = _parse("vllm-cpu.yaml")
    (engine,) = fleet.engines
    assert engine.backend == "vllm" and engine.model.source == "builtin:tiny-llama"
    assert engine.gpus == ()
    # relative to the spec file: the repository's .venv-vllm, which .ci/run creates
    assert engine.python == str(REPO_ROOT / ".venv-vllm" / "bin" / "python")
    args = {k: json.loads(v) for k, v in engine.engine_args}
    assert args == {"enforce_eager": True, "max_model_len": 1024}
    assert dict(engine.env)["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_gpu_example_resolves_one_replica_per_gpu():
    fleet = _parse("vllm-gpu.yaml")
    assert [e.name for e in fleet.engines] == [f"chat-{i}" for i in range(8)]
    for i, engine in enumerate(fleet.engines):
        assert engine.backend == "vllm" and engine.gpus == (i,), engine
        assert engine.python == "/opt/vllm/bin/python"
        assert engine.model.path and engine.model.dtype == "bfloat16"
        args = {k: json.loads(v) for k, v in engine.engine_args}
        assert {"gpu_memory_utilization", "max_model_len"} <= set(args), args
        assert not {"model", "dtype", "max_num_seqs", "tensor_parallel_size"} & set(args)


@pytest.mark.parametrize("name", ["vllm-cpu.yaml", "vllm-gpu.yaml"])
def test_example_passes_check_where_its_venv_exists(name: str):
    python = _parse(name).engines[0].python
    assert python is not None
    if not os.path.isfile(python):
        pytest.skip(f"engined --check needs {python} (the example's vLLM venv)")
    done = subprocess.run([sys.executable, "-m", "engined.supervisor.daemon", "-c",
                           str(EXAMPLES / name), "--check"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "backend   vllm" in done.stdout, done.stdout


@pytest.mark.vllm
def test_cpu_example_passes_check_with_a_vllm_venv(vllm_python: str, tmp_path):
    """The vLLM tier has a venv: the CPU example passes the full check (its `python:` pointed at
    that venv when it is not the repository's .venv-vllm)."""
    text = (EXAMPLES / "vllm-cpu.yaml").read_text()
    assert "python: ../../.venv-vllm/bin/python" in text
    spec = tmp_path / "vllm-cpu.yaml"
    spec.write_text(text.replace("../../.venv-vllm/bin/python", vllm_python))
    done = subprocess.run([sys.executable, "-m", "engined.supervisor.daemon", "-c", str(spec),
                           "--check"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"python    {vllm_python}" in done.stdout, done.stdout


def test_vllm_serve_examples_resolve_as_command_engines():
    gpu = _parse("vllm-serve.yaml")
    assert [e.name for e in gpu.engines] == [f"chat-{i}" for i in range(8)]
    for i, engine in enumerate(gpu.engines):
        assert engine.is_command and engine.gpus == (i,) and engine.port == 8100 + i
        assert engine.command[:3] == ("/opt/vllm/bin/python", "-m",
                                      "vllm.entrypoints.openai.api_server")
        assert "{port}" in engine.command and engine.openai == "vllm"
        assert engine.progress is not None and engine.progress.counter.startswith("vllm:")
    (cpu,) = _parse("vllm-serve-cpu.yaml").engines
    assert cpu.command[0] == str(REPO_ROOT / ".venv-vllm" / "bin" / "python")
    assert cpu.cwd == str(REPO_ROOT) and cpu.port == 0 and cpu.probe is not None
    assert cpu.probe.path == "/health" and cpu.openai == "vllm"
