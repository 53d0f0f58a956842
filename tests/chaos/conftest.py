"""Fixtures for the fault-injection tier: the tiny-llama cache and fleet-wide process checks.

The tiny-llama checkpoint is built once per session into its own ENGINED_CACHE_DIR (the same idea
as tests/e2e/test_tiny_llama.py's fixture; test modules never import each other).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import PYTHON, REPO_ROOT, _clean_env


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A session-wide ENGINED_CACHE_DIR with the tiny-llama checkpoint built once, up front."""
    cache = tmp_path_factory.mktemp("engined-cache")
    env = {**_clean_env(), "ENGINED_CACHE_DIR": str(cache)}
    done = subprocess.run(
        [PYTHON, "-c", "from engine.llm import tiny_llama_dir; "
                       "print(tiny_llama_dir(lambda phase, detail: None))"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (Path(done.stdout.strip()) / "config.json").is_file(), done.stdout
    return cache
