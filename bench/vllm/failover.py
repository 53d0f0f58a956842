"""Sections 2 and 3: an engine that dies or freezes. Crash → READY: SIGKILL of the engine child,
started by exec (`launcher: exec`, pinned: a cold interpreter per restart; the fork server is
bench.recovery's) → READY again, against a cold start of `vllm serve` as an outer supervisor
would restart it, and how long that server takes to exit after its EngineCore is SIGKILLed. A
frozen engine core: SIGSTOP of the engine child with a streamed gateway request in flight → the
daemon declares it hung, restarts it, and the request finishes on the replacement; against `vllm
serve` with its EngineCore SIGSTOPped mid-request, `/health` polled for a window.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import BenchError, Tracker, wait_until
from bench.report import Report, dist_row, table
from bench.vllm.engine import ENGINE, GROUP, MAX_TOKENS, PROMPTS, START_TIMEOUT_S, BackendDaemon
from bench.vllm.server import (
    FREEZE_MAX_TOKENS,
    VllmServe,
    descendants,
    engine_core_of,
    http_status,
    post_json,
    stream_in_flight,
)
from testkit.driver import process_gone


# --- 2. crash → READY, and `vllm serve` -----------------------------------------------------------
def crash_to_ready(daemon: BackendDaemon) -> dict[str, float]:
    """SIGKILL the replica; poll status until READY with a new incarnation."""
    e = daemon.wait_ready(1)
    time.sleep(0.2)  # settle (its first heartbeats) before the kill
    t_kill = time.time()
    os.kill(e["pid"], signal.SIGKILL)
    new = daemon.wait_ready(e["incarnation"] + 1)
    seen = time.time()
    load_s = daemon.child_load_s(new["incarnation"])
    return {"ready_s": new["since"] - t_kill, "seen_s": seen - t_kill,
            "detect_s": new["last_exit"]["at"] - t_kill, "startup_s": new["startup_s"],
            "load_s": load_s if load_s is not None else float("nan")}


def serve_freeze(serve: VllmServe, core: psutil.Process, window_s: float) -> dict[str, Any]:
    """SIGSTOP the EngineCore while a streamed completion runs; poll /health for the window."""
    stream = stream_in_flight(serve.port, {"model": str(serve.model), "prompt": PROMPTS[0],
                                           "max_tokens": FREEZE_MAX_TOKENS, "temperature": 0,
                                           "ignore_eos": True}, "vllm serve's completion")
    t_stop = time.time()
    core.send_signal(signal.SIGSTOP)
    polls: list[tuple[float, int | None]] = []
    try:
        while (now := time.time()) - t_stop < window_s:
            polls.append((now - t_stop, http_status(serve.port, timeout_s=2.0)))
            time.sleep(max(0.0, 0.25 - (time.time() - now)))
        in_window = stream.tokens_after(t_stop + 0.2)  # 0.2 s: what was already on the wire
        ended_in_window = stream.ended_at is not None
    finally:
        core.send_signal(signal.SIGCONT)
    t_cont = time.time()
    stream.join(60)
    first_bad = next((t for t, status in polls if status != 200), None)
    return {"window_s": window_s, "polls": len(polls),
            "ok_polls": sum(1 for _, s in polls if s == 200), "first_bad_s": first_bad,
            "tokens_in_window": in_window, "ended_in_window": ended_in_window,
            "after_cont": (f"finished {stream.finish!r} {time.time() - t_cont:.1f} s after "
                           f"SIGCONT, {len(stream.token_times)} tokens"
                           if stream.ended_at and not stream.error
                           else f"error: {stream.error}" if stream.ended_at
                           else "still open 60 s after SIGCONT")}


def serve_run(python: str, model: Path, scratch: Path, tracker: Tracker, k: int,
              freeze_window_s: float | None) -> dict[str, Any]:
    """One cold start (spawn → /health 200 → first completion), maybe the freeze test, then
    SIGKILL of its EngineCore → the API server's exit (vLLM is fail-stop)."""
    serve = VllmServe(python, model, scratch, tracker, k)
    out: dict[str, Any] = {}
    try:
        t0 = serve.start()
        out["health_s"] = serve.wait_health() - t0
        code, body = post_json(serve.port, "/v1/completions",
                               {"model": str(model), "prompt": PROMPTS[0],
                                "max_tokens": MAX_TOKENS[0], "temperature": 0})
        if code != 200:
            raise BenchError(f"vllm serve completion: HTTP {code}: {body}")
        out["first_completion_s"] = time.time() - t0
        serve.track()
        core = engine_core_of(serve.proc.pid)  # type: ignore[union-attr]
        if core is None:
            raise BenchError(f"no EngineCore under vllm serve: {descendants(serve.proc.pid)}")
        out["tree"] = sorted({p.name() for p in descendants(serve.proc.pid)})
        if freeze_window_s is not None:
            out["freeze"] = serve_freeze(serve, core, freeze_window_s)
            time.sleep(0.5)
        t_kill = time.time()
        core.kill()
        health_down = None
        while serve.alive() and time.time() - t_kill < 60:
            status = http_status(serve.port, timeout_s=1.0)
            if health_down is None and status != 200:
                health_down = time.time() - t_kill
            time.sleep(0.05)
        out["exit_s"] = time.time() - t_kill if not serve.alive() else None
        out["exit_code"] = serve.proc.poll()  # type: ignore[union-attr]
        out["health_down_s"] = health_down
    finally:
        serve.stop()
    return out


# --- 3. a frozen engine core under engined --------------------------------------------------------
def engined_freeze(daemon: BackendDaemon) -> dict[str, Any]:
    """SIGSTOP the engine child while a streamed gateway completion runs on it; poll the daemon's
    /health and status until the replacement is READY; wait for the request to finish."""
    e = daemon.wait_ready(1)
    wait_until(lambda: daemon.engine()["heartbeat_age_s"] is not None, 30, "a first heartbeat",
               0.05)
    old_pid, old_inc = e["pid"], e["incarnation"]
    stream = stream_in_flight(daemon.gateway_port, {"model": GROUP, "prompt": PROMPTS[0],
                                                    "max_tokens": FREEZE_MAX_TOKENS,
                                                    "temperature": 0}, "the gateway's completion")
    t_stop = time.time()
    os.kill(old_pid, signal.SIGSTOP)
    health_bad = None
    try:
        def replaced() -> dict[str, Any] | None:
            nonlocal health_bad
            if health_bad is None and http_status(daemon.http_port) != 200:
                health_bad = time.time() - t_stop
            daemon.check_alive()
            now = daemon.engine()
            return now if now["state"] == "READY" and now["incarnation"] > old_inc else None
        new = wait_until(replaced, START_TIMEOUT_S, f"{ENGINE} READY after SIGSTOP", 0.05)
    finally:
        if not process_gone(old_pid):  # the daemon kills it; never leave a stopped process
            os.kill(old_pid, signal.SIGKILL)
    daemon.tracker.add(new["pid"])
    stream.join(120)
    last = new["last_exit"] or {}
    usage = stream.usage or {}
    return {"detect_s": last.get("at", float("nan")) - t_stop, "reason": last.get("reason"),
            "signal": last.get("signal"), "health_bad_s": health_bad,
            "ready_s": new["since"] - t_stop,
            "request": ("finished" if stream.ended_at and not stream.error else
                        f"error: {stream.error}" if stream.ended_at else "still open"),
            "request_finish": stream.finish, "request_tokens": usage.get("completion_tokens"),
            "request_done_s": (stream.ended_at - t_stop) if stream.ended_at else None,
            "tokens_before_stop": sum(1 for t in stream.token_times if t <= t_stop)}


# --- report ---------------------------------------------------------------------------------------
def report_crash(r: Report, crashes: list[dict], serves: list[dict]) -> dict[str, float]:
    tree = ", ".join(serves[0]["tree"]) if serves else "?"
    r("## 2. Crash → READY: engined's restart vs a cold start of `vllm serve`", "",
      *table("measure", "median", "min–max", "n"),
      dist_row("engined: SIGKILL → READY (daemon's `since`)", [c["ready_s"] for c in crashes]),
      dist_row("engined: SIGKILL → READY seen by a 20 ms status poll",
               [c["seen_s"] for c in crashes]),
      dist_row("… of which SIGKILL → exit recorded (`last_exit.at`)",
               [c["detect_s"] for c in crashes]),
      dist_row("… of which spawn → READY (`startup_s`)", [c["startup_s"] for c in crashes]),
      dist_row("… of which the child's import → warm-up (its `[ready]` line)",
               [c["load_s"] for c in crashes]),
      dist_row("`vllm serve` cold start: spawn → `/health` 200",
               [s["health_s"] for s in serves]),
      dist_row(f"`vllm serve` cold start: spawn → first completion ({MAX_TOKENS[0]} tokens) "
               f"answered", [s["first_completion_s"] for s in serves]),
      dist_row("`vllm serve`: SIGKILL of its EngineCore → `/health` stops answering 200",
               [s["health_down_s"] for s in serves]),
      dist_row("`vllm serve`: SIGKILL of its EngineCore → the API server has exited",
               [s["exit_s"] for s in serves]), "")
    crash = statistics.median(c["ready_s"] for c in crashes)
    cold = statistics.median(s["health_s"] for s in serves)
    exits = [s["exit_s"] for s in serves if s["exit_s"] is not None]
    outer = cold + statistics.median(exits) if exits else None
    r(f"Crash → READY under engined: median {crash:.2f} s; a cold `vllm serve` to `/health` 200: "
      f"{cold:.2f} s, {cold / crash:.2f}× engined's restart. vLLM is fail-stop: after its "
      f"EngineCore is SIGKILLed the API server exits (codes: "
      f"{', '.join(str(s['exit_code']) for s in serves)}), and only then can an outer "
      f"supervisor start a new one: "
      + (f"exit + cold start = {outer:.2f} s, {outer / crash:.2f}× engined's SIGKILL → READY."
         if outer is not None else "it did not exit within 60 s.")
      + f" `vllm serve` is an API server process plus its children ({tree}), and the API "
      f"server, the EngineCore and the worker each import vLLM in turn; engined's restart is "
      f"one fresh interpreter (`launcher: exec`, pinned in this benchmark) that imports vLLM "
      f"and builds LLMEngine in-process. engined's default launcher, the fork server, skips "
      f"those imports (`python -m bench.recovery` measures it against exec). Scenario 2 kills "
      f"the engine idle; the cold starts and the kills alternate.",
      "")
    return {"crash": crash, "cold": cold, "outer": outer if outer is not None else float("nan")}


def report_freeze(r: Report, freezes: list[dict], serve_freeze_: dict | None,
                  heartbeat_timeout: str) -> None:
    r("## 3. A frozen engine core (SIGSTOP, a streamed request in flight)", "",
      *table("measure", "median", "min–max", "n"),
      dist_row("engined: SIGSTOP → its `/health` stops answering 200 (hang declared)",
               [f["health_bad_s"] for f in freezes]),
      dist_row("engined: SIGSTOP → killed as hung, exit recorded (`last_exit.at`)",
               [f["detect_s"] for f in freezes]),
      dist_row("engined: SIGSTOP → READY again (`since`)", [f["ready_s"] for f in freezes]),
      dist_row("engined: SIGSTOP → the in-flight gateway request finished",
               [f["request_done_s"] for f in freezes]), "")
    reasons = ", ".join(sorted({f"{f['reason']}/{f['signal']}" for f in freezes}))
    outcomes = "; ".join(f"{f['request']} ({f['request_finish']}, {f['request_tokens']} of "
                         f"{FREEZE_MAX_TOKENS} tokens, {f['tokens_before_stop']} before the "
                         f"stop)" for f in freezes)
    r(f"engined: `last_exit` reason/signal: {reasons}; the in-flight request (streamed "
      f"`/v1/completions` through the gateway, max_tokens {FREEZE_MAX_TOKENS}): {outcomes}.", "")
    r(*table("`vllm serve`, EngineCore SIGSTOPped", "result"))
    if serve_freeze_ is None:
        r("| (not run) | – |", "")
        return
    f = serve_freeze_
    window = f"{f['window_s']:g} s"
    r("| `/health` stops answering 200 | "
      + (f"after {f['first_bad_s']:.2f} s" if f["first_bad_s"] is not None
         else f"never within {window}") + " |",
      f"| `/health` polls answered 200 (every 0.25 s) | {f['ok_polls']} of {f['polls']} |",
      f"| tokens of the in-flight completion received in the window (after the first 0.2 s) | "
      f"{f['tokens_in_window']} of {FREEZE_MAX_TOKENS}"
      + (" (the request ended)" if f["ended_in_window"] else ", the request hangs") + " |",
      f"| after SIGCONT | {f['after_cont']} |", "")
    r(f"engined detects the frozen core by its missing heartbeats (heartbeat_timeout "
      f"{heartbeat_timeout}, counted from the last heartbeat, which came up to one 1 s interval "
      f"before the stop: detection lands between the timeout minus one interval and the "
      f"timeout), kills its process group and restarts it (a full vLLM start, as in "
      f"scenario 2); the gateway moves the request to "
      f"the replacement, which resumes after the tokens already delivered. `vllm serve`'s "
      f"`/health` fails only once its EngineCore process has died (vLLM 0.32: a thread "
      f"watches the process's liveness and `check_health` reads the flag it sets): a stopped "
      f"core keeps `/health` at 200 while the request makes no progress, so an outer "
      f"supervisor's `/health` probe never restarts it.", "")
