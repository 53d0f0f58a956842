"""Gateway benchmark: what the OpenAI-compatible gateway costs, and what it saves when engines die.

    python -m bench.gateway [--quick] [--rounds N] [--kills N] [--out FILE]

The run: the overhead rounds on a daemon with a tiny-llama and an echo group beside the same
engines driven directly (bench/gateway/overhead.py), then the engine kills on a daemon of two
slow echo replicas (failover.py); the tables, the summary of the targets and the method.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from importlib.metadata import version
from typing import Any

import psutil

from bench.common import Cleanup, Tracker, build_checkpoint
from bench.gateway.failover import ECHO_TOKEN_MS, kill_trial, report_kills
from bench.gateway.overhead import (
    OVERHEAD_TARGET_PCT,
    WARMUP_ROUNDS,
    overhead_scenario,
    report_overhead,
)
from bench.gateway.paths import MAX_TOKENS, MODELS, PATH, GatewayDaemon
from bench.report import Report, add_out_option, machine_load, out_path, table

PROG = "python -m bench.gateway"


async def failover(cleanup: Cleanup, tracker: Tracker, kills: int) -> dict[str, Any]:
    """Two slow echo replicas; each kill trial through the gateway, then through the control
    socket, on the same victim."""
    import aiohttp

    daemon = GatewayDaemon("eh", tracker, [{
        "name": "echo", "replicas": 2, "model": "builtin:echo", "max_batch_size": 64,
        "env": {"ENGINED_ECHO_TOKEN_MS": str(ECHO_TOKEN_MS)}}], http=True)
    await asyncio.to_thread(cleanup.start, daemon, 120)
    timeout = aiohttp.ClientTimeout(total=120)
    sessions = {"gateway": aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(
        limit=0, keepalive_timeout=5)), "control": aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.UnixConnector(path=daemon.socket, limit=0,
                                                         keepalive_timeout=5))}
    trials = []
    try:
        for k in range(kills):
            victim = f"echo-{k % 2}"
            row: dict[str, Any] = {"kill": k + 1, "victim": victim}
            for via, session in sessions.items():
                row[via] = await kill_trial(daemon, session, via, victim, k)
            trials.append(row)
        restarts = sum(e["restarts"] for e in daemon.status()["engines"])
    finally:
        for session in sessions.values():
            await session.close()
    await asyncio.to_thread(cleanup.stop, daemon, 60)
    return {"trials": trials, "restarts": restarts, "stop_note": daemon.stop_note}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="3/15 overhead rounds (tiny-llama/echo), 2 kills")
    parser.add_argument("--rounds", type=int, default=None,
                        help="overhead rounds of tiny-llama (default 40; echo: 5x as many)")
    parser.add_argument("--kills", type=int, default=None, help="engine kills (default 5)")
    add_out_option(parser, "gateway")
    args = parser.parse_args(argv)
    tiny_rounds = args.rounds or (3 if args.quick else 40)
    rounds = {"tiny": tiny_rounds, "echo": 5 * tiny_rounds}
    kills = args.kills or (2 if args.quick else 5)

    def on_sigterm(signum: int, frame: object) -> None:  # `timeout` sends SIGTERM: clean up
        raise SystemExit(f"bench.gateway: signal {signum}, cleaning up")
    signal.signal(signal.SIGTERM, on_sigterm)

    r, tracker = Report(), Tracker()
    cleanup = Cleanup(tracker)
    cache = cleanup.scratch("egc")
    r.header("engined gateway benchmark", args.quick, PROG,
             f"- overhead rounds: tiny-llama {rounds['tiny']}, echo {rounds['echo']} "
             f"(+{WARMUP_ROUNDS} warm-up each); engine kills: {kills}",
             f"- torch {version('torch')}, transformers {version('transformers')}, aiohttp "
             f"{version('aiohttp')}; model: builtin:tiny-llama, float32, CPU, 1 thread")
    load_start, cpu_start, t_run = os.getloadavg(), psutil.cpu_times(), time.monotonic()
    try:
        build_checkpoint(cache)  # untimed, as an engine would on first use
        over = asyncio.run(overhead_scenario(cleanup, tracker, cache, rounds, 8))
        fail = asyncio.run(failover(cleanup, tracker, kills))
    finally:
        leftovers = cleanup.close()
    r(machine_load(load_start, cpu_start, time.monotonic() - t_run), "")
    r("## 1. Overhead vs talking to the engine directly (1 and 8 concurrent requests)", "")
    stats = {group: report_overhead(r, group, over["results"][group], rounds[group])
             for group in MODELS}
    lost_gw, lost_ctl, in_flight_ctl = report_kills(r, fail["trials"])
    report_summary(r, stats, lost_gw, lost_ctl, in_flight_ctl, len(fail["trials"]))
    report_method(r, over, fail)
    return r.finish(leftovers, out_path(args, "gateway"))


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
    r(f"| requests lost per engine kill through the gateway: 0 | {lost_gw} in {kills} kills | "
      f"{'PASS' if lost_gw == 0 else 'MISS'} |",
      f"| (reference) requests lost per kill through the control socket: all in flight on the "
      f"victim | {lost_ctl} lost of {in_flight_ctl} in flight, {kills} kills | report only |", "")


def report_method(r: Report, over: dict[str, Any], fail: dict[str, Any]) -> None:
    notes = "; ".join(n for n in (over["stop_note"], fail["stop_note"]) if n)
    r("## Method", "",
      "- **Direct** is the same engine without the daemon: `python -m engined.engine` with the "
      "same EngineConfig and the exec launcher's environment, against `supervisor/ipc.py`'s own "
      "`EngineChannels` bound by the bench, requests sent with `EngineChannels.open` (the "
      "gateway relay's call): direct costs the ZeroMQ hop, none of the daemon's HTTP or routing.",
      "- A round is C requests (1 or 8) sent at once on one path, timed to the last answer; "
      "every path and concurrency runs one round in turn, the paths in a new seeded random "
      f"order each time; {WARMUP_ROUNDS} warm-up rounds dropped. Overhead = median round time "
      "over direct's − 1 (streamed paths against direct streamed); the fastest quarter of "
      "rounds is the less noisy view on a shared machine. On-CPU per request: "
      "`/proc/PID/task/*/schedstat` of the engine, the daemon and this process (the clients).",
      f"- Equal-length prompts, max_tokens {MAX_TOKENS}, temperature 0; aiohttp clients on one "
      "asyncio loop in this process, on the same 2 CPUs (their parsing is in every row).",
      f"- Every process is tracked and stopped by pid. Unplanned restarts during the overhead "
      f"rounds: {over['restarts']}; restarts of the failover daemon (the kills included): "
      f"{fail['restarts']}" + (f"; {notes}" if notes else "") + ".", "")


if __name__ == "__main__":
    sys.exit(main())
