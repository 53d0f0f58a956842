"""enginectl's tables: an engine's status row (state, ages, last exit) and the plain-text
table they make, for one daemon or several nodes."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any


def wall_now() -> float:
    """The clock ages are computed against (a function, so tests can pin it)."""
    return time.time()


def humanize_duration(seconds: float, coarse: bool = False) -> str:
    """3m12s / 2h05m / 1d03h; with coarse, only the largest unit (for "2m ago")."""
    s = int(max(seconds, 0.0))
    units = [("d", 86400), ("h", 3600), ("m", 60), ("s", 1)]
    for i, (name, size) in enumerate(units):
        if s >= size or size == 1:
            major, rest = divmod(s, size)
            if coarse or size == 1:
                return f"{major}{name}"
            minor_name, minor_size = units[i + 1]
            return f"{major}{name}{rest // minor_size:02d}{minor_name}"
    raise AssertionError("unreachable")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f}s" if seconds < 60 else humanize_duration(seconds)


def format_last_exit(last_exit: Mapping[str, Any] | None, now: float) -> str:
    """`signal SIGKILL (signal) 2m ago`, `code 78 (exit) 5s ago`, or `-`."""
    if not last_exit:
        return "-"
    if last_exit.get("signal"):
        text = f"signal {last_exit['signal']}"
    elif last_exit.get("code") is not None:
        text = f"code {last_exit['code']}"
    else:
        text = "exit"
    if last_exit.get("reason"):
        text += f" ({last_exit['reason']})"
    if last_exit.get("at") is not None:
        text += f" {humanize_duration(now - last_exit['at'], coarse=True)} ago"
    return text


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


STATE_REASON_CHARS = 60  # a FAILED reason in the table; `status NAME` prints all of it


def state_cell(engine: Mapping[str, Any], now: float) -> str:
    """The state and what explains it: FAILED (why), STARTING (phase, for how long), BACKOFF
    (retry in N s), STOPPED (by whom); a standby says so."""
    state = str(engine.get("state"))
    since = engine.get("since")
    why = ""
    if state == "FAILED":
        reason = str(engine.get("fail_reason") or "")
        why = reason if len(reason) <= STATE_REASON_CHARS else \
            reason[:STATE_REASON_CHARS - 1].rstrip() + "…"
    elif state == "STARTING":
        phase = engine.get("phase") or "spawned"
        why = phase if since is None else f"{phase}, {humanize_duration(now - since)}"
    elif state == "BACKOFF":
        at = engine.get("restart_at")
        why = "restarting now" if at is None else \
            f"retry in {humanize_duration(max(0.0, at - now) + 0.999)}"
    elif state == "ASLEEP":
        why = asleep_why(engine.get("on_demand") or {})
    elif state == "STOPPED":
        if engine.get("desired") == "stopped":
            why = "by an operator"
        elif engine.get("last_exit"):
            why = "exited; its restart policy keeps it down"
    if engine.get("role") == "standby":
        why = f"standby, {why}" if why else "standby"
    return f"{state} ({why})" if why else state


def asleep_why(on_demand: Mapping[str, Any]) -> str:
    """`idle 10m, wakes on request`: why it sleeps (routing.ondemand's reasons)."""
    reason, idle = on_demand.get("reason"), on_demand.get("idle_timeout_s")
    why = {"idle": f"idle {humanize_duration(idle, coarse=True)}" if idle else "idle",
           "budget": "for the memory budget", "operator": "by an operator",
           "start": "on demand"}.get(str(reason), "asleep")
    if on_demand.get("in_place"):  # vLLM's sleep mode: the process is kept
        level = str(on_demand.get("sleep_mode", "")).removeprefix("level")
        why = f"{why}, sleep level {level}"
    return f"{why}, wakes on request"


def status_row(engine: Mapping[str, Any], now: float) -> list[str]:
    since = engine.get("since")
    return [
        str(engine.get("name")),
        state_cell(engine, now),
        _dash(engine.get("pid")),
        _dash(engine.get("restarts")),
        "-" if since is None else humanize_duration(now - since),
        _age(engine.get("heartbeat_age_s")),
        format_last_exit(engine.get("last_exit"), now),
    ]


# IN-STATE: time since the last state change (not the process's uptime: a BACKOFF or FAILED
# engine has none)
STATUS_HEADER = ["NAME", "STATE", "PID", "RESTARTS", "IN-STATE", "HEARTBEAT", "LAST-EXIT"]


def render_table(rows: list[list[str]]) -> str:
    """Left-aligned columns two spaces apart; the last column is not padded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)
