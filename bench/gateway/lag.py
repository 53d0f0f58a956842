"""Scenario 4: the daemon's event-loop lag under streaming load. On scenario 3's daemon (`http:`
on a free loopback port): `engined_event_loop_lag_seconds` and
`engined_event_loop_stalled_seconds_total` from GET /metrics around each phase (as bench.loop
reads them), idle and with 16 and 64 clients streaming SSE completions back to back; daemon and
client CPU, SSE events/s.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from bench.common import cpu_s
from bench.gateway.failover import ECHO_TOKEN_MS
from bench.gateway.paths import GatewayDaemon
from bench.metrics import TICK_S, Lag, Snapshots, bucket, est, lag_ms, read_lag
from bench.report import Report, cpu_busy_pct, table

STREAMS = (16, 64)
STREAM_PROMPT_CHARS = 100  # 2 s per stream; each client opens the next one at once
RAMP_S = 1.0  # streams open before the "before" reading of a phase


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


# --- report ---------------------------------------------------------------------------------------
def report_lag(r: Report, phases: list[LagPhase], phase_s: float) -> None:
    r(f"## 4. Daemon event-loop lag under streaming load ({phase_s:g} s per phase)", "",
      *table("phase", "ticks (expected)", "mean", "p50", "p99", "max bucket", "stalled s",
             "SSE events/s", "streams done", "errors", "daemon CPU", "bench CPU (clients)",
             "machine busy"))
    for p in phases:
        d = p.delta
        assert d is not None
        n = d.count
        r(f"| {p.name} | {n:.0f} ({p.wall_s / TICK_S:.0f}) | "
          f"{lag_ms(d.total / n if n else None)} | {est(d, 0.5)} | {est(d, 0.99)} | "
          f"{bucket(d.max_bucket())} | {d.stalled:.3f} | "
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
