"""The vLLM tier's interpreter: a venv with vLLM (CPU build here) that the engines run under
(`python:` in the spec; the daemon itself runs in the dev venv and never imports vLLM).

ENGINED_VLLM_PYTHON names it; the default is <repo>/.venv-vllm/bin/python, which .ci/run
creates. Without it the tier skips, except under CI=true, where it fails.
"""

from __future__ import annotations

import pytest

from testkit.driver import vllm_python_or_skip


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return vllm_python_or_skip("the vLLM tier")
