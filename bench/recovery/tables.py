"""The report of sections 1-3 (crash → READY by launcher, memory, warm standby promotion) and the
summary of the targets, from the `Run` of each backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench.recovery.daemon import LAUNCHERS, REPLICAS, Backend
from bench.recovery.measure import POLL_S, SETTLE_S, Kill, Mem
from bench.report import DASH, Report, counted, med, num, ratio, sec, spread, table

TINY_TARGET_S = 0.25  # tiny-llama through the fork server: crash → READY median
VLLM_TARGET_RATIO = 0.40  # the vLLM backend: forkserver / exec crash → READY medians
STANDBY_TARGET_S = 0.020  # warm standby promotion


@dataclass
class Run:
    backend: Backend
    kills: dict[str, list[Kill]]
    memory: dict[str, dict[str, list[Mem]]]
    promotions: list[Kill] = field(default_factory=list)
    floor: list[float] = field(default_factory=list)  # kernel teardown of a like process


def vals(kills: list[Kill], attr: str) -> list[float]:
    return [v for v in (getattr(k, attr) for k in kills) if v is not None]


CRASH_ROWS = (("ready_s", "SIGKILL → READY (daemon's `since`)"),
              ("seen_s", "SIGKILL → READY seen by a 20 ms status poll"),
              ("served_s", "SIGKILL → first token served (`POST /v1/generate`, max_tokens 1)"),
              ("detect_s", "… of which SIGKILL → exit recorded (`last_exit.at`)"),
              ("startup_s", "… of which spawn → READY (`startup_s`)"))


def report_crash(r: Report, runs: list[Run], skipped: str | None) -> None:
    r("## 1. Crash → READY and → first token (SIGKILL of replica 0, idle)", "",
      *table("backend", "measure", "exec median", "exec min–max", "forkserver median",
             "forkserver min–max", "forkserver/exec", "n"))
    for run in runs:
        ex, fk = run.kills["exec"], run.kills["forkserver"]
        for attr, label in CRASH_ROWS:
            e, f = vals(ex, attr), vals(fk, attr)
            r(f"| {run.backend.label} | {label} | {sec(med(e), 3)} | {spread(e, 3)} | "
              f"{sec(med(f), 3)} | {spread(f, 3)} | {num(ratio(med(f), med(e)))} | "
              f"{len(e)}/{len(f)} |")
        r(f"| {run.backend.label} | launcher of the new incarnations | "
          f"{counted(k.launcher for k in ex)} | | {counted(k.launcher for k in fk)} | | | "
          f"{len(ex)}/{len(fk)} |")
    if skipped:
        r(f"| vLLM backend | skipped: {skipped} | {DASH} | {DASH} | {DASH} | {DASH} | {DASH} | "
          "0/0 |")
    r("", f"Two daemons side by side that differ only in `launcher:`, each with a group of "
      f"{REPLICAS} replicas; replica 0 is SIGKILLed (after checking it is an engine of that "
      f"daemon and no fork server), idle, {SETTLE_S:g} s after it was READY; kills alternate "
      "between the two daemons. Right after the kill the bench sends `POST /v1/generate` "
      f"(max_tokens 1, to the victim by name) and resends it every {POLL_S * 1e3:g} ms while the "
      "daemon answers 503. Restarts are immediate (backoff 0).", "")


def report_memory(r: Report, runs: list[Run]) -> dict[str, dict[str, float]]:
    r("## 2. Memory (MB = 10^6 bytes; after each replica served one request)", "",
      *table("backend", "measure", "exec", "forkserver", "forkserver − exec"))
    fleet: dict[str, dict[str, float]] = {}
    for run in runs:
        got: dict[str, dict[str, float | None]] = {}
        for launcher in LAUNCHERS:
            engines, servers = run.memory[launcher]["engines"], run.memory[launcher]["servers"]
            got[launcher] = {"rss": med(m.rss for m in engines), "uss": med(m.uss for m in engines),
                             "pss": med(m.pss for m in engines),
                             "fleet": sum(m.pss for m in engines + servers),
                             "server": sum(m.rss for m in servers) if servers else None}
        fleet[run.backend.key] = {x: float(got[x]["fleet"] or 0) for x in LAUNCHERS}
        for key, what in (("rss", "RSS per engine (median)"),
                          ("uss", "USS per engine (median): its private pages"),
                          ("pss", "PSS per engine (median)"),
                          ("fleet", f"PSS of {REPLICAS} engines (+ the fork server): what they "
                                    "really cost"),
                          ("server", "RSS of the fork server (its preloaded imports)")):
            e, f = got["exec"][key], got["forkserver"][key]
            diff = DASH if e is None or f is None else f"{f - e:+.0f} MB"
            r(f"| {run.backend.label} | {what} | {num(e, 0, 'MB')} | {num(f, 0, 'MB')} | {diff} |")
    r("", "psutil's `memory_full_info()`: USS counts the pages only this process maps, PSS "
      "splits every shared page among those that map it. A forked engine shares the server's "
      "preloaded interpreter and imports copy-on-write; an exec'd engine only file-backed "
      "pages. A warm standby is a full engine: its cost is one more engine's.", "")
    return fleet


STANDBY_ROWS = (("ready_s", "SIGKILL of the serving replica → READY under its name (`since`)"),
                ("served_s", "SIGKILL → first token served under its name"),
                ("detect_s", "… of which SIGKILL → exit recorded (`last_exit.at`)"),
                ("spare_s", "SIGKILL → a new standby READY again (its `since`)"))


def report_standby(r: Report, runs: list[Run]) -> None:
    r("## 3. Warm standby promotion (1 serving replica + `standby: 1`, forkserver)", "",
      *table("backend", "measure", "median", "min–max", "n"))
    for run in runs:
        label, ps = run.backend.label, run.promotions
        for attr, what in STANDBY_ROWS:
            v = vals(ps, attr)
            r(f"| {label} | {what} | {sec(med(v), 3)} | {spread(v, 3)} | {len(v)} |")
        uss = med(p.victim_uss_mb for p in ps) or 0.0
        rss = med(p.victim_rss_mb for p in ps) or 0.0
        r(f"| {label} | floor: SIGKILL → exit seen (pidfd) of a process mapping what the victim "
          f"mapped ({uss:.0f} MB its own, {rss - uss:.0f} MB shared): the kernel's teardown "
          f"alone | {sec(med(run.floor), 3)} | {spread(run.floor, 3)} | {len(run.floor)} |",
          f"| {label} | the standby's engine took over (same pid), not a restart | "
          f"{sum(p.promoted for p in ps)} of {len(ps)} | | {len(ps)} |")
    r("", "A daemon of its own per backend; before each kill both engines are READY. The "
      "daemon promotes the standby's engine under the dead one's name and builds a new spare, "
      "which the bench waits for. The kernel tears the victim's address space down before it "
      "reports the exit: the floor row is that share, which no supervisor can remove.", "")


def report_summary(r: Report, runs: list[Run], skipped: str | None,
                   fleet: dict[str, dict[str, float]], upgrade: dict[str, Any]) -> None:
    r("## Summary", "", *table("target / measure", "exec", "forkserver", "forkserver/exec",
                               "target", "result"))
    for run in runs:
        key, label = run.backend.key, run.backend.label
        e, f = (med(vals(run.kills[x], "ready_s")) for x in LAUNCHERS)
        if key == "tiny":
            target, ok = f"forkserver ≤ {TINY_TARGET_S:g} s", f is not None and f <= TINY_TARGET_S
        else:
            target = f"forkserver ≤ {VLLM_TARGET_RATIO * 100:.0f} % of exec"
            ok = (ratio(f, e) or 1.0) <= VLLM_TARGET_RATIO
        r(f"| {label}: crash → READY (median `since`) | {sec(e, 3)} | {sec(f, 3)} | "
          f"{num(ratio(f, e))} | {target} | {'PASS' if ok else 'MISS'} |",
          f"| {label}: PSS of {REPLICAS} engines (+ fork server) | {fleet[key]['exec']:.0f} MB | "
          f"{fleet[key]['forkserver']:.0f} MB | "
          f"{num(ratio(fleet[key]['forkserver'], fleet[key]['exec']))} | – | report only |")
        ready = med(p.ready_s for p in run.promotions)
        ok = ready is not None and ready <= STANDBY_TARGET_S and all(
            p.promoted for p in run.promotions)
        r(f"| {label}: warm standby promotion, SIGKILL → READY under its name (median) | – | "
          f"{sec(ready, 3)} | – | ≤ {STANDBY_TARGET_S * 1e3:g} ms | {'PASS' if ok else 'MISS'} "
          f"(the kernel's teardown alone: {sec(med(run.floor), 3)}) |")
    if skipped:
        r(f"| vLLM backend | – | – | – | – | skipped: {skipped} |")
    for key, row in upgrade.items():
        r(f"| upgrade, {key} | – | {row} | – | – | report only |")
    r("")
