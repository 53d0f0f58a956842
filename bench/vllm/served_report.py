"""Section 4, reported: `vllm serve` under engined against a bare cold start (kills) and against
its own `/health` and a Kubernetes-style liveness probe (freezes), and its rows of the summary.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.report import Report, dist_row, med_spread, table
from bench.vllm.engine import SERVE_MODULE
from bench.vllm.served import (
    FREEZE_LABELS,
    FREEZES,
    K8S_FAILURES,
    K8S_FIRES_WITHIN,
    K8S_PERIOD_S,
    K8S_TIMEOUT_S,
    SERVED_ARGS,
    SERVED_STALL_TIMEOUT,
)
from bench.vllm.server import FREEZE_MAX_TOKENS


def health_text(h: dict[str, Any]) -> str:
    if h["polls"] == 0:
        return f"no poll ended within {h['span_s']:.1f} s"
    if h["first_bad_s"] is None:
        return f"200 throughout ({h['ok']} of {h['polls']} polls, {h['span_s']:.1f} s)"
    return (f"not 200 from {h['first_bad_s']:.2f} s ({h['ok']} of {h['polls']} polls 200 in "
            f"{h['span_s']:.1f} s)")


def healths_text(hs: list[dict[str, Any]]) -> str:
    if all(h["polls"] and h["first_bad_s"] is None for h in hs):
        return (f"200 throughout ({sum(h['ok'] for h in hs)} of {sum(h['polls'] for h in hs)} "
                f"polls, {sum(h['span_s'] for h in hs):.1f} s in all, {len(hs)} runs)")
    return "; ".join(health_text(h) for h in hs)


def request_text(fs: list[dict[str, Any]]) -> str:
    if not fs or "request" not in fs[0]:
        return "– (none in flight)"
    return "; ".join(f"{f['request']} ({f['request_finish']}, {f['request_tokens']} of "
                     f"{FREEZE_MAX_TOKENS} tokens, {f['tokens_before_stop']} before the stop, "
                     f"{f['tokens_streamed']} streamed)" for f in fs)


def k8s_text(w: dict[str, Any]) -> str:
    n, ok = w["probes"]
    if w["fired_s"] is None:
        return f"never within {w['window_s']:.0f} s ({ok} of {n} probes passed)"
    phase = (f", the stop {w['phase_s']:.1f} s after a probe began" if "phase_s" in w else "")
    return (f"fired after {w['fired_s']:.2f} s ({ok} of {n} probes passed{phase}; expected "
            f"{K8S_FIRES_WITHIN[0]:g}–{K8S_FIRES_WITHIN[1]:g} s)")


def report_serve(r: Report, s: dict[str, Any], section2: list[dict] | None) -> dict[str, Any]:
    kills = {t: [k for k in s["kills"] if k["target"] == t] for t in ("core", "api")}
    freezes = {key: [f for f in s["freezes"] if (f["target"], f["in_flight"]) == key]
               for key in FREEZES}
    cold = s["bare_health_s"]
    r("## 4. `vllm serve` under engined: a command engine (crash → READY, hang detection)", "",
      f"One replica: `command: [VLLM_PYTHON, -m, {SERVE_MODULE}, --model, DIR, --host, "
      f"127.0.0.1, --port, \"{{port}}\", {', '.join(SERVED_ARGS)}]`, `port: auto`, "
      f"`progress: vllm`, `probe: {{path: /health, interval: 1s, timeout: 2s, failures: 3}}`, "
      f"`stall_timeout: {SERVED_STALL_TIMEOUT}`, restarts immediate (backoff 0), the gateway on "
      f"a loopback port; the bare `vllm serve` baseline runs the same argv with a fixed port. "
      f"The server's tree: {', '.join(s['tree'])}.", "",
      *table("measure", "median", "min–max", "n"))
    for target, label in (("core", "EngineCore (`VLLM::EngineCore`, a grandchild) SIGKILL"),
                          ("api", "API server SIGKILL")):
        ks = kills[target]
        r(dist_row(f"engined: {label} → READY again (daemon's `since`)",
                   [k["ready_s"] for k in ks]),
          dist_row("… of which SIGKILL → exit recorded (`last_exit.at`)",
                   [k["detect_s"] for k in ks]),
          dist_row("… of which exit recorded → respawn", [k["respawn_s"] for k in ks]),
          dist_row("… of which respawn → READY (`startup_s`: to the first passing probe)",
                   [k["startup_s"] for k in ks]))
    r(dist_row("engined: first start, spawn → READY (`startup_s`, incarnation 1)",
               [s["first_startup_s"]]),
      dist_row("bare `vllm serve` cold start (same argv): spawn → `/health` 200 (50 ms poll)",
               [cold]),
      dist_row("bare `vllm serve` cold start: spawn → first completion answered",
               [s["bare_completion_s"]]))
    if section2:
        r(dist_row("section 2's bare `vllm serve` cold starts (`--disable-log-stats`): spawn → "
                   "`/health` 200", [x["health_s"] for x in section2]))
    core_ready = statistics.median(k["ready_s"] for k in kills["core"])
    api_ready = statistics.median(k["ready_s"] for k in kills["api"])
    exits = {t: ", ".join(k["exit"] for k in kills[t]) for t in kills}
    left = [p for k in s["kills"] for p in k["left"]]
    r("", f"engined's restart of `vllm serve` is a cold start of `vllm serve`: EngineCore "
      f"SIGKILL → READY {core_ready:.2f} s = {core_ready / cold:.2f}× the bare cold start "
      f"({cold:.2f} s); API server SIGKILL → READY {api_ready:.2f} s = {api_ready / cold:.2f}×. "
      f"What engined adds is detection (an API server SIGKILL: at once, it is engined's child; "
      f"an EngineCore SIGKILL: vLLM's API server exits on its own a few seconds later, unless "
      f"three failed probes come first: vLLM's `/health` answers 500 once the core is dead) "
      f"and READY at the first passing probe (1 s apart, so up to 1 s after `/health` would "
      f"first have answered). Exits recorded: EngineCore kills {exits['core']}; API server "
      f"kills {exits['api']}. The old server's tree (API server, EngineCore, worker) was gone "
      f"by the next READY: {'yes, every time' if not left else f'NO, left: {left}'}. Killed "
      f"idle; kills alternate EngineCore / API server.", "")

    r(*table("measure", *(FREEZE_LABELS[key] for key in FREEZES)))

    def row(label: str, cell) -> None:
        r(f"| {label} | " + " | ".join(cell(freezes[key]) for key in FREEZES) + " |")
    row("engined: SIGSTOP → killed (`last_exit.at`)",
        lambda fs: med_spread([f["detect_s"] for f in fs]))
    row("engined: verdict (`last_exit.reason`)",
        lambda fs: ", ".join(sorted({f["exit"] for f in fs})) or "–")
    row("engined: killed → READY again (`since` − `last_exit.at`)",
        lambda fs: med_spread([f["restart_s"] for f in fs]))
    row("engined: SIGSTOP → READY again (`since`)",
        lambda fs: med_spread([f["ready_s"] for f in fs]))
    row("vLLM's own `/health` until engined killed it (0.25 s polls, 2 s timeout)",
        lambda fs: healths_text([f["health"] for f in fs]))
    row("the in-flight gateway request", request_text)
    row("SIGSTOP → the in-flight request finished",
        lambda fs: med_spread([f.get("request_done_s") for f in fs]) if fs and fs[0]["in_flight"]
        else "–")
    row("n", lambda fs: str(len(fs)))
    left = [p for f in s["freezes"] for p in f["left"]]
    r("", f"engined's verdicts: a frozen EngineCore with a request in flight is a **stall** "
      f"(the gateway counts the request; vLLM's `vllm:generation_tokens_total` stops moving "
      f"for stall_timeout {SERVED_STALL_TIMEOUT}: 4-6 s after the stop, by where the last "
      f"progress read fell); a frozen API server fails its probes (3 × 2 s timeouts: a **hang** "
      f"6-7 s after the stop), unless a request in flight makes it a stall first (no progress "
      f"can be read either). A frozen core with nothing in flight is not detected by design "
      f"(nothing is waiting on it; the next request makes it a stall). The gateway moves a "
      f"request whose replica died to the replacement once it is READY, continuing after the "
      f"tokens already delivered. Stopped processes left after the verdict (SIGKILLed by pid "
      f"here): {left or 'none'}.", "")

    bare = s["bare"]
    r(*table("bare `vllm serve`, no supervisor",
             "EngineCore SIGSTOPped, request in flight",
             "then its API server SIGSTOPped too (whole server frozen)"),
      f"| vLLM's own `/health` (0.25 s polls, 2 s timeout) | {health_text(bare['core']['health'])} "
      f"| {health_text(bare['api']['health'])} |",
      f"| k8s-style liveness probe on `/health` (period {K8S_PERIOD_S:g} s, timeout "
      f"{K8S_TIMEOUT_S:g} s, failureThreshold {K8S_FAILURES}) | {k8s_text(bare['core'])} | "
      f"{k8s_text(bare['api'])} |",
      f"| tokens of the in-flight completion received in the window (after the first 0.2 s) | "
      f"{bare['core']['tokens']} of {FREEZE_MAX_TOKENS} | – |", "")

    def engined_cell(key: tuple[str, bool]) -> str:
        fs = freezes[key]
        return (f"{med_spread([f['detect_s'] for f in fs])} "
                f"({', '.join(sorted({f['reason'] for f in fs}))})") if fs else "–"
    core_bare, api_bare = bare["core"], bare["api"]
    r(*table("a hung `vllm serve`: SIGSTOP → detected", "engined (probes + progress)",
             "vLLM's own `/health`", "k8s-style liveness probe (10 s / 1 s / 3)"),
      f"| EngineCore frozen, request in flight | {engined_cell(('core', True))} | "
      f"{'200 throughout' if core_bare['health']['first_bad_s'] is None else 'fails'} | "
      f"{k8s_text(core_bare)} |",
      f"| API server frozen, request in flight | {engined_cell(('api', True))} | "
      f"{health_text(api_bare['health']).split(' (')[0]} | {k8s_text(api_bare)} |",
      f"| API server frozen, idle | {engined_cell(('api', False))} | "
      f"{health_text(api_bare['health']).split(' (')[0]} | same as above (the probe does "
      f"not see requests) |", "")
    r(f"The k8s-style probe runs against a second, bare `vllm serve` (no supervisor) frozen the "
      f"same way, for {s['window_s']:g} s with its EngineCore stopped, then with its API server "
      f"stopped too until the probe fires (at most {s['api_bound_s']:g} s): under engined the "
      f"server is killed within seconds, so the frozen state would not last a probe period. "
      f"The probe has run since the server was healthy, on its own 10 s ticker, so where the "
      f"stop falls in its period is arbitrary: it fires {K8S_FIRES_WITHIN[0]:g}–"
      f"{K8S_FIRES_WITHIN[1]:g} s after a stop that fails every probe (the first failing probe "
      f"within a period, two more periods, the last one's timeout). The bare server is frozen "
      f"(no CPU) while engined's runs go on beside it, and stopped after them.", "")
    return {"core_ready": core_ready, "api_ready": api_ready, "cold": cold,
            "freezes": freezes, "bare": bare}


def report_serve_summary(r: Report, sv: dict[str, Any]) -> None:
    cold = sv["cold"]
    for name, label in (("core_ready", "EngineCore"), ("api_ready", "API server")):
        r(f"| `vllm serve` under engined: {label} SIGKILL → READY vs a bare cold start to "
          f"`/health` 200 | {sv[name]:.2f} s | {cold:.2f} s | report only: {sv[name] / cold:.2f}× "
          f"(the restart is a cold start) |")
    freezes, bare = sv["freezes"], sv["bare"]
    for key in FREEZES:
        fs = freezes[key]
        base = k8s_text(bare["core" if key[0] == "core" else "api"]).split(" (")[0]
        r(f"| `vllm serve` under engined: {FREEZE_LABELS[key]} → detected | "
          f"{med_spread([f['detect_s'] for f in fs])} "
          f"({', '.join(sorted({f['reason'] for f in fs}))}) "
          f"| k8s-style liveness probe: {base} | report only |")
