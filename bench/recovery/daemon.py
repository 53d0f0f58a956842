"""The two backends and the daemon they run under: tiny-llama (transformers) and the vLLM backend
(bench.vllm's engine), each a group of 2 replicas; `Daemon` is engined with every engine's
`launcher:` pinned (exec or forkserver, or forkserver with a warm standby); `Generate` sends
`POST /v1/generate` on one keep-alive connection to the control socket.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import BenchDaemon, BenchError, KeepAlive, Tracker
from bench.vllm.engine import engine_spec as vllm_engine_spec
from bench.vllm.engine import serve_env

LAUNCHERS = ("exec", "forkserver")
REPLICAS = 2  # per daemon: sharing between forked siblings shows in their PSS
SETTLE_S = 0.5  # after READY (and the other daemon's restart) before a kill
POLL_S = 0.01  # generate retries; status every STATUS_EVERY-th round
STATUS_EVERY = 2  # → a 20 ms status poll
PROMPT = "recovery benchmark: the quick brown fox"
MB = 1e6


# --- the two backends -----------------------------------------------------------------------------
@dataclass
class Backend:
    key: str  # "tiny" | "vllm"
    label: str
    spec: dict[str, Any]  # the engine group, without `launcher`
    start_timeout_s: float
    ready_timeout_s: float  # one restart

    @property
    def group(self) -> str:
        return str(self.spec["name"])


def tiny_backend(cache: Path) -> Backend:
    """bench/llm.py's replica (1 thread, max_batch_size 8), two of them."""
    return Backend("tiny", "tiny-llama (transformers)", {
        "name": "tiny", "replicas": REPLICAS, "model": "builtin:tiny-llama", "max_batch_size": 8,
        "threads": 1, "env": {"ENGINED_CACHE_DIR": str(cache)}}, 300.0, 120.0)


def vllm_backend(python: str, cache: Path) -> Backend:
    """bench.vllm's engine (etc/examples/vllm-cpu.yaml's: enforce_eager, max_model_len 1024,
    VLLM_CPU_KVCACHE_SPACE=1; 1 thread, max_batch_size 8), two replicas."""
    spec = {**vllm_engine_spec(python, cache), "replicas": REPLICAS}
    return Backend("vllm", "vLLM backend (`backend: vllm`)", spec, 600.0, 300.0)


def warm_vllm_imports(python: str) -> float:
    """One untimed `import vllm` in a throwaway process: the page cache holds vLLM's files
    before either daemon starts (the first daemon would read them from disk otherwise)."""
    started = time.monotonic()
    done = subprocess.run([python, "-c", "import vllm.v1.engine.llm_engine"], cwd="/tmp",
                          env=serve_env(), capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise BenchError(f"`import vllm` failed in {python}:\n{done.stderr[-2000:]}")
    return time.monotonic() - started


# --- the daemon -----------------------------------------------------------------------------------
class Daemon(BenchDaemon):
    """engined with one group of 2 replicas of `backend`, every engine's `launcher:` pinned, in
    /tmp/erXXXXXXXX (testkit/driver.py's Daemon through bench.common.BenchDaemon: immediate
    restarts, 1 s heartbeats)."""

    log_lines = 30

    def __init__(self, backend: Backend, launcher: str, tracker: Tracker,
                 standby: int = 0) -> None:
        """`standby`: 1 serving replica and that many warm standbys instead of 2 replicas."""
        self.backend, self.launcher = backend, launcher
        spec = {**backend.spec, "launcher": launcher}
        if standby:
            spec.update(replicas=1, standby=standby)
        super().__init__("er", tracker, [spec], status_timeout_s=10.0)
        self.replicas = spec["replicas"] + standby  # every engine, spares included
        self.log_engines = (f"{backend.group}-0",) + (
            ("forkserver",) if launcher == "forkserver" else ())
        self.server_pids: set[int] = set()
        self.start_wall_s: float | None = None

    def start(self, timeout_s: float | None = None, interval_s: float = 0.05) -> None:
        started = time.monotonic()
        super().start(timeout_s or self.backend.start_timeout_s, interval_s)
        self.start_wall_s = time.monotonic() - started
        self.fork_servers()

    def wait_ready(self, min_incarnation: int, timeout_s: float | None = None,
                   interval_s: float = 0.02, name: str | None = None) -> dict[str, Any]:
        return super().wait_ready(min_incarnation, timeout_s or self.backend.ready_timeout_s,
                                  interval_s, name)

    def fork_servers(self, status: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """`supervisor.fork_servers` (every pid seen goes to the tracker)."""
        servers = list((status or self.status())["supervisor"].get("fork_servers") or [])
        for s in servers:
            if s.get("pid"):
                self.server_pids.add(s["pid"])
                self.tracker.add(s["pid"])
        return servers

    def child_load_s(self, name: str, incarnation: int) -> float | None:
        """The child's own build → warm-up time, from its `[ready]` log line."""
        pattern = rf"^\[ready\] {re.escape(name)} incarnation (\d+) loaded in ([0-9.]+)s"
        for inc, load_s in re.findall(pattern, self.log_text(name), re.M):
            if int(inc) == incarnation:
                return float(load_s)
        return None


class Generate(KeepAlive):
    """`POST /v1/generate` on one keep-alive connection to the control socket."""

    def __init__(self, socket_path: str, timeout_s: float = 120.0) -> None:
        super().__init__(socket_path, timeout_s)

    def once(self, engine: str, max_tokens: int = 1) -> tuple[int, dict[str, Any]]:
        body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "engine": engine,
                           "timeout_s": self.timeout_s - 10}).encode()
        status, data = self.round_trip("POST", "/v1/generate", body,
                                       {"Content-Type": "application/json"})
        try:
            parsed = json.loads(data or b"{}")
        except ValueError:
            parsed = {"raw": data[:200].decode(errors="replace")}
        return status, parsed if isinstance(parsed, dict) else {"raw": parsed}
