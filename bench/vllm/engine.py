"""The engine under test and where it runs: etc/examples/vllm-cpu.yaml's `backend: vllm` engine
(builtin:tiny-llama, 1 thread), the vLLM interpreter, the environments of what runs under it, the
daemon that supervises it, and the workload every section sends it.

The vLLM interpreter: --vllm-python, else $ENGINED_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python
(as the vLLM test tier finds it, testkit/driver.py). bench.recovery runs the same engine.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

from bench.common import ROOT, BenchDaemon, BenchError, Tracker, without_engined_vars
from testkit.driver import DEFAULT_VLLM_PYTHON, VLLM_PYTHON_ENV, free_port

MAX_TOKENS = (16, 64)  # the headline first; two values to fit cost per request and per token
PROMPTS = [f"vllm benchmark prompt {i}: the quick brown fox" for i in range(8)]  # equal lengths
EXAMPLE = ROOT / "etc" / "examples" / "vllm-cpu.yaml"
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache per engine (as the vLLM tier)
ENGINE = "vllm-0"
GROUP = "vllm"  # also the gateway's model name (served_model_name defaults to it)
START_TIMEOUT_S = 300.0  # a vLLM start on a loaded 2-core box: import, config, weights, warm-up
# `vllm serve` (its console script fails in the vllm-cpu build: the module it runs), with the
# engine arguments engined's engine gets (etc/examples/vllm-cpu.yaml; engined sets
# max_num_seqs from max_batch_size and disable_log_stats by default)
SERVE_MODULE = "vllm.entrypoints.openai.api_server"
SERVE_ARGS = ["--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "8",
              "--disable-log-stats"]



# --- environment ----------------------------------------------------------------------------------
def default_vllm_python() -> str:
    """Not resolved: a venv's python is a symlink, and the venv is only a venv through it."""
    return os.path.abspath(os.environ.get(VLLM_PYTHON_ENV) or DEFAULT_VLLM_PYTHON)


def vllm_versions(python: str) -> str:
    probe = ("from importlib.metadata import version as v, PackageNotFoundError as E\n"
             "def get(*names):\n"
             "    for n in names:\n"
             "        try:\n"
             "            return f'{n} {v(n)}'\n"
             "        except E:\n"
             "            pass\n"
             "    return '?'\n"
             "print(get('vllm-cpu', 'vllm') + ', ' + get('torch'))")
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60,
                          cwd="/tmp", env=without_engined_vars(None, "PYTHONPATH"))
    if done.returncode != 0:
        raise BenchError(f"{python} does not run: {done.stderr[-500:]}")
    return done.stdout.strip()


def engine_spec(python: str, cache: Path) -> dict[str, Any]:
    """etc/examples/vllm-cpu.yaml's engine (backend, engine_args, env), one replica, 1 thread,
    max_batch_size 8 (vLLM's max_num_seqs), as the vLLM test tier runs it; started by exec
    (`launcher: exec`): each restart is a cold interpreter, which scenario 2 compares with a cold
    `vllm serve` (bench.recovery sets its own launcher)."""
    (example,) = yaml.safe_load(EXAMPLE.read_text())["engines"]
    env = {**example.get("env", {}), **VLLM_ENV, "ENGINED_CACHE_DIR": str(cache)}
    return {**example, "name": GROUP, "replicas": 1, "python": python, "threads": 1,
            "max_batch_size": 8, "launcher": "exec", "env": env}


def serve_env() -> dict[str, str]:
    """`vllm serve`'s environment: ours without ENGINED_* and PYTHONPATH, the same thread bound,
    KV cache size and offline switches as the engine child, usage stats off (engined's default
    for its vLLM engines too)."""
    env = without_engined_vars(None, "WATCHDOG_USEC", "WATCHDOG_PID", "PYTHONPATH")
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
                "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1", **VLLM_ENV})
    return env


# --- the daemon -----------------------------------------------------------------------------------
class BackendDaemon(BenchDaemon):
    """engined with one vLLM replica (`vllm-0`) in /tmp/evXXXXXXXX, the gateway and the HTTP
    endpoint on free loopback ports (testkit/driver.py's Daemon through bench.common.BenchDaemon:
    immediate restarts, 1 s heartbeats, 10 s heartbeat timeout)."""

    log_lines = 30
    log_engines = (ENGINE,)
    start_timeout_s, start_interval_s = START_TIMEOUT_S, 0.05
    ready_timeout_s, ready_interval_s = START_TIMEOUT_S, 0.02

    def __init__(self, spec: dict[str, Any], tracker: Tracker) -> None:
        self.gateway_port, self.http_port = free_port(), free_port()
        super().__init__("ev", tracker, [spec], http=f"127.0.0.1:{self.http_port}",
                         status_timeout_s=10.0,
                         supervisor={"gateway": f"127.0.0.1:{self.gateway_port}"})
