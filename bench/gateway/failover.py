"""Requests lost per engine kill. Two echo replicas (20 ms a token), 32 concurrent
requests (half streamed), one replica SIGKILLed once the engines' heartbeats count all of them;
through the gateway (it moves them to the other replica) and through the control socket (no
failover) in turn, on the same victim; every answer checked against the echo oracle.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import urllib.request
from typing import Any

import psutil

from bench.common import BenchError, wait_until
from bench.gateway.paths import GatewayDaemon
from bench.report import Report, table
from testkit.driver import is_engine_of

# Two echo replicas that take their time (20 ms per token).
ECHO_TOKEN_MS = 20
KILL_CLIENTS = 32
KILL_PROMPT_CHARS = 200  # 4 s per request at 20 ms a token: still running when the kill lands

_MIGRATIONS_RE = re.compile(rb'^engined_gateway_migrations_total\{model="echo"\} (\S+)$', re.M)


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


def migrations(daemon: GatewayDaemon) -> float:
    """`engined_gateway_migrations_total` from the daemon's GET /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.http_port}/metrics",
                                timeout=30) as resp:
        m = _MIGRATIONS_RE.search(resp.read())
    return float(m.group(1)) if m else 0.0


async def kill_trial(daemon: GatewayDaemon, session: Any, via: str, victim: str, trial: int
                     ) -> dict[str, Any]:
    """KILL_CLIENTS requests at once (half streamed), the victim SIGKILLed once every request is
    on an engine (their last heartbeats count all of them), then every answer checked."""
    await asyncio.to_thread(wait_until, lambda: routable_and_idle(daemon), 30,
                            "both replicas routable and idle", 0.05)
    moved0 = await asyncio.to_thread(migrations, daemon)
    base = f"http://127.0.0.1:{daemon.gateway_port}/v1"
    prompts = [(f"{via[0]}{trial}-{i:02d} " + "abcdefghij" * 30)[:KILL_PROMPT_CHARS]
               for i in range(KILL_CLIENTS)]
    tasks = [asyncio.create_task(kill_request(session, via, base, p, i % 2 == 0))
             for i, p in enumerate(prompts)]

    def all_placed() -> list[dict[str, Any]] | None:
        engines = daemon.status()["engines"]
        return engines if sum(queue_of(engines).values()) >= KILL_CLIENTS else None
    try:
        engines = await asyncio.to_thread(wait_until, all_placed, 3.5,
                                          f"{KILL_CLIENTS} requests on the engines", 0.05)
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
    moved = await asyncio.to_thread(migrations, daemon) - moved0
    return {"via": via, "victim": victim, "in_flight": in_flight, "lost": len(errors),
            "moved": moved, "errors": errors[:3]}


# --- report ---------------------------------------------------------------------------------------
def report_kills(r: Report, trials: list[dict[str, Any]]) -> tuple[int, int, int]:
    r(f"## 2. Requests lost per engine kill ({KILL_CLIENTS} concurrent requests, 2 echo "
      f"replicas, {ECHO_TOKEN_MS} ms per token)", "",
      *table("kill", "victim", "in flight on it (gateway run)", "lost with gateway",
             "moved by the gateway", "in flight on it (control-socket run)",
             "lost without (control socket)"))
    for t in trials:
        g, c = t["gateway"], t["control"]
        r(f"| {t['kill']} | {t['victim']} | {g['in_flight']} | {g['lost']} | {g['moved']:.0f} | "
          f"{c['in_flight']} | {c['lost']} |")
    tot = [sum(t[via][key] for t in trials) for via, key in (
        ("gateway", "in_flight"), ("gateway", "lost"), ("gateway", "moved"),
        ("control", "in_flight"), ("control", "lost"))]
    r(f"| all {len(trials)} | – | {tot[0]} | {tot[1]} | {tot[2]:.0f} | {tot[3]} | {tot[4]} |", "")
    examples = [e for t in trials for via in ("gateway", "control") for e in t[via]["errors"]]
    if examples:
        r("How the lost requests failed (first few): "
          + "; ".join(f"`{e}`" for e in examples[:4]) + ".", "")
    r(f"Each trial sends {KILL_CLIENTS} requests at once ({KILL_PROMPT_CHARS}-character "
      f"prompts, {KILL_PROMPT_CHARS * ECHO_TOKEN_MS / 1000:g} s each; every other one streamed), "
      "waits until the engines' heartbeats count all of them (the \"in flight\" columns: the "
      "victim's `queue` running + waiting in `GET /v1/status`), SIGKILLs the victim by pid and "
      "checks every answer against the echo oracle (the whole prompt, streamed or not: an "
      "error, a cut stream or other text is lost); through the gateway and through the control "
      "socket (`POST /v1/generate`, no failover) in turn, on the same victim. \"Moved\": the "
      "delta of `engined_gateway_migrations_total`.", "")
    return tot[1], tot[4], tot[3]
