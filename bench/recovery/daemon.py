"""The two backends and the daemons they run under: tiny-llama (transformers) and the vLLM backend
(bench.vllm's engine), each a group of 2 replicas; `Daemon` is engined with every engine's
`launcher:` pinned (exec or forkserver, or forkserver with a warm standby); `Generate` sends
`POST /v1/generate` on one keep-alive connection to the control socket; `GatewayDaemon` is
engined with its gateway, whose engines may be on demand (sections 4-6).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import BenchDaemon, BenchError, KeepAlive, Tracker, wait_until
from bench.vllm.engine import engine_spec as vllm_engine_spec
from testkit.driver import Daemon as Driver
from testkit.driver import free_port, http_request

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


# --- the daemons ----------------------------------------------------------------------------------
class Engined(BenchDaemon):
    """bench.common.BenchDaemon (testkit/driver.py's Daemon: immediate restarts, 1 s heartbeats)
    whose status reads put every fork server seen into `server_pids` and the tracker."""

    log_lines = 30

    def status(self) -> dict[str, Any]:
        status = super().status()
        for server in self.fork_servers(status):
            self.server_pids.add(server["pid"])
            self.tracker.add(server["pid"])
        return status

    @staticmethod
    def fork_servers(status: dict[str, Any]) -> list[dict[str, Any]]:
        return [s for s in status["supervisor"].get("fork_servers") or [] if s.get("pid")]


class Daemon(Engined):
    """engined with one group of 2 replicas of `backend`, every engine's `launcher:` pinned, in
    /tmp/erXXXXXXXX."""

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

    def start(self, timeout_s: float | None = None, interval_s: float = 0.05) -> None:
        super().start(timeout_s or self.backend.start_timeout_s, interval_s)

    def wait_ready(self, min_incarnation: int, timeout_s: float | None = None,
                   interval_s: float = 0.02, name: str | None = None) -> dict[str, Any]:
        return super().wait_ready(min_incarnation, timeout_s or self.backend.ready_timeout_s,
                                  interval_s, name)


class GatewayDaemon(Engined):
    """engined with `engines` behind its gateway on a free loopback port (and more `supervisor`
    keys), in /tmp/<prefix>XXXXXXXX. Engines on demand start asleep: `start` waits for that."""

    def __init__(self, prefix: str, tracker: Tracker, engines: list[dict[str, Any]],
                 **supervisor: Any) -> None:
        self.gateway_port = free_port()
        super().__init__(prefix, tracker, engines, status_timeout_s=30.0, supervisor={
            "gateway": f"127.0.0.1:{self.gateway_port}", "launcher": "forkserver", **supervisor})
        self.log_engines = tuple(f"{e['name']}-0" for e in engines)
        self.on_demand = any(e.get("idle_timeout") for e in engines)

    def start(self, timeout_s: float | None = None, interval_s: float | None = None) -> None:
        if not self.on_demand:
            return super().start(timeout_s, interval_s)
        Driver.start(self, timeout_s or 60.0)  # until the control socket answers
        self.tracker.add(self.pid)
        wait_until(lambda: all(e["state"] == "ASLEEP" for e in self.status()["engines"]), 30,
                   "every engine ASLEEP")

    def sleep(self, name: str) -> None:
        """`enginectl sleep NAME`: POST /v1/engines/NAME/sleep, answered once it is ASLEEP."""
        code, _, body = http_request(self.socket, "POST", f"/v1/engines/{name}/sleep",
                                     b'{"timeout_s": 120}', timeout_s=130)
        if code != 200 or not all(e["ok"] for e in json.loads(body)["engines"]):
            raise BenchError(f"sleep {name}: HTTP {code}: {body[:300]!r}\n{self.log_tail()}")

    def wakes(self) -> int:
        """Wakes the daemon counted, every engine together (status: `on_demand.wakes`)."""
        return sum((e.get("on_demand") or {}).get("wakes", 0) for e in self.status()["engines"])


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
