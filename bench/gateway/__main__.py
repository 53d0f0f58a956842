"""Gateway benchmark: what the OpenAI-compatible gateway costs, and what it saves when engines die.

    python -m bench.gateway [--quick] [--out FILE]

The run: scenarios 1-2 on a daemon with a tiny-llama and an echo group beside the direct engines,
then scenarios 3-4 on a daemon of two slow echo replicas (`failover_and_lag`); the reports, the
summary of the targets and the method. The scenarios are the package's other modules
(bench/gateway/__init__.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psutil

from bench.common import Cleanup, Tracker
from bench.gateway.failover import ECHO_TOKEN_MS, kill_trial, report_kills
from bench.gateway.lag import STREAMS, lag_phase, report_lag
from bench.gateway.overhead import (
    OVERHEAD_TARGET_PCT,
    WARMUP_ROUNDS,
    overhead_scenario,
    report_overhead,
    report_ttft,
)
from bench.gateway.paths import CONCURRENCY, MAX_TOKENS, MODELS, PATH, GatewayDaemon
from bench.metrics import Snapshots, read_lag
from bench.models import build_checkpoint
from bench.report import (
    Report,
    add_out_option,
    engined_revision,
    machine_lines,
    machine_load,
    out_path,
    table,
    title,
)

SETTLE_S = 2.0  # between the phases of scenario 4 (and before the first)


# --- scenarios 3 and 4: one daemon of two slow echo replicas --------------------------------------
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


# --- the run --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="5/30 overhead rounds (tiny-llama/echo), 2 kills, 8 s lag phases")
    add_out_option(parser, "gateway")
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
    out = out_path(args, "gateway")

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
    r(title("engined gateway benchmark", args.quick), "", *machine_lines(),
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

    r(machine_load(load_start, cpu_start, time.monotonic() - t_run), "")
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


# --- summary and method ---------------------------------------------------------------------------
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
