"""What runs: the engine under test (etc/examples/vllm-cpu.yaml's `backend: vllm` engine on
builtin:tiny-llama, 1 thread), the same model behind `vllm serve` (alone, and under engined as a
command engine), the vLLM interpreter and the environments, and the daemon with both engines
behind its gateway.

The vLLM interpreter: --vllm-python, else $ENGINED_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python
(as the vLLM test tier finds it, testkit/driver.py). bench.recovery runs the same engine.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from bench.common import (
    ROOT,
    BenchDaemon,
    BenchError,
    Tracker,
    terminate,
    wait_until,
    without_engined_vars,
)
from testkit.driver import DEFAULT_VLLM_PYTHON, VLLM_PYTHON_ENV, free_port

EXAMPLE = ROOT / "etc" / "examples" / "vllm-cpu.yaml"
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache per engine (as the vLLM tier)
GROUP, SERVED = "vllm", "served"  # the two groups' names, also their model names at the gateway
START_TIMEOUT_S = 300.0  # a vLLM start on a loaded 2-core box: import, config, weights, warm-up
SEQS = 32  # max_num_seqs of every server (engined: max_batch_size)
# `vllm serve` (its console script fails in the vllm-cpu build: the module it runs) with the
# engine arguments of engined's engine. Log stats stay on, `vllm serve`'s default: the command
# engine's `progress: vllm` reads them, and the bare server runs the same argv.
SERVE_MODULE = "vllm.entrypoints.openai.api_server"
SERVE_ARGS = ["--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", str(SEQS)]


def default_vllm_python() -> str:
    """Not resolved: a venv's python is a symlink, and the venv is only a venv through it."""
    return os.path.abspath(os.environ.get(VLLM_PYTHON_ENV) or DEFAULT_VLLM_PYTHON)


def vllm_versions(python: str) -> str:
    probe = ("from importlib.metadata import version as v, distributions\n"
             "n = 'vllm-cpu' if any(d.metadata['Name'] == 'vllm-cpu' for d in distributions()) "
             "else 'vllm'\n"
             "print(f\"{n} {v(n)}, torch {v('torch')}\")")
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60,
                          cwd="/tmp", env=without_engined_vars(None, "PYTHONPATH"))
    if done.returncode != 0:
        raise BenchError(f"{python} does not run: {done.stderr[-500:]}")
    return done.stdout.strip()


def engine_spec(python: str, cache: Path) -> dict[str, Any]:
    """etc/examples/vllm-cpu.yaml's engine (backend, engine_args, env), one replica, 1 thread,
    max_batch_size 8 (vLLM's max_num_seqs), started by exec (each restart a cold interpreter;
    bench.recovery sets its own launcher)."""
    (example,) = yaml.safe_load(EXAMPLE.read_text())["engines"]
    env = {**example.get("env", {}), **VLLM_ENV, "ENGINED_CACHE_DIR": str(cache)}
    return {**example, "name": GROUP, "replicas": 1, "python": python, "threads": 1,
            "max_batch_size": 8, "launcher": "exec", "env": env}


def serve_env() -> dict[str, str]:
    """`vllm serve`'s environment: ours without ENGINED_* and PYTHONPATH, the engine child's
    thread bound, KV cache size and offline switches, usage stats off."""
    env = without_engined_vars(None, "WATCHDOG_USEC", "WATCHDOG_PID", "PYTHONPATH")
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
                "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1", **VLLM_ENV})
    return env


def served_spec(python: str, model: Path, cwd: Path) -> dict[str, Any]:
    """`vllm serve` as a command engine (tests/vllm/test_vllm_serve.py's), the bare server's
    argv; probes on its /health, `progress: vllm` on its Prometheus counters."""
    env = {k: v for k, v in serve_env().items() if k in (
        "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS", "PYTHONUNBUFFERED", *VLLM_ENV)}
    return {"name": SERVED, "replicas": 1, "cwd": str(cwd), "port": "auto", "progress": "vllm",
            "command": [python, "-m", SERVE_MODULE, "--model", str(model), "--host", "127.0.0.1",
                        "--port", "{port}", *SERVE_ARGS],
            "probe": {"path": "/health", "interval": "1s", "timeout": "2s", "failures": 3},
            "env": env, "startup_timeout": "5m", "stall_timeout": "5s"}


class Daemon(BenchDaemon):
    """engined with the `backend: vllm` engine and `vllm serve` as a command engine behind its
    gateway (a free loopback port), in /tmp/evXXXXXXXX; immediate
    restarts, 1 s heartbeats."""

    log_lines = 30
    log_engines = (f"{GROUP}-0", f"{SERVED}-0")
    start_timeout_s, ready_timeout_s = START_TIMEOUT_S, START_TIMEOUT_S

    def __init__(self, backend: dict[str, Any], model: Path, cwd: Path,
                 tracker: Tracker) -> None:
        self.gateway_port = free_port()
        engines = [backend, served_spec(backend["python"], model, cwd)]
        super().__init__("ev", tracker, engines, status_timeout_s=10.0,
                         supervisor={"gateway": f"127.0.0.1:{self.gateway_port}"})


def post_json(port: int, path: str, body: dict[str, Any], timeout_s: float = 120.0
              ) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


def health(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


class VllmServe:
    """`python -m vllm.entrypoints.openai.api_server` on a free loopback port, in its own
    session (and TMPDIR in the bench's scratch), every descendant it had recorded."""

    def __init__(self, python: str, model: Path, scratch: Path, tracker: Tracker) -> None:
        self.model, self.scratch, self.tracker = model, scratch, tracker
        self.port = free_port()
        self.log_path = scratch / "serve.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.seen: dict[int, psutil.Process] = {}
        self.argv = [python, "-m", SERVE_MODULE, "--model", str(model), "--host", "127.0.0.1",
                     "--port", str(self.port), *SERVE_ARGS]

    def start(self) -> None:
        tmpdir = self.scratch / "serve-tmp"
        tmpdir.mkdir(exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, cwd=self.scratch,
                                         env={**serve_env(), "TMPDIR": str(tmpdir)},
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.tracker.add(self.proc.pid)

    def track(self) -> list[int]:
        """Every descendant seen goes to the tracker (and to our own list, for stop())."""
        assert self.proc is not None
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)
                self.tracker.add(p.pid)
        except psutil.NoSuchProcess:
            pass
        return [self.proc.pid, *self.seen]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_health(self, timeout_s: float = START_TIMEOUT_S) -> None:
        def healthy() -> bool:
            if not self.alive():
                raise BenchError(f"vllm serve exited with {self.proc.returncode}")
            self.track()
            return health(self.port)
        try:
            wait_until(healthy, timeout_s, "vllm serve /health 200", 0.05)
        except BenchError as exc:
            tail = self.log_path.read_text(errors="replace").splitlines()[-25:]
            raise BenchError(f"{exc}\n" + "\n".join(tail)) from None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.alive():
            self.track()
        terminate(self.proc, 30)
        _, alive = psutil.wait_procs(list(self.seen.values()), timeout=10)
        for p in alive:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass


def warm(port: int, model: str) -> None:
    """Untimed completions until one answers 200 (a command engine may be restarting: engined's
    canary request kills a fresh `vllm serve` of this wheel on this CPU, see bench/README.md)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            code, body = post_json(port, "/v1/completions", {
                "model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0})
        except OSError as exc:
            code, body = 0, {"error": str(exc)}
        if code == 200:
            return
        if time.monotonic() > deadline:
            raise BenchError(f"{model}: no first completion within {START_TIMEOUT_S:g} s: "
                             f"HTTP {code}: {body}")
        time.sleep(1.0)
