"""The gateway under hostile and heavy clients (supervisor.webserver): connections held, requests
served, the daemon's memory and its event loop's lag.

    python -m bench.clients [--quick] [--out FILE]   # default bench/results/clients.md

One daemon, two `builtin:echo` replicas (one token per request every 200 ms,
ENGINED_ECHO_TOKEN_MS), the gateway and /metrics on free loopback ports, default
`supervisor.clients` except the cap (6,000 connections; --quick 1,200). Three phases:

1. **slow flood**: more connections than the cap each send a request's headers and one byte of
   its body, then nothing (slowloris), while a well-behaved client sends one request a second:
   its answers and their latency; how many slow connections were shed;
2. **streams**: S concurrent streamed completions (max_tokens 20, 4 s each), all open at once:
   how many completed, the daemon's RSS before, at its peak and after (bytes per stream);
3. **disconnects**: D streams whose clients hang up after their first token: every request
   aborted in its engine (the engines' running requests back to 0), the daemon's RSS after.

The loop's lag per phase comes from the daemon's own engined_event_loop_lag_seconds. A report;
nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import socket
import sys
import time
import urllib.request
from typing import Any

import aiohttp
import psutil

from bench.common import BenchDaemon, Cleanup, Tracker, wait_until
from bench.metrics import Snapshots, est, lag_ms, read_lag
from bench.report import (
    Report,
    add_out_option,
    engined_revision,
    load_average,
    machine_lines,
    num,
    out_path,
    table,
    title,
)
from testkit.driver import free_port

MiB = 1 << 20
SLOW_HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: 1000\r\n\r\n{")


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith(name + " ") or line.startswith(name + "{"))


def rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


async def good_client(port: int, until: float) -> list[float]:
    """One completion a second on a fresh connection; the latency of each answered one."""
    took = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        while time.monotonic() < until:
            started = time.monotonic()
            try:
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", json={
                        "model": "echo", "prompt": "hi", "max_tokens": 1},
                        timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    if resp.status == 200:
                        await resp.read()
                        took.append(time.monotonic() - started)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    return took


def slow_flood(port: int, count: int, seconds: float) -> tuple[int, list[float]]:
    """Open `count` slow connections (kept as long as the server keeps them) while a good client
    runs for `seconds`; how many connections were opened, and the good client's latencies."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.setblocking(False)
            try:
                s.send(SLOW_HEAD)
            except OSError:
                pass
            socks.append(s)
        return len(socks), asyncio.run(good_client(port, time.monotonic() + seconds))
    finally:
        for s in socks:
            s.close()


async def streams(port: int, count: int, hang_up_after_first: bool,
                  peak: list[int], pid: int, why: collections.Counter[str]) -> tuple[int, int]:
    """`count` concurrent streams; (completed, failed), and why each failure failed. With
    hang_up_after_first each client closes its connection after its first token."""
    done = failed = 0
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s:
        async def one(i: int) -> None:
            nonlocal done, failed
            try:
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", json={
                        "model": "echo", "prompt": f"{i:05d} " + "x" * 40, "max_tokens": 20,
                        "stream": True}, timeout=aiohttp.ClientTimeout(total=600)) as resp:
                    if resp.status != 200:
                        failed += 1
                        why[f"HTTP {resp.status}"] += 1
                        return
                    async for line in resp.content:
                        if hang_up_after_first and line.startswith(b"data: {"):
                            resp.close()
                            done += 1
                            return
                    done += 1
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                failed += 1
                why[type(exc).__name__] += 1

        async def watch() -> None:
            while True:
                peak[0] = max(peak[0], rss(pid))
                await asyncio.sleep(0.5)
        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(one(i) for i in range(count)))
        watcher.cancel()
    return done, failed


def running(d: BenchDaemon) -> int:
    return sum((e["queue"] or {}).get("running", 0) + (e["queue"] or {}).get("waiting", 0)
               for e in d.status()["engines"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.clients",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="cap 1,200: 1,500 slow, 1,000 "
                        "streams, 300 disconnects")
    add_out_option(parser, "clients")
    args = parser.parse_args(argv)
    # the cap holds every stream; the slow flood is larger than the cap
    cap, slow_n, stream_n, drop_n = ((1200, 1500, 1000, 300) if args.quick
                                     else (6000, 7000, 5000, 1000))
    flood_s = 10.0 if args.quick else 30.0
    r, tracker = Report(), Tracker()
    cleanup = Cleanup(tracker)
    rows: list[tuple[str, ...]] = []
    try:
        r(title("engined's gateway under hostile and heavy clients", args.quick), "",
          *machine_lines(), engined_revision(), load_average("start"))
        gateway, http = free_port(), free_port()
        engines = [{"name": "echo", "model": "builtin:echo", "replicas": 2,
                    "max_batch_size": 4096, "queue_limit": 100000,
                    "env": {"ENGINED_ECHO_TOKEN_MS": "200"}}]
        d = cleanup.start(BenchDaemon("ec", tracker, engines, http=f"127.0.0.1:{http}",
                                      supervisor={"gateway": f"127.0.0.1:{gateway}",
                                                  "clients": {"max_connections": cap}}),
                          120.0)
        pid = d.proc.pid if d.proc is not None else 0
        snap = Snapshots(http)
        cleanup.closers.append(snap.close)

        def phase(label: str, run: Any) -> None:
            before_lag, before_rss = read_lag(snap), rss(pid)
            started = time.monotonic()
            detail = run()
            lag = read_lag(snap) - before_lag
            rows.append((label, *detail, num(before_rss / MiB, 1, "MiB"),
                         num(rss(pid) / MiB, 1, "MiB"), est(lag, 0.99), lag_ms(
                             lag.max_bucket()[1] if lag.max_bucket() else None),
                         f"{time.monotonic() - started:.1f} s"))
            print(f"({label}: {rows[-1]})", file=sys.stderr)

        def flood() -> tuple[str, ...]:
            shed0 = metric(http, "engined_http_connections_shed_total")
            cut0 = metric(http, "engined_http_client_timeouts_total")
            opened, took = slow_flood(gateway, slow_n, flood_s)
            shed = metric(http, "engined_http_connections_shed_total") - shed0
            cut = metric(http, "engined_http_client_timeouts_total") - cut0
            took.sort()
            median = took[len(took) // 2] if took else None
            return (f"{opened} slow connections; good client: {len(took)} answered, median "
                    f"{lag_ms(median)}, max {lag_ms(took[-1] if took else None)}; "
                    f"{shed:.0f} slow connections shed for new ones, {cut:.0f} cut off by "
                    f"the body deadline (408)", )

        def many(count: int, hang_up: bool) -> tuple[str, ...]:
            peak = [rss(pid)]
            base = peak[0]
            why: collections.Counter[str] = collections.Counter()
            done, failed = asyncio.run(streams(gateway, count, hang_up, peak, pid, why))
            wait_until(lambda: running(d) == 0, 120, "every request gone from the engines")
            per = (peak[0] - base) / max(1, count)
            what = "hung up after their first token" if hang_up else "completed"
            reasons = f" ({', '.join(f'{k} ×{n}' for k, n in why.most_common())})" if why else ""
            return (f"{count} streams: {done} {what}, {failed} failed{reasons}; peak "
                    f"{num(peak[0] / MiB, 1, 'MiB')} ({num(per / 1024, 1, 'KiB')} a stream); "
                    f"engines' requests back to 0", )

        phase("slow flood", flood)
        phase("streams", lambda: many(stream_n, False))
        phase("disconnects", lambda: many(drop_n, True))
        e = d.status()["engines"]
        r("- engines: 2 × builtin:echo, one token per request every 200 ms, max_batch_size "
          f"4096; gateway cap {cap:,} connections, other `supervisor.clients` at their "
          "defaults; the good client's request is max_tokens 1 (one 200 ms token)",
          f"- restarts during the run: {sum(x['restarts'] for x in e)}", "",
          *table("phase", "what happened", "daemon RSS before", "after", "loop lag p99",
                 "worst lag bucket", "wall"))
        for row in rows:
            r("| " + " | ".join(row) + " |")
        r("")
    finally:
        leftovers = cleanup.close()
    return r.finish(leftovers, out_path(args, "clients"))


if __name__ == "__main__":
    sys.exit(main())
