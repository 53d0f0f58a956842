"""The vLLM tier's interpreter: a venv with vLLM (CPU build here) that the engines run under
(`python:` in the spec; the daemon itself runs in the dev venv and never imports vLLM).

ENGINED_VLLM_PYTHON names it; the default is <repo>/.venv-vllm/bin/python, which .ci/run
creates. Without it the tier skips, except under CI=true, where it fails.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from driver import REPO_ROOT

VLLM_PYTHON_ENV = "ENGINED_VLLM_PYTHON"
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
_PROBE = ("import importlib.util as u; "
          "print(all(u.find_spec(m) is not None for m in ('vllm', 'torch', 'zmq', 'msgspec')))")


def _unavailable(message: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message} (CI=true: the vLLM tier must run)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM venv's interpreter, as an absolute path (not resolved: a venv's python is a
    symlink, and the venv is only a venv through that link)."""
    path = os.path.abspath(os.environ.get(VLLM_PYTHON_ENV) or DEFAULT_VLLM_PYTHON)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        _unavailable(f"no vLLM interpreter at {path} (set {VLLM_PYTHON_ENV}, or create "
                     f"{DEFAULT_VLLM_PYTHON.parent.parent}: see the README, \"Run vLLM under "
                     f"engined\")")
    probe = subprocess.run([path, "-c", _PROBE], capture_output=True, text=True, timeout=60,
                           cwd=Path(path).parent)
    if probe.stdout.strip() != "True":
        _unavailable(f"{path} lacks vllm, torch, pyzmq or msgspec: {probe.stdout.strip()} "
                     f"{probe.stderr.strip()[-500:]}")
    return path
