"""The models the benchmarks serve: builtin:tiny-llama's checkpoint (and a heavier one from the
same recipe), built once per cache directory, untimed, exactly as an engine builds it on first
use, and the environment of a process that builds or loads one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import ROOT, BenchError, without_engined_vars


def model_env(cache: Path, **extra: str) -> dict[str, str]:
    """For a process that builds or loads the model, like an engine child's environment: one
    thread, offline, no GPU. No PYTHONPATH: the installed package is what runs (and `python -m
    bench.NAME` finds bench/ from the repository root)."""
    env = without_engined_vars(None, "WATCHDOG_USEC", "WATCHDOG_PID", "PYTHONPATH")
    env.update({"ENGINED_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
                "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def build_checkpoint(cache: Path, name: str | None = None,
                     dims: dict[str, Any] | None = None) -> Path:
    """Build the tiny model into `cache` (untimed), exactly as an engine would on first use; with
    `name` and `dims`, the same recipe at other dimensions (`engine.checkpoint.recipe_dir`)."""
    code = ("import json, sys; from engined.engine.checkpoint import recipe_dir, tiny_llama_dir; "
            "quiet = lambda phase, detail: None; "
            "print(recipe_dir(sys.argv[1], json.loads(sys.argv[2]), quiet) if len(sys.argv) > 1 "
            "else tiny_llama_dir(quiet))")
    extra = [name, json.dumps(dims)] if name is not None else []
    done = subprocess.run([sys.executable, "-c", code, *extra], cwd=ROOT, env=model_env(cache),
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise BenchError(f"building {name or 'tiny-llama'} failed:\n{done.stderr[-2000:]}")
    return Path(done.stdout.strip())
