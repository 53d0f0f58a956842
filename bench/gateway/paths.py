"""The paths a request takes to an engine: the workload (prompts, models, max_tokens), the four
paths (direct over ZeroMQ and the gateway, each streamed and not), `Direct` (the daemon's own
engine channels in this process, with engine children of their own), `GatewayDaemon` (engined
with the gateway on a free port) and `Clients` (one request on any path).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    BenchDaemon,
    BenchError,
    Cleanup,
    EngineChannels,
    Tracker,
    child_environment,
    expose_engine_package,
    terminate,
)
from testkit.driver import free_port

MAX_TOKENS = 64
CONCURRENCY = (1, 8)
# Equal lengths (the transformers backend pads a batch to its longest prompt); 66 characters:
# the echo engine's answer is the first 64 (finish "length"), like tiny-llama's 64 tokens.
PROMPTS = [f"gateway benchmark prompt {i:02d}: the quick brown fox jumps over a dog" for i in
           range(max(CONCURRENCY))]
MODELS = {  # group -> (model, label)
    "tiny": ("builtin:tiny-llama", "tiny-llama (transformers, 1 thread)"),
    "echo": ("builtin:echo", "echo (no compute: pure overhead)"),
}


# --- samples --------------------------------------------------------------------------------------
@dataclass
class Sample:
    latency_s: float
    tokens: int
    text: str


@dataclass
class Round:
    elapsed_s: float  # first send -> last answer
    samples: list[Sample]
    cpu_s: tuple[float, float, float] = (0.0, 0.0, 0.0)  # on-CPU: engine, daemon, this process


def on_cpu_s(pid: int) -> float:
    """Time the process's threads have spent on a CPU (/proc/PID/task/*/schedstat, in ns: finer
    than the 10 ms ticks of cpu_times())."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that just ended
    return total / 1e9


@dataclass(frozen=True)
class Route:
    key: str
    label: str
    streamed: bool

    @property
    def baseline(self) -> str:
        return "direct-stream" if self.streamed else "direct"


PATHS = [
    Route("direct", "direct: engine protocol over ZeroMQ", False),
    Route("direct-stream", "direct: engine protocol over ZeroMQ, streamed", True),
    Route("gateway", "gateway `/v1/completions` (aiohttp)", False),
    Route("gateway-stream", "gateway `/v1/completions`, streamed SSE (aiohttp)", True),
]
PATH = {p.key: p for p in PATHS}


# --- direct: the daemon's own engine channels, in this process ------------------------------------
class Direct:
    """`supervisor/ipc.py`'s EngineChannels (a PULL for control messages and a ROUTER for
    requests, exactly as the daemon binds them) in a scratch directory, and one engine child per
    model (`python -m engined.engine`, exec'd with `launcher.child_environment` as engined's exec
    launcher does: same interpreter, thread bounds, offline flags, engine package on PYTHONPATH).
    Requests go through `EngineChannels.open`, the call the daemon's gateway and control socket
    make: the direct path is the daemon's IPC code without the daemon around it."""

    def __init__(self, cleanup: Cleanup, tracker: Tracker, cache: Path) -> None:
        self.dir = cleanup.scratch("egd")
        self.tracker, self.cache = tracker, cache
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ready: dict[str, asyncio.Future[None]] = {}
        self.channels: Any = None

    def _on_message(self, msg: Any) -> str | None:
        from engined.engine.protocol import Ready
        future = self.ready.get(msg.engine)
        if isinstance(msg, Ready) and future is not None and not future.done():
            future.set_result(None)
        return None

    async def start(self, models: dict[str, str]) -> None:
        from engined.engine.contract import ENV_CONFIG, ENV_OWNER, ENV_PARENT_PID
        from engined.engine.protocol import EngineConfig

        loop = asyncio.get_running_loop()
        self.channels = EngineChannels(str(self.dir), self._on_message)
        self.channels.start()
        pythonpath = expose_engine_package(self.dir / "python")
        # TMPDIR: the scratch dir, in place of the TMPDIR of its own a daemon would make
        extra = {"ENGINED_CACHE_DIR": str(self.cache), "TMPDIR": str(self.dir)}
        for name, model in models.items():
            config = EngineConfig(
                name=name, group=name, rank=0, replicas=1, incarnation=1, model=model,
                dtype=None, gpus=[], data_parallel=False, max_batch_size=8, threads=1,
                control_endpoint=self.channels.control_endpoint,
                request_endpoint=self.channels.request_endpoint, heartbeat_interval_s=1.0)
            env = child_environment(config, extra, pythonpath)
            keep = {ENV_CONFIG, ENV_PARENT_PID, ENV_OWNER, "ENGINED_NUM_THREADS", *extra}
            env = {k: v for k, v in env.items() if not k.startswith("ENGINED_") or k in keep}
            env["PYTHONPATH"] = pythonpath  # like the daemon's children: nothing else of ours
            self.ready[name] = loop.create_future()
            with open(self.dir / f"{name}.log", "ab") as log:
                # From this (the event-loop) thread: the child's PR_SET_PDEATHSIG is tied to it.
                proc = subprocess.Popen([sys.executable, "-m", "engined.engine"], cwd=self.dir,
                                        env=env, stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=log, start_new_session=True)
            self.procs[name] = proc
            self.tracker.add(proc.pid)
        deadline = time.monotonic() + 300
        for name, future in self.ready.items():
            while not future.done():
                if self.procs[name].poll() is not None:
                    raise BenchError(f"direct engine {name} exited with "
                                     f"{self.procs[name].returncode}:\n{self.log_tail(name)}")
                if time.monotonic() > deadline:
                    raise BenchError(f"direct engine {name} sent no READY:\n"
                                     f"{self.log_tail(name)}")
                await asyncio.wait([future], timeout=0.1)

    def log_tail(self, name: str) -> str:
        try:
            return "\n".join((self.dir / f"{name}.log").read_text(errors="replace")
                             .splitlines()[-20:])
        except FileNotFoundError:
            return ""

    def open(self, engine: str, prompt: str, stream: bool) -> Any:
        from engined.engine import protocol as proto
        request = proto.GenerateRequest(uuid.uuid4().hex, prompt=prompt, sampling=proto.Sampling(
            max_tokens=MAX_TOKENS, temperature=0.0), stream=stream)
        return self.channels.open((engine, 1), request)

    async def stop(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(terminate, p, 10)
                               for p in self.procs.values()))
        if self.channels is not None:
            await self.channels.close()
            self.channels = None


# --- engined --------------------------------------------------------------------------------------
class GatewayDaemon(BenchDaemon):
    """engined (bench.common.BenchDaemon: immediate restarts, 1 s heartbeats) with the gateway on
    a free loopback port (and, for the failover's counters, `http:` on another)."""

    log_lines = 30

    def __init__(self, prefix: str, tracker: Tracker, engines: list[dict[str, Any]],
                 http: bool = False) -> None:
        self.gateway_port = free_port()
        self.http_port = free_port() if http else None
        super().__init__(prefix, tracker, engines,
                         f"127.0.0.1:{self.http_port}" if http else "off", status_timeout_s=10.0,
                         supervisor={"gateway": f"127.0.0.1:{self.gateway_port}"})
        self.log_engines = tuple(f"{e['name']}-0" for e in engines)


# --- one request on each path ---------------------------------------------------------------------
class Clients:
    """One keep-alive aiohttp session on the gateway, and the direct channels."""

    def __init__(self, direct: Direct, gateway_port: int) -> None:
        import aiohttp

        self.direct = direct
        self.gateway = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
            limit=0, keepalive_timeout=5), timeout=aiohttp.ClientTimeout(total=300))
        self.base = f"http://127.0.0.1:{gateway_port}/v1"

    async def close(self) -> None:
        await self.gateway.close()

    async def one(self, path: str, group: str, prompt: str) -> Sample:
        return await getattr(self, "_" + path.replace("-", "_"))(group, prompt)

    async def _direct(self, group: str, prompt: str, stream: bool = False) -> Sample:
        from engined.engine import protocol as proto
        started = time.perf_counter()
        parts = []
        s = self.direct.open(group, prompt, stream)
        try:
            async for item in s:
                if isinstance(item, proto.TokenChunk):
                    parts.append(item.text)
                    continue
                if item.error is not None:
                    raise BenchError(f"direct {group}: {item.error}")
                parts.append(item.text)
                return Sample(time.perf_counter() - started, item.completion_tokens,
                              "".join(parts))
        finally:
            s.close()
        raise BenchError(f"direct {group}: the stream ended without a result")

    async def _direct_stream(self, group: str, prompt: str) -> Sample:
        return await self._direct(group, prompt, stream=True)

    def _gateway_body(self, group: str, prompt: str, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": group, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                "temperature": 0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def _gateway(self, group: str, prompt: str) -> Sample:
        started = time.perf_counter()
        async with self.gateway.post(f"{self.base}/completions",
                                     json=self._gateway_body(group, prompt, False)) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise BenchError(f"gateway: HTTP {resp.status}: {data}")
        return Sample(time.perf_counter() - started, data["usage"]["completion_tokens"],
                      data["choices"][0]["text"])

    async def _gateway_stream(self, group: str, prompt: str) -> Sample:
        started = time.perf_counter()
        parts, tokens = [], -1
        async with self.gateway.post(f"{self.base}/completions",
                                     json=self._gateway_body(group, prompt, True)) as resp:
            if resp.status != 200:
                raise BenchError(f"gateway (stream): HTTP {resp.status}: {await resp.text()}")
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    return Sample(time.perf_counter() - started, tokens, "".join(parts))
                data = json.loads(payload)
                if "error" in data:
                    raise BenchError(f"gateway (stream): {data['error']}")
                if data.get("choices"):
                    parts.append(data["choices"][0]["text"])
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
        raise BenchError("gateway (stream): no [DONE]")
