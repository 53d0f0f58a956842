"""Gateway benchmark: what the OpenAI-compatible gateway costs, and what it saves when engines die.

    python -m bench.gateway [--quick] [--out FILE]   # default bench/results/gateway.md,
                                                      # --quick: bench/results/gateway-quick.md

1. Overhead against talking to the engine directly, at 1 and 8 concurrent requests, for
   `builtin:tiny-llama` (transformers, real compute) and `builtin:echo` (no compute: pure
   overhead). Paths, in alternating order: direct (a client in this process speaking the engine's
   own request protocol over ZeroMQ: `supervisor/ipc.py`'s EngineChannels, the daemon's own
   code, bound in a scratch directory, with an engine child started as engined starts one; see
   the method notes for why it cannot be the daemon's child itself), streamed and not; the
   control socket's `POST /v1/generate`, streamed (NDJSON) and not; the gateway's
   `/v1/completions`, streamed (SSE) and not, over plain aiohttp and through the official
   `openai` client. Requests/s, latency p50/p95, overhead vs direct.
2. Time to first token of the streamed paths against direct streaming, p50/p95.
3. Requests lost per engine kill: two echo replicas (20 ms per token), 32 concurrent requests,
   one replica SIGKILLed while they run; through the gateway (it moves them) and through the
   control socket (no failover).
4. The daemon's event-loop lag (`engined_event_loop_lag_seconds`, GET /metrics) idle and with
   16 and 64 concurrent SSE streams through the gateway.

Prints markdown tables and writes them to --out. Every process is tracked and stopped by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psutil
from driver import free_port, is_engine_of

from bench.common import (
    BenchDaemon,
    BenchError,
    Cleanup,
    Tracker,
    cpu_s,
    terminate,
)
from bench.metrics import TICK_S, Lag, Snapshots, bucket, est, read_lag
from bench.metrics import lag_ms as ms
from bench.models import build_checkpoint
from bench.report import (
    Report,
    cpu_busy_pct,
    default_out,
    engined_revision,
    machine_lines,
    table,
)

MAX_TOKENS = 64
CONCURRENCY = (1, 8)
OVERHEAD_TARGET_PCT = 5.0  # the target: gateway vs direct at 8, tiny-llama
WARMUP_ROUNDS = 2
# Equal lengths (the transformers backend pads a batch to its longest prompt); 66 characters:
# the echo engine's answer is the first 64 (finish "length"), like tiny-llama's 64 tokens.
PROMPTS = [f"gateway benchmark prompt {i:02d}: the quick brown fox jumps over a dog" for i in
           range(max(CONCURRENCY))]
MODELS = {  # group -> (model, label)
    "tiny": ("builtin:tiny-llama", "tiny-llama (transformers, 1 thread)"),
    "echo": ("builtin:echo", "echo (no compute: pure overhead)"),
}

# Scenario 3 and 4: two echo replicas that take their time (20 ms per token).
ECHO_TOKEN_MS = 20
KILL_CLIENTS = 32
KILL_PROMPT_CHARS = 200  # 4 s per request at 20 ms a token: still running when the kill lands
STREAMS = (16, 64)
STREAM_PROMPT_CHARS = 100  # 2 s per stream; each client opens the next one at once
RAMP_S = 1.0  # streams open before the "before" reading of a phase
SETTLE_S = 2.0

_MIGRATIONS_RE = re.compile(rb'^engined_gateway_migrations_total\{model="echo"\} (\S+)$', re.M)


# --- samples -----------------------------------------------------------------------------------
@dataclass
class Sample:
    latency_s: float
    tokens: int
    text: str
    ttft_s: float | None = None  # streamed paths: send -> first token event


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
    Route("control", "control socket `POST /v1/generate`", False),
    Route("control-stream", "control socket `POST /v1/generate`, streamed (NDJSON)", True),
    Route("gateway", "gateway `/v1/completions` (aiohttp)", False),
    Route("gateway-stream", "gateway `/v1/completions`, streamed SSE (aiohttp)", True),
    Route("openai", "gateway via the `openai` client", False),
    Route("openai-stream", "gateway via the `openai` client, streamed", True),
]
PATH = {p.key: p for p in PATHS}


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile, linear interpolation between closest ranks (None for no values)."""
    vals = sorted(values)
    if not vals:
        return None
    k = (len(vals) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def fmt_ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.2f} ms"


def fmt_pct(value: float | None) -> str:
    return "–" if value is None else f"{value:+.1f} %"


# --- direct: the daemon's own engine channels, in this process ---------------------------------
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
        from engined.supervisor.ipc import EngineChannels
        from engined.supervisor.launcher import child_environment, expose_engine_package

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
        return self.channels.open(engine, 1, request)

    async def stop(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(terminate, p, 10)
                               for p in self.procs.values()))
        if self.channels is not None:
            await self.channels.close()
            self.channels = None


# --- one request on each path ------------------------------------------------------------------
class Clients:
    """One keep-alive client per path: aiohttp on the control socket and on the gateway, the
    openai client on the gateway, the direct channels."""

    def __init__(self, direct: Direct, socket_path: str, gateway_port: int) -> None:
        import aiohttp
        import openai

        timeout = aiohttp.ClientTimeout(total=300)
        self.direct = direct
        self.control = aiohttp.ClientSession(connector=aiohttp.UnixConnector(
            path=socket_path, limit=0, keepalive_timeout=5), timeout=timeout)
        self.gateway = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
            limit=0, keepalive_timeout=5), timeout=timeout)
        self.base = f"http://127.0.0.1:{gateway_port}/v1"
        self.openai = openai.AsyncOpenAI(base_url=self.base, api_key="none", max_retries=0,
                                         timeout=300)

    async def close(self) -> None:
        await self.control.close()
        await self.gateway.close()
        await self.openai.close()

    async def one(self, path: str, group: str, prompt: str) -> Sample:
        return await getattr(self, "_" + path.replace("-", "_"))(group, prompt)

    async def _direct(self, group: str, prompt: str, stream: bool = False) -> Sample:
        from engined.engine import protocol as proto
        started = time.perf_counter()
        ttft, parts = None, []
        s = self.direct.open(group, prompt, stream)
        try:
            async for item in s:
                if isinstance(item, proto.TokenChunk):
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    parts.append(item.text)
                    continue
                if item.error is not None:
                    raise BenchError(f"direct {group}: {item.error}")
                parts.append(item.text)
                return Sample(time.perf_counter() - started, item.completion_tokens,
                              "".join(parts), ttft)
        finally:
            s.close()
        raise BenchError(f"direct {group}: the stream ended without a result")

    async def _direct_stream(self, group: str, prompt: str) -> Sample:
        return await self._direct(group, prompt, stream=True)

    def _control_body(self, group: str, prompt: str, stream: bool) -> dict[str, Any]:
        return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "engine": f"{group}-0", "stream": stream}

    async def _control(self, group: str, prompt: str) -> Sample:
        started = time.perf_counter()
        async with self.control.post("http://engined/v1/generate",
                                     json=self._control_body(group, prompt, False)) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise BenchError(f"POST /v1/generate: HTTP {resp.status}: {data}")
        return Sample(time.perf_counter() - started, data["completion_tokens"], data["text"])

    async def _control_stream(self, group: str, prompt: str) -> Sample:
        started = time.perf_counter()
        ttft, parts = None, []
        async with self.control.post("http://engined/v1/generate",
                                     json=self._control_body(group, prompt, True)) as resp:
            if resp.status != 200:
                raise BenchError(f"POST /v1/generate: HTTP {resp.status}: {await resp.text()}")
            async for line in resp.content:
                data = json.loads(line)
                if "error" in data:
                    raise BenchError(f"POST /v1/generate (stream): {data['error']}")
                parts.append(data["text"])
                if data.get("done"):
                    return Sample(time.perf_counter() - started, data["completion_tokens"],
                                  "".join(parts), ttft)
                if ttft is None:
                    ttft = time.perf_counter() - started
        raise BenchError("POST /v1/generate (stream): no last line")

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
        ttft, parts, tokens = None, [], -1
        async with self.gateway.post(f"{self.base}/completions",
                                     json=self._gateway_body(group, prompt, True)) as resp:
            if resp.status != 200:
                raise BenchError(f"gateway (stream): HTTP {resp.status}: {await resp.text()}")
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    return Sample(time.perf_counter() - started, tokens, "".join(parts), ttft)
                data = json.loads(payload)
                if "error" in data:
                    raise BenchError(f"gateway (stream): {data['error']}")
                if data.get("choices"):
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    parts.append(data["choices"][0]["text"])
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
        raise BenchError("gateway (stream): no [DONE]")

    async def _openai(self, group: str, prompt: str) -> Sample:
        started = time.perf_counter()
        done = await self.openai.completions.create(model=group, prompt=prompt,
                                                    max_tokens=MAX_TOKENS, temperature=0)
        assert done.usage is not None
        return Sample(time.perf_counter() - started, done.usage.completion_tokens,
                      done.choices[0].text)

    async def _openai_stream(self, group: str, prompt: str) -> Sample:
        started = time.perf_counter()
        ttft, parts, tokens = None, [], -1
        stream = await self.openai.completions.create(
            model=group, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices:
                if ttft is None:
                    ttft = time.perf_counter() - started
                parts.append(chunk.choices[0].text)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return Sample(time.perf_counter() - started, tokens, "".join(parts), ttft)


async def one_round(clients: Clients, path: str, group: str, concurrency: int,
                    pids: tuple[int, int, int] | None = None) -> Round:
    """`concurrency` requests sent at once on one path; wall time from the first send to the
    last answer; with `pids` (engine, daemon, this process), what each spent on a CPU (read
    outside the timed span)."""
    cpu0 = [on_cpu_s(pid) for pid in pids] if pids else []
    started = time.perf_counter()
    samples = await asyncio.wait_for(asyncio.gather(
        *(clients.one(path, group, PROMPTS[i]) for i in range(concurrency))), 300)
    elapsed = time.perf_counter() - started
    done = Round(elapsed, list(samples))
    if pids:
        a, b, c = (on_cpu_s(pid) - t for pid, t in zip(pids, cpu0))
        done.cpu_s = (a, b, c)
    return done


async def overhead_rounds(clients: Clients, group: str, rounds: int, rng: random.Random,
                          pids: dict[str, tuple[int, int, int]]
                          ) -> dict[tuple[int, str], list[Round]]:
    """Rounds of every (concurrency, path), the paths in a fresh random order each time: a load
    change on the machine, or what the path before left behind (the other engine process's
    caches: the direct paths run on the bench's engine, the others on the daemon's), hit all of
    them alike."""
    out: dict[tuple[int, str], list[Round]] = {(c, p.key): [] for c in CONCURRENCY for p in PATHS}
    keys = [p.key for p in PATHS]
    for i in range(WARMUP_ROUNDS + rounds):
        for concurrency in CONCURRENCY:
            rng.shuffle(keys)
            for path in list(keys):
                result = await one_round(clients, path, group, concurrency,
                                         pids["direct" if path.startswith("direct") else "daemon"])
                if i >= WARMUP_ROUNDS:
                    out[(concurrency, path)].append(result)
    return out


# --- the daemons -------------------------------------------------------------------------------
class GatewayDaemon(BenchDaemon):
    """engined (bench.common.BenchDaemon: immediate restarts, 1 s heartbeats) with the gateway on
    a free loopback port (and, for the loop lag, `http:` on another)."""

    log_lines = 30

    def __init__(self, prefix: str, tracker: Tracker, engines: list[dict[str, Any]],
                 http: bool = False) -> None:
        self.gateway_port = free_port()
        self.http_port = free_port() if http else None
        super().__init__(prefix, tracker, engines,
                         f"127.0.0.1:{self.http_port}" if http else "off", status_timeout_s=10.0,
                         supervisor={"gateway": f"127.0.0.1:{self.gateway_port}"})
        self.log_engines = tuple(f"{e['name']}-0" for e in engines)


# --- scenario 1 and 2 --------------------------------------------------------------------------
async def overhead_scenario(cleanup: Cleanup, tracker: Tracker, cache: Path,
                            rounds: dict[str, int], seed: int) -> dict[str, Any]:
    daemon = GatewayDaemon("eg", tracker, [
        {"name": group, "replicas": 1, "model": model, "max_batch_size": 8, "threads": 1,
         "env": {"ENGINED_CACHE_DIR": str(cache)}} for group, (model, _) in MODELS.items()])
    direct = Direct(cleanup, tracker, cache)
    cleanup.closers.append(lambda: [terminate(p, 5) for p in direct.procs.values()])
    try:
        await asyncio.gather(asyncio.to_thread(cleanup.start, daemon, 300),
                             direct.start({g: m for g, (m, _) in MODELS.items()}))
        clients = Clients(direct, daemon.socket, daemon.gateway_port)
        try:
            rng = random.Random(seed)
            engines = {e["name"]: e["pid"] for e in daemon.status()["engines"]}
            results = {}
            for group in MODELS:
                pids = {"direct": (direct.procs[group].pid, daemon.pid, os.getpid()),
                        "daemon": (engines[f"{group}-0"], daemon.pid, os.getpid())}
                results[group] = await overhead_rounds(clients, group, rounds[group], rng, pids)
        finally:
            await clients.close()
        engines = {e["name"]: e for e in daemon.status()["engines"]}
        restarts = sum(e["restarts"] for e in engines.values())
    finally:
        await direct.stop()
    await asyncio.to_thread(cleanup.stop, daemon, 60)
    daemon.remove_dir()
    return {"results": results, "restarts": restarts, "stop_note": daemon.stop_note}


# --- scenario 3: requests lost per engine kill -------------------------------------------------
async def kill_request(session: Any, via: str, base: str, prompt: str, stream: bool
                       ) -> str | None:
    """One request of a kill trial; None if it came back whole and right (echo: the prompt),
    else what went wrong."""
    try:
        if via == "gateway":
            body: dict[str, Any] = {"model": "echo", "prompt": prompt, "max_tokens": 1000,
                                    "stream": stream}
            async with session.post(f"{base}/completions", json=body) as resp:
                if resp.status != 200:
                    return f"HTTP {resp.status}: {(await resp.text())[:120]}"
                if not stream:
                    text = (await resp.json())["choices"][0]["text"]
                else:
                    parts = []
                    async for line in resp.content:
                        if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
                            data = json.loads(line[6:])
                            if "error" in data:
                                return f"SSE error: {data['error']['message'][:120]}"
                            parts.extend(c["text"] for c in data.get("choices", []))
                    text = "".join(parts)
        else:
            body = {"prompt": prompt, "max_tokens": 1000, "engine": "echo", "stream": stream}
            async with session.post("http://engined/v1/generate", json=body) as resp:
                if resp.status != 200:
                    return f"HTTP {resp.status}: {(await resp.text())[:120]}"
                if not stream:
                    text = (await resp.json())["text"]
                else:
                    parts = []
                    async for line in resp.content:
                        data = json.loads(line)
                        if "error" in data:
                            return f"NDJSON error: {data['error'][:120]}"
                        parts.append(data["text"])
                    text = "".join(parts)
    except Exception as exc:  # noqa: BLE001 - a lost request, whatever the way it was lost
        return f"{type(exc).__name__}: {exc}"[:160]
    return None if text == prompt else f"wrong text ({len(text)} of {len(prompt)} characters)"


def queue_of(engines: list[dict[str, Any]]) -> dict[str, int]:
    return {e["name"]: (e["queue"] or {}).get("running", 0) + (e["queue"] or {}).get("waiting", 0)
            for e in engines}


def routable_and_idle(daemon: GatewayDaemon) -> bool:
    """Both replicas READY, heard from since (the gateway routes only to a fresh heartbeat), and
    their last heartbeat shows no request: the next trial's counts start from zero."""
    engines = daemon.status()["engines"]
    return all(e["state"] == "READY" and e["heartbeat_age_s"] is not None
               and e["heartbeat_age_s"] < 1.5 for e in engines) and not any(
        queue_of(engines).values())


def migrations(snap: Snapshots) -> float:
    _took, _recv, body = snap.get()
    m = _MIGRATIONS_RE.search(body)
    return float(m.group(1)) if m else 0.0


def wait_blocking(predicate: Callable[[], Any], timeout_s: float, what: str,
                  interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(interval_s)
    return value


async def kill_trial(daemon: GatewayDaemon, session: Any, via: str, victim: str, trial: int,
                     snap: Snapshots) -> dict[str, Any]:
    """KILL_CLIENTS requests at once (half streamed), the victim SIGKILLed once every request is
    on an engine (their last heartbeats count all of them), then every answer checked."""
    await asyncio.to_thread(wait_blocking, lambda: routable_and_idle(daemon), 30,
                            "both replicas routable and idle")
    moved0 = await asyncio.to_thread(migrations, snap)
    base = f"http://127.0.0.1:{daemon.gateway_port}/v1"
    prompts = [(f"{via[0]}{trial}-{i:02d} " + "abcdefghij" * 30)[:KILL_PROMPT_CHARS]
               for i in range(KILL_CLIENTS)]
    tasks = [asyncio.create_task(kill_request(session, via, base, p, i % 2 == 0))
             for i, p in enumerate(prompts)]

    def all_placed() -> list[dict[str, Any]] | None:
        engines = daemon.status()["engines"]
        return engines if sum(queue_of(engines).values()) >= KILL_CLIENTS else None
    try:
        engines = await asyncio.to_thread(wait_blocking, all_placed, 3.5,
                                          f"{KILL_CLIENTS} requests on the engines")
    except BenchError:
        engines = daemon.status()["engines"]  # kill anyway; the count says what was seen
    e = next(e for e in engines if e["name"] == victim)
    in_flight = queue_of(engines)[victim]
    proc = psutil.Process(e["pid"])
    if not is_engine_of(proc.pid, daemon.pid):
        raise BenchError(f"{victim} pid {proc.pid} is not an engine of this daemon")
    proc.send_signal(signal.SIGKILL)
    errors = [err for err in await asyncio.gather(*tasks) if err is not None]
    await asyncio.to_thread(daemon.wait_ready, e["incarnation"] + 1, 60, 0.02, victim)
    moved = await asyncio.to_thread(migrations, snap) - moved0
    return {"via": via, "victim": victim, "in_flight": in_flight, "lost": len(errors),
            "moved": moved, "errors": errors[:3]}


# --- scenario 4: loop lag under streaming load -------------------------------------------------
@dataclass
class LagPhase:
    name: str
    streams: int
    delta: Lag | None = None
    wall_s: float = 0.0
    daemon_cpu_pct: float = 0.0
    bench_cpu_pct: float = 0.0
    machine_busy_pct: float = 0.0
    completed: int = 0
    events: int = 0
    errors: list[str] = field(default_factory=list)


async def stream_client(session: Any, base: str, k: int, stop: asyncio.Event,
                        phase: LagPhase, counting: list[bool]) -> None:
    """Streamed completions one after another until `stop`; events counted while `counting`."""
    i = 0
    while not stop.is_set():
        prompt = (f"s{k:02d}-{i:03d} " + "abcdefghij" * 10)[:STREAM_PROMPT_CHARS]
        i += 1
        body = {"model": "echo", "prompt": prompt, "max_tokens": 1000, "stream": True}
        try:
            async with session.post(f"{base}/completions", json=body) as resp:
                if resp.status != 200:
                    phase.errors.append(f"HTTP {resp.status}")
                    await asyncio.sleep(0.1)
                    continue
                async for line in resp.content:
                    if line.startswith(b"data: ") and counting[0]:
                        phase.events += 1
            if counting[0]:
                phase.completed += 1
        except Exception as exc:  # noqa: BLE001 - counted and reported
            phase.errors.append(f"{type(exc).__name__}: {exc}"[:120])
            await asyncio.sleep(0.1)


async def lag_phase(daemon: GatewayDaemon, session: Any, snap: Snapshots, streams: int,
                    duration_s: float) -> LagPhase:
    phase = LagPhase("idle" if not streams else f"{streams} SSE streams", streams)
    stop, counting = asyncio.Event(), [False]
    base = f"http://127.0.0.1:{daemon.gateway_port}/v1"
    clients = [asyncio.create_task(stream_client(session, base, k, stop, phase, counting))
               for k in range(streams)]
    try:
        if streams:
            await asyncio.sleep(RAMP_S)
        daemon_proc, me = psutil.Process(daemon.pid), psutil.Process()
        lag0 = await asyncio.to_thread(read_lag, snap)
        cpu0, me0, machine0, t0 = cpu_s(daemon_proc), cpu_s(me), psutil.cpu_times(), \
            time.monotonic()
        counting[0] = True
        await asyncio.sleep(duration_s)
        counting[0] = False
        t1 = time.monotonic()
        cpu1, me1 = cpu_s(daemon_proc), cpu_s(me)
        phase.machine_busy_pct = cpu_busy_pct(machine0)
        lag1 = await asyncio.to_thread(read_lag, snap)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*clients), 60)
    phase.wall_s = t1 - t0
    phase.delta = lag1 - lag0
    phase.daemon_cpu_pct = 100 * (cpu1 - cpu0) / phase.wall_s
    phase.bench_cpu_pct = 100 * (me1 - me0) / phase.wall_s
    return phase


async def failover_and_lag(cleanup: Cleanup, tracker: Tracker, kills: int,
                           phase_s: float) -> dict[str, Any]:
    import aiohttp

    daemon = GatewayDaemon("eh", tracker, [{
        "name": "echo", "replicas": 2, "model": "builtin:echo", "max_batch_size": 64,
        "env": {"ENGINED_ECHO_TOKEN_MS": str(ECHO_TOKEN_MS)}}], http=True)
    await asyncio.to_thread(cleanup.start, daemon, 120)
    assert daemon.http_port is not None
    snap = Snapshots(daemon.http_port)
    cleanup.closers.append(snap.close)
    timeout = aiohttp.ClientTimeout(total=120)
    gateway = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=5),
                                    timeout=timeout)
    control = aiohttp.ClientSession(connector=aiohttp.UnixConnector(
        path=daemon.socket, limit=0, keepalive_timeout=5), timeout=timeout)
    try:
        await asyncio.to_thread(read_lag, snap)  # connect; fail early if the metrics are absent
        await asyncio.sleep(SETTLE_S)
        phases = [await lag_phase(daemon, gateway, snap, 0, phase_s)]
        for streams in STREAMS:
            await asyncio.sleep(SETTLE_S)
            phases.append(await lag_phase(daemon, gateway, snap, streams, phase_s))
        trials = []
        for k in range(kills):
            victim = f"echo-{k % 2}"
            row = {"kill": k + 1, "victim": victim}
            for via, session in (("gateway", gateway), ("control", control)):
                row[via] = await kill_trial(daemon, session, via, victim, k, snap)
            trials.append(row)
        restarts = sum(e["restarts"] for e in daemon.status()["engines"])
    finally:
        await gateway.close()
        await control.close()
        snap.close()
    await asyncio.to_thread(cleanup.stop, daemon, 60)
    daemon.remove_dir()
    return {"phases": phases, "trials": trials, "restarts": restarts,
            "stop_note": daemon.stop_note}


# --- report ------------------------------------------------------------------------------------
def summarize(rounds: list[Round]) -> dict[str, Any]:
    latencies = [s.latency_s for r in rounds for s in r.samples]
    ttfts = [s.ttft_s for r in rounds for s in r.samples if s.ttft_s is not None]
    elapsed = statistics.median(r.elapsed_s for r in rounds)
    fastest = sorted(r.elapsed_s for r in rounds)[:max(1, len(rounds) // 4)]
    return {"elapsed": elapsed, "fastest": statistics.fmean(fastest),
            "rps": len(rounds[0].samples) / elapsed,
            "p50": pct(latencies, 50), "p95": pct(latencies, 95),
            "ttft50": pct(ttfts, 50), "ttft95": pct(ttfts, 95), "n": len(latencies),
            "iqr": (pct(latencies, 75) or 0) - (pct(latencies, 25) or 0),
            "cpu": [statistics.median(r.cpu_s[k] for r in rounds) / len(rounds[0].samples)
                    for k in range(3)],
            "tokens": statistics.median(s.tokens for r in rounds for s in r.samples)}


def report_overhead(r: Report, group: str, res: dict[tuple[int, str], list[Round]],
                    rounds: int) -> dict[tuple[int, str], dict[str, Any]]:
    stats = {key: summarize(v) for key, v in res.items()}
    r(f"### {MODELS[group][1]}: max_tokens {MAX_TOKENS}, greedy, {rounds} rounds", "",
      *table("concurrency", "path", "requests/s", "latency p50", "latency p95",
             "overhead vs direct (round time)", "same, fastest quarter of rounds",
             "overhead vs direct (latency p50)", "on-CPU per request: engine / daemon / bench",
             "tokens/request", "requests"))
    for c in CONCURRENCY:
        for p in PATHS:
            s, base = stats[(c, p.key)], stats[(c, p.baseline)]
            is_base = p.key == p.baseline
            over = None if is_base else 100 * (s["elapsed"] / base["elapsed"] - 1)
            best = None if is_base else 100 * (s["fastest"] / base["fastest"] - 1)
            over50 = None if is_base else 100 * (s["p50"] / base["p50"] - 1)
            r(f"| {c} | {p.label}{' (baseline)' if is_base else ''} | {s['rps']:.1f} | "
              f"{fmt_ms(s['p50'])} | {fmt_ms(s['p95'])} | {fmt_pct(over)} | {fmt_pct(best)} | "
              f"{fmt_pct(over50)} | " + " / ".join(f"{x * 1e3:.1f}" for x in s["cpu"])
              + f" ms | {s['tokens']:.0f} | {s['n']} |")
    r("")
    return stats


def report_ttft(r: Report, stats: dict[str, dict[tuple[int, str], dict[str, Any]]]) -> None:
    r("## 2. Time to first token (streamed paths)", "",
      *table("model", "concurrency", "path", "TTFT p50", "TTFT p95", "vs direct (p50)",
             "requests"))
    for group in MODELS:
        for c in CONCURRENCY:
            base = stats[group][(c, "direct-stream")]
            for p in PATHS:
                if not p.streamed:
                    continue
                s = stats[group][(c, p.key)]
                is_base = p.key == "direct-stream"
                r(f"| {group} | {c} | {p.label}{' (baseline)' if is_base else ''} | "
                  f"{fmt_ms(s['ttft50'])} | {fmt_ms(s['ttft95'])} | "
                  f"{'–' if is_base else fmt_ms(s['ttft50'] - base['ttft50']) + ' later'} | "
                  f"{s['n']} |")
    r("", "TTFT: from the send to the first token event (direct: the first `TokenChunk`; "
      "control socket: the first NDJSON line; gateway: the first SSE chunk with a choice, which "
      "it sends for the engine's first token). builtin:echo without a token delay emits its "
      "whole answer in one step, so its first token is also nearly its last.", "")


def report_kills(r: Report, trials: list[dict[str, Any]]) -> tuple[int, int, int]:
    r(f"## 3. Requests lost per engine kill ({KILL_CLIENTS} concurrent requests, 2 echo "
      f"replicas, {ECHO_TOKEN_MS} ms per token)", "",
      *table("kill", "victim", "in flight on it (gateway run)", "lost with gateway",
             "moved by the gateway", "in flight on it (control-socket run)",
             "lost without (control socket)"))
    tot = {"gin": 0, "glost": 0, "moved": 0.0, "cin": 0, "clost": 0}
    for t in trials:
        g, c = t["gateway"], t["control"]
        r(f"| {t['kill']} | {t['victim']} | {g['in_flight']} | {g['lost']} | {g['moved']:.0f} | "
          f"{c['in_flight']} | {c['lost']} |")
        tot["gin"] += g["in_flight"]
        tot["glost"] += g["lost"]
        tot["moved"] += g["moved"]
        tot["cin"] += c["in_flight"]
        tot["clost"] += c["lost"]
    r(f"| all {len(trials)} | – | {tot['gin']} | {tot['glost']} | {tot['moved']:.0f} | "
      f"{tot['cin']} | {tot['clost']} |", "")
    examples = [e for t in trials for via in ("gateway", "control") for e in t[via]["errors"]]
    if examples:
        r("How the lost requests failed (first few): "
          + "; ".join(f"`{e}`" for e in examples[:4]) + ".", "")
    r(f"Each trial sends {KILL_CLIENTS} requests at once ({KILL_PROMPT_CHARS}-character "
      f"prompts, {KILL_PROMPT_CHARS * ECHO_TOKEN_MS / 1000:g} s each; every other one streamed), "
      "waits until the engines' heartbeats count all of them (the \"in flight\" columns: the "
      "victim's `queue` running + waiting in `GET /v1/status`), SIGKILLs the victim by pid and "
      "checks every answer against the echo oracle (the text must be the whole prompt, "
      "streamed or not; an HTTP error, an error event, a cut stream or wrong text is lost). "
      "Through the gateway (`/v1/completions`) and through the control socket "
      "(`POST /v1/generate` with `engine: echo`, the group: it picks the least-loaded replica, "
      "but a request stays where it was sent) in turn, on the same victim, which is READY again "
      "(immediate restart) and heard from before the next trial. \"Moved\": the delta of "
      "`engined_gateway_migrations_total`.", "")
    return tot["glost"], tot["clost"], tot["cin"]


def report_lag(r: Report, phases: list[LagPhase], phase_s: float) -> None:
    r(f"## 4. Daemon event-loop lag under streaming load ({phase_s:g} s per phase)", "",
      *table("phase", "ticks (expected)", "mean", "p50", "p99", "max bucket", "stalled s",
             "SSE events/s", "streams done", "errors", "daemon CPU", "bench CPU (clients)",
             "machine busy"))
    for p in phases:
        d = p.delta
        assert d is not None
        n = d.count
        r(f"| {p.name} | {n:.0f} ({p.wall_s / TICK_S:.0f}) | {ms(d.total / n if n else None)} | "
          f"{est(d, 0.5)} | {est(d, 0.99)} | {bucket(d.max_bucket())} | {d.stalled:.3f} | "
          f"{p.events / p.wall_s:.0f} | {p.completed} | {len(p.errors)} | "
          f"{p.daemon_cpu_pct:.0f} % | {p.bench_cpu_pct:.0f} % | {p.machine_busy_pct:.0f} % |")
    errors = [e for p in phases for e in p.errors]
    r("", f"Two echo replicas ({ECHO_TOKEN_MS} ms per token, `max_batch_size` 64), "
      f"`http: 127.0.0.1:<free port>`. K clients each stream completions of "
      f"{STREAM_PROMPT_CHARS}-character prompts back to back (one SSE event per token, "
      f"{STREAM_PROMPT_CHARS * ECHO_TOKEN_MS / 1000:g} s a stream) through the gateway; after "
      f"{RAMP_S:g} s of ramp-up the phase is bracketed by two `GET /metrics` (the same readings as "
      "bench.loop: `engined_event_loop_lag_seconds`, the loop monitor's ticker every "
      f"{TICK_S:g} s, and `engined_event_loop_stalled_seconds_total`, wake-ups ≥ 1 s late). "
      "p50/p99 are `histogram_quantile()`-style estimates (†: inside the first bucket, < 1 ms). "
      "Daemon CPU: its user+sys delta, % of one core; bench CPU: this process, i.e. the "
      "clients parsing the streams; machine busy: all CPUs, everything on the machine."
      + (f" Errors: {'; '.join(errors[:3])}." if errors else ""), "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="5/30 overhead rounds (tiny-llama/echo), 2 kills, 8 s lag phases")
    parser.add_argument("--out", default=None, help="default bench/results/gateway.md "
                        "(--quick: bench/results/gateway-quick.md)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="overhead rounds of tiny-llama (default 40; echo: 5x as many)")
    parser.add_argument("--kills", type=int, default=None, help="engine kills (default 5)")
    parser.add_argument("--phase", type=float, default=None,
                        help="seconds per loop-lag phase (default 30)")
    parser.add_argument("--cache-dir", default=None,
                        help="ENGINED_CACHE_DIR for the model (default: a fresh temporary one)")
    parser.add_argument("--seed", type=int, default=8, help="the paths' order in the rounds")
    args = parser.parse_args(argv)
    tiny_rounds = args.rounds or (5 if args.quick else 40)
    rounds = {"tiny": tiny_rounds, "echo": (30 if args.quick else 5 * tiny_rounds)}
    kills = args.kills or (2 if args.quick else 5)
    phase_s = args.phase or (8.0 if args.quick else 30.0)
    out = Path(args.out) if args.out else default_out("gateway", args.quick)

    def on_sigterm(signum: int, frame: object) -> None:  # `timeout` sends SIGTERM: clean up
        raise SystemExit(f"bench.gateway: signal {signum}, cleaning up")
    signal.signal(signal.SIGTERM, on_sigterm)

    r, tracker = Report(), Tracker()
    cleanup = Cleanup(tracker)
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="engined-bench-cache-"))
    if args.cache_dir is None:
        cleanup.dirs.append(cache)
    t_run = time.monotonic()
    load_start, cpu_start = os.getloadavg(), psutil.cpu_times()
    r(f"# engined gateway benchmark{' (--quick)' if args.quick else ''}", "", *machine_lines(),
      engined_revision(),
      f"- overhead rounds: tiny-llama {rounds['tiny']}, echo {rounds['echo']} (+{WARMUP_ROUNDS} "
      f"warm-up each); engine kills: {kills}; loop-lag phases: {phase_s:g} s", "")
    try:
        checkpoint = build_checkpoint(cache)
        r(f"- torch {version('torch')}, transformers {version('transformers')}, aiohttp "
          f"{version('aiohttp')}, openai {version('openai')}; model: builtin:tiny-llama "
          f"({checkpoint.name}), float32, CPU", "")
        over = asyncio.run(overhead_scenario(cleanup, tracker, cache, rounds, args.seed))
        fail = asyncio.run(failover_and_lag(cleanup, tracker, kills, phase_s))
    finally:
        leftovers = cleanup.close()

    r(f"- machine load during the run: load average {load_start[0]:.2f} at start, "
      f"{os.getloadavg()[0]:.2f} at end; all CPUs {cpu_busy_pct(cpu_start):.0f} % busy on "
      f"average (everything on the machine, this benchmark included); run time "
      f"{time.monotonic() - t_run:.0f} s.", "")
    r("## 1. Overhead vs talking to the engine directly (1 and 8 concurrent requests)", "")
    stats = {group: report_overhead(r, group, over["results"][group], rounds[group])
             for group in MODELS}
    report_ttft(r, stats)
    lost_gw, lost_ctl, in_flight_ctl = report_kills(r, fail["trials"])
    report_lag(r, fail["phases"], phase_s)
    report_summary(r, stats, lost_gw, lost_ctl, in_flight_ctl, len(fail["trials"]))
    report_method(r, over, fail, leftovers)
    r.write(out)
    return 0  # a report, not a gate: the verdicts are in the tables


def report_summary(r: Report, stats: dict[str, dict[tuple[int, str], dict[str, Any]]],
                   lost_gw: int, lost_ctl: int, in_flight_ctl: int, kills: int) -> None:
    r("## Summary of the targets", "", *table("target", "value", "result"))
    tiny = stats["tiny"]
    for key in ("gateway-stream", "gateway"):
        p = PATH[key]
        over = 100 * (tiny[(8, key)]["elapsed"] / tiny[(8, p.baseline)]["elapsed"] - 1)
        best = 100 * (tiny[(8, key)]["fastest"] / tiny[(8, p.baseline)]["fastest"] - 1)
        verdict = "PASS" if over < OVERHEAD_TARGET_PCT else \
            f"MISS (by {over - OVERHEAD_TARGET_PCT:.1f} points)"
        r(f"| tiny-llama, 8 concurrent: {p.label} vs {PATH[p.baseline].label}, median round "
          f"time, < {OVERHEAD_TARGET_PCT:g} % | {over:+.1f} % (fastest quarter of rounds: "
          f"{best:+.1f} %) | {verdict} |")
    # What streaming costs by itself: the engine's chunks (one Results frame per step)
    engine = 100 * (tiny[(8, "direct-stream")]["elapsed"] / tiny[(8, "direct")]["elapsed"] - 1)
    r(f"| (reference) tiny-llama, 8 concurrent: {PATH['direct-stream'].label} vs "
      f"{PATH['direct'].label} (what streaming costs the engine and the channel by itself) | "
      f"{engine:+.1f} % | report only |")
    r(f"| requests lost per engine kill through the gateway: 0 | {lost_gw} in {kills} kills | "
      f"{'PASS' if lost_gw == 0 else 'MISS'} |",
      f"| (reference) requests lost per kill through the control socket: all in flight on the "
      f"victim | {lost_ctl} lost of {in_flight_ctl} in flight, {kills} kills | report only |", "")
    r("The gateway sends the engine the request its client made: a streaming client's is "
      "streamed (the relay knows what was delivered, so a move resumes after it), a client "
      "that waits for the whole answer gets a non-streamed engine request (resent from "
      "scratch if its engine dies: that client had seen nothing). A streamed engine request "
      "sends a step's chunks in one `Results` frame. On this 2-CPU machine the rows move by "
      "several points from run to run: compare rows of one run, and the fastest-quarter "
      "column.", "")
    for group in MODELS:
        for c in CONCURRENCY:
            for key in ("openai", "openai-stream"):
                plain = stats[group][(c, key.replace("openai", "gateway"))]
                own = stats[group][(c, key)]
                diff = own["p50"] - plain["p50"]
                noise = max(own["iqr"], plain["iqr"]) / 2
                r(f"- openai client vs plain aiohttp, {group}, {c} concurrent"
                  f"{', streamed' if key.endswith('stream') else ''}: latency p50 "
                  f"{diff * 1e3:+.2f} ms ({100 * diff / plain['p50']:+.1f} %): "
                  + ("distinguishable" if abs(diff) > noise else "within the noise")
                  + f" (half the wider interquartile range: {noise * 1e3:.2f} ms)")
    r("")


def report_method(r: Report, over: dict[str, Any], fail: dict[str, Any],
                  leftovers: list[int]) -> None:
    notes = "; ".join(n for n in (over["stop_note"], fail["stop_note"]) if n)
    r("## Method", "",
      "- **Direct is not the daemon's own engine child.** An engine child connects one DEALER "
      "to the ROUTER the daemon binds at `<runtime_dir>/engines-requests.sock` "
      "(`engine/core.py`, `supervisor/ipc.py`); nothing else can talk to it (a second bind of "
      "that ipc:// path would steal the endpoint from the daemon). So the direct path runs the "
      "same engine, `python -m engined.engine` with the same EngineConfig (model, "
      "max_batch_size 8, threads 1, 1 s heartbeats) and the environment of engined's exec "
      "launcher (`launcher.child_environment`), against `supervisor/ipc.py`'s own "
      "`EngineChannels` bound in a scratch directory by this process: `GenerateRequest` frames "
      "sent with `EngineChannels.open`, exactly the call the gateway's relay and the control "
      "socket make. Direct thus costs the ZeroMQ hop and the daemon's IPC code, and nothing "
      "of the daemon's HTTP, routing, relay or bookkeeping.",
      "- Both engines of a model are alive side by side (the daemon's and the direct one); "
      "rounds run one at a time, so only one computes at a time. The daemon runs tiny-llama and "
      "echo as two groups (`tiny`, `echo`) of one replica each, `gateway: 127.0.0.1:<free "
      "port>`, `http: off`.",
      "- A round is C requests (C = concurrency, 1 or 8) sent at once on one path, timed from "
      "the first send to the last answer; rounds of every path and concurrency follow one "
      "another, the paths in a new random order (seeded, `--seed`) each time, so that no path "
      "always follows a path on the other engine process (whose run leaves the CPU caches "
      f"cold for this one); {WARMUP_ROUNDS} warm-up rounds dropped. Requests/s = C / median "
      "round time; overhead (round time) = median round time / direct's − 1, i.e. the "
      "requests/s lost; the fastest-quarter column does the same with the mean of each path's "
      "fastest 25 % of rounds (load from other processes only ever adds time, so it is the "
      "less noisy view on a shared machine); overhead (latency p50) likewise on the "
      "per-request latency. Streamed paths are compared with "
      "direct streamed (the engine sends a `TokenChunk` per token), the others with direct not "
      "streamed (one `GenerateResult`), as the gateway does: it streams the engine request "
      "only for a streaming client.",
      "- On-CPU per request: the time each process's threads spent on a CPU during the "
      "round (`/proc/PID/task/*/schedstat`, nanoseconds; read outside the timed span), "
      "divided by C, median over the rounds: the engine child that served the path (the "
      "bench's own for direct, else the daemon's), the daemon, and this process (the clients; "
      "for direct also the engine channels). The daemon's figure is what it spends per request "
      "(for direct rows: its idle background). An engine figure that grows on a path where the "
      "daemon works at the same time is contention for this 2-CPU machine: the same compute "
      "takes the engine longer.",
      "- tiny-llama's batching window is in its rows, direct included: the transformers "
      "backend runs one `generate` per batch, so an idle engine that gets a request waits "
      "while more keep coming (gaps under 1 ms, at most 5 ms, `engine/core.py` `_coalesce`): "
      "a lone request pays one empty 1 ms poll, a burst of 8 fills the batch and skips it. "
      "Echo batches continuously (a request joins the next step) and has no window.",
      "- Every request: the same prompts (equal lengths, so a batch pads nothing), max_tokens "
      f"{MAX_TOKENS}, temperature 0 (greedy; the gateway's default would be OpenAI's 1). "
      "tokens/request is the median completion length each path reported; equal across paths "
      "means every path ran the same work. All clients run on one asyncio loop in this process "
      "(aiohttp keep-alive sessions on the control socket and the gateway; `openai.AsyncOpenAI` "
      "with `max_retries=0`), which competes with the daemon and the engines for the 2 CPUs: "
      "the client's own parsing is part of every row, direct included.",
      "- On a shared machine load from other processes only ever adds time, and it lands on "
      "whichever path runs then: compare rows of one table, from one run.",
      f"- Cleanup: every process started here is tracked by pid and stopped by pid (SIGTERM, "
      f"wait, SIGKILL); leftovers killed after the clean shutdowns: {leftovers or 'none'}"
      + (f"; {notes}" if notes else "")
      + f". Unplanned engine restarts during the overhead rounds: {over['restarts']}; restarts "
      f"of the failover daemon (the bench's kills included): {fail['restarts']}.")


if __name__ == "__main__":
    sys.exit(main())
