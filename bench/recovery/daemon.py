"""The two backends and the daemon they run under: tiny-llama (transformers) and the vLLM backend
(bench.vllm's engine), each a group of 2 replicas; `Daemon` is engined with every engine's
`launcher:` pinned (exec or forkserver, or forkserver with a warm standby); `Generate` sends
`POST /v1/generate` on one keep-alive connection to the control socket.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import BenchDaemon, KeepAlive, Tracker
from bench.vllm.engine import engine_spec as vllm_engine_spec

LAUNCHERS = ("exec", "forkserver")
REPLICAS = 2  # per daemon: sharing between forked siblings shows in their PSS
PROMPT = "recovery benchmark: the quick brown fox"


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
    """Two replicas of 1 thread, max_batch_size 8."""
    return Backend("tiny", "tiny-llama (transformers)", {
        "name": "tiny", "replicas": REPLICAS, "model": "builtin:tiny-llama", "max_batch_size": 8,
        "threads": 1, "env": {"ENGINED_CACHE_DIR": str(cache)}}, 300.0, 120.0)


def vllm_backend(python: str, cache: Path) -> Backend:
    """bench.vllm's engine (etc/examples/vllm-cpu.yaml's: enforce_eager, max_model_len 1024,
    VLLM_CPU_KVCACHE_SPACE=1; 1 thread, max_batch_size 8), two replicas."""
    spec = {**vllm_engine_spec(python, cache), "replicas": REPLICAS}
    return Backend("vllm", "vLLM backend (`backend: vllm`)", spec, 600.0, 300.0)


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

    def start(self, timeout_s: float | None = None, interval_s: float = 0.05) -> None:
        super().start(timeout_s or self.backend.start_timeout_s, interval_s)
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
