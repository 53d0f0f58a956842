"""`backend: vllm` under an interpreter without vLLM: exit 78 naming vllm and how to install it,
FAILED at once (no vLLM needed: this module is in the default run; the dev venv has none)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from testkit.driver import REPO_ROOT

SUPERVISOR = {"heartbeat_interval": "0.2s", "heartbeat_timeout": "5s"}


def test_backend_vllm_without_vllm_is_exit_78_with_a_hint(engined, short_tmp):
    # asked in a fresh interpreter: in this one tests/ is on sys.path, and tests/vllm is a
    # namespace package named vllm
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                            "print(u.find_spec('vllm') is None)"], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=60)
    if probe.stdout.strip() != "True":
        pytest.skip(f"{sys.executable} has vllm")
    engine = {"name": "novllm", "model": "builtin:tiny-llama", "backend": "vllm",
              "env": {"ENGINED_CACHE_DIR": str(short_tmp / "cache")}}
    d = engined([engine], supervisor=SUPERVISOR, ready=False)
    failed = d.wait_state("novllm-0", "FAILED", timeout_s=120)
    d.holds(lambda: d.engine("novllm-0")["incarnation"] == 1, 0.5, "a single spawn")
    assert failed["last_exit"]["code"] == 78, failed
    reason = d.engine("novllm-0")["fail_reason"]
    assert "needs vllm" in reason and "'vllm' cannot be imported" in reason, reason
    assert "-m pip install vllm" in reason, reason
    assert not (short_tmp / "cache").exists()  # it stopped before building any model
