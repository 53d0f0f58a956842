"""The report: a table per section (crash → READY, memory, startup, warm standby) and the summary
of the targets, from the `Run` of each backend.
"""

from __future__ import annotations

from typing import Any

from bench.recovery.crash import Kill
from bench.recovery.daemon import LAUNCHERS, POLL_S, REPLICAS, SETTLE_S, STATUS_EVERY
from bench.recovery.memory import Mem
from bench.recovery.run import Run
from bench.report import Report, counted, med, num, ratio, sec, spread, table

TINY_TARGET_S = 0.25  # tiny-llama through the fork server: crash → READY median
VLLM_TARGET_RATIO = 0.40  # the vLLM backend: forkserver / exec crash → READY medians
STANDBY_TARGET_S = 0.020  # warm standby promotion


def vals(kills: list[Kill], attr: str) -> list[float]:
    return [v for v in (getattr(k, attr) for k in kills) if v is not None]


CRASH_ROWS = (
    ("ready_s", "SIGKILL → READY (daemon's `since`)"),
    ("seen_s", "SIGKILL → READY seen by a 20 ms status poll"),
    ("served_s", "SIGKILL → first token served (`POST /v1/generate`, max_tokens 1)"),
    ("answer_s", "… the answered request's own time in the daemon (`total_s`)"),
    ("detect_s", "… of which SIGKILL → exit recorded (`last_exit.at`)"),
    ("startup_s", "… of which spawn → READY (`startup_s`)"),
    ("load_s", "… of which the child's build → warm-up (its `[ready]` line)"),
)


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
          f"{counted([k.launcher for k in ex])} | | {counted([k.launcher for k in fk])} | | | "
          f"{len(ex)}/{len(fk)} |",
          f"| {run.backend.label} | generate requests sent until one was served (503 before) | "
          f"{med([float(k.attempts) for k in ex]) or 0:.0f} | | "
          f"{med([float(k.attempts) for k in fk]) or 0:.0f} | | | {len(ex)}/{len(fk)} |")
    if skipped:
        r(f"| vLLM backend | skipped: {skipped} | – | – | – | – | – | 0/0 |")
    r("", "Each daemon has one group of 2 replicas; replica 0 is SIGKILLed (through a psutil "
      "handle, after checking it is an engine of that daemon and no fork server), idle, "
      f"{SETTLE_S:g} s after it and the other daemon's last restart were READY. Kills alternate "
      "between the exec and the forkserver daemon (exec first on even rounds). Right after the "
      "kill the bench sends `POST /v1/generate` (max_tokens 1, `engine`: the victim by name) "
      f"on a keep-alive connection to the control socket and resends it every {POLL_S * 1e3:g} "
      "ms while the daemon answers 503 (the victim is dead or not READY yet; the control "
      "socket does not queue for a replica that is down); \"first token served\" is when one "
      f"answered 200. Every {STATUS_EVERY}nd round of that loop also reads `GET /v1/status`. "
      "`since` is the daemon's own READY transition; `startup_s` starts at the spawn (for "
      "the fork server: when the fork returned the engine's pid). Restarts are immediate "
      "(backoff 0). SIGKILL → exit recorded includes the kernel's teardown of the victim "
      "(it frees the address space before the process is a zombie; section 4 has its floor), "
      "so an engine with less private memory (a forked one) is seen dead sooner.", "")
    for run in runs:
        fk = run.kills["forkserver"]
        same = [k.server_pid for k in fk]
        if fk and all(same) and len(set(same)) == 1:
            r(f"- {run.backend.label}: every forkserver restart was forked by the same fork "
              f"server (pid {same[0]}), unaffected by the kills.")
        elif fk:
            r(f"- {run.backend.label}: **the fork server changed or was not ready during the "
              f"kills** (servers: {same}); launchers: {counted([k.launcher for k in fk])}.")
    r("")


# --- 2. memory ------------------------------------------------------------------------------------
def mem_row(backend: str, launcher: str, what: str, m: Mem) -> str:
    desc = f" (+{m.procs - 1} descendants)" if m.procs > 1 else ""
    return (f"| {backend} | {launcher} | {what}{desc} | {m.rss:.0f} | {m.uss:.0f} | "
            f"{m.pss:.0f} |")


def report_memory(r: Report, runs: list[Run], skipped: str | None) -> dict[str, dict]:
    r("## 2. Memory (MB = 10^6 bytes; after each replica served one request)", "",
      *table("backend", "launcher", "process", "RSS", "USS", "PSS"))
    totals: dict[str, dict] = {}
    for run in runs:
        label = run.backend.label
        t: dict[str, Any] = {}
        for launcher in LAUNCHERS:
            mem = run.memory[launcher]
            for name, m in sorted(mem.engines.items()):
                r(mem_row(label, launcher, f"engine {name}", m))
            for s, m in mem.servers:
                r(mem_row(label, launcher, f"fork server ({s['kind']}, pid {s['pid']}, idle)", m))
            engines = list(mem.engines.values())
            servers = [m for _, m in mem.servers]
            t[launcher] = {
                "engine_uss": med([m.uss for m in engines]),
                "engine_pss": med([m.pss for m in engines]),
                "engine_rss": med([m.rss for m in engines]),
                "pss_total": sum(m.pss for m in engines + servers),
                "uss_total": sum(m.uss for m in engines + servers),
                "server_rss": sum(m.rss for m in servers) if servers else None,
                "server_uss": sum(m.uss for m in servers) if servers else None,
                "server_pss": sum(m.pss for m in servers) if servers else None,
            }
        totals[run.backend.key] = t
    if skipped:
        r(f"| vLLM backend | – | skipped: {skipped} | – | – | – |")
    r("", *table("backend", "measure", "exec", "forkserver", "forkserver − exec"))
    for run in runs:
        t = totals[run.backend.key]
        ex, fk = t["exec"], t["forkserver"]
        for key, what in (("engine_rss", "RSS per engine (median)"),
                          ("engine_uss", "USS per engine (median): its private pages"),
                          ("engine_pss", "PSS per engine (median)"),
                          ("pss_total", f"PSS of the fleet: {REPLICAS} engines (+ the fork "
                                        f"server): the memory it really costs"),
                          ("uss_total", f"USS of the fleet: {REPLICAS} engines (+ the fork "
                                        f"server)")):
            r(f"| {run.backend.label} | {what} | {ex[key]:.0f} MB | {fk[key]:.0f} MB | "
              f"{fk[key] - ex[key]:+.0f} MB |")
    r("", "psutil's `memory_full_info()` (from /proc/PID/smaps_rollup): USS counts the pages only "
      "this process maps, PSS splits every shared page among the processes that map it, so "
      "PSS sums to the memory a group of processes really uses. A forked engine shares the "
      "server's preloaded interpreter and imports copy-on-write with the server and its "
      "siblings; an exec'd engine shares only file-backed pages (libraries, page cache). The "
      "fork server's PSS goes down as more children share its pages.", "")
    return totals


# --- 3. startup -----------------------------------------------------------------------------------
def report_startup(r: Report, runs: list[Run], skipped: str | None) -> None:
    r("## 3. Startup: spawn → READY", "",
      *table("backend", "measure", "exec", "forkserver", "forkserver/exec"))
    for run in runs:
        label = run.backend.label
        walls = {x: run.daemons[x].start_wall_s for x in LAUNCHERS}
        r(f"| {label} | daemon start → both replicas READY (the bench's clock) | "
          f"{sec(walls['exec'], 3)} | {sec(walls['forkserver'], 3)} | "
          f"{num(ratio(walls['forkserver'], walls['exec']))} |")
        for e_first, f_first in zip(run.first["exec"], run.first["forkserver"]):
            r(f"| {label} | first start of {e_first['name']}: `startup_s` | "
              f"{sec(e_first.get('startup_s'), 3)} | {sec(f_first.get('startup_s'), 3)} | "
              f"{num(ratio(f_first.get('startup_s'), e_first.get('startup_s')))} |")
        e, f = (med(vals(run.kills[x], "startup_s")) for x in LAUNCHERS)
        r(f"| {label} | restart after a kill: `startup_s` (median) | {sec(e, 3)} | {sec(f, 3)} | "
          f"{num(ratio(f, e))} |")
        e, f = (med(vals(run.kills[x], "load_s")) for x in LAUNCHERS)
        r(f"| {label} | … of which the child's build → warm-up (`[ready]` line, median) | "
          f"{sec(e, 3)} | {sec(f, 3)} | {num(ratio(f, e))} |")
        first_launchers = {x: counted([str(e.get("launcher")) for e in run.first[x]])
                           for x in LAUNCHERS}
        r(f"| {label} | launcher at first start | {first_launchers['exec']} | "
          f"{first_launchers['forkserver']} | |")
        for s in run.servers:
            r(f"| {label} | fork server ({s['kind']}): preload (`import_s`), threads at fork "
              f"(`tasks`), state | – | {sec(s.get('import_s'), 3)}, {s.get('tasks')} thread(s), "
              f"{s.get('state')} | |")
        if not run.servers:
            r(f"| {label} | fork server | – | **none** | |")
    if skipped:
        r(f"| vLLM backend | skipped: {skipped} | – | – | – |")
    r("", "`startup_s` runs from the spawn to READY: for an exec'd engine that is the "
      "interpreter's start, its imports (torch, transformers or vLLM), the model build and the "
      "warm-up; for a forked engine the fork server has done the imports already (`import_s`, "
      "once per server), so what is left is the model build and the warm-up. The first "
      "forked engines also wait for the server's preload, which `startup_s` does not count "
      "(the fork has not happened yet) and the daemon start → READY row does. The replicas "
      "of one daemon start at once and share the CPUs.", "")


# --- 4. warm standby ------------------------------------------------------------------------------
def report_standby(r: Report, runs: list[Run], skipped: str | None) -> None:
    r("## 4. Warm standby promotion (1 serving replica + 1 standby, forkserver)", "",
      *table("backend", "measure", "median", "min–max", "n"))
    for run in runs:
        label, ps = run.backend.label, run.promotions
        if run.standby is not None:
            r(f"| {label} | {run.standby} | – | – | 0 |")
            continue
        for attr, what in (("ready_s", "SIGKILL of the serving replica → READY under its name "
                                       "(daemon's `since`)"),
                           ("seen_s", "SIGKILL → READY seen by a 20 ms status poll"),
                           ("served_s", "SIGKILL → first token served under its name "
                                        "(`POST /v1/generate`, max_tokens 1)"),
                           ("answer_s", "… the answered request's own time in the daemon "
                                        "(`total_s`)"),
                           ("detect_s", "… of which SIGKILL → exit recorded (`last_exit.at`)"),
                           ("promote_s", "… of which exit recorded → READY under its name (the "
                                         "promotion itself)"),
                           ("spare_s", "SIGKILL → a new standby READY again (its `since`)"),
                           ("spare_startup_s", "… the new standby's spawn → READY "
                                               "(`startup_s`)")):
            v = [x for x in (getattr(p, attr) for p in ps) if x is not None]
            r(f"| {label} | {what} | {sec(med(v), 3)} | {spread(v, 3)} | {len(v)} |")
        uss = med([p.victim_uss_mb for p in ps]) or 0.0
        rss = med([p.victim_rss_mb for p in ps]) or 0.0
        huge = med([p.victim_huge_mb for p in ps])
        r(f"| {label} | floor: SIGKILL → exit seen (pidfd) of a process mapping what the victim "
          f"mapped ({uss:.0f} MB private, its median USS, of which {huge or 0:.0f} MB in huge "
          f"pages; {rss - uss:.0f} MB shared, RSS − USS): the kernel's teardown alone | "
          f"{sec(med(run.floor), 3)} | {spread(run.floor, 3)} | {len(run.floor)} |")
        r(f"| {label} | the standby's engine took over (same pid), not a restart | "
          f"{sum(p.promoted for p in ps)} of {len(ps)} | | {len(ps)} |",
          f"| {label} | launcher of the new standbys | "
          f"{counted([p.spare_launcher for p in ps])} | | {len(ps)} |")
    if skipped:
        r(f"| vLLM backend | skipped: {skipped} | – | – | 0 |")
    r("", "A daemon of its own per backend (after the exec and forkserver daemons stopped): the "
      "group has 1 serving replica and `standby: 1`. Before each kill both are READY (the "
      f"standby with `\"role\": \"standby\"`) and settled {SETTLE_S:g} s; the serving "
      "replica's engine is SIGKILLed and the same generate-and-poll loop as in section 1 runs "
      "against its name. The daemon promotes the READY standby's engine under the dead one's "
      "name (a new incarnation, the same pid) and the standby builds a new spare, which the "
      "bench waits for before the next kill. The daemon learns of a death when the process "
      "exits, and the kernel tears its address space down before it reports that: the floor "
      "row is that teardown alone, SIGKILL → its pidfd readable (what the daemon waits on) "
      "for a bare process that maps as much as the victim did (its USS in pages of its own, "
      "its RSS − USS in pages its parent holds too, all anonymous, touched, 4 KiB pages): the "
      "share of a promotion no supervisor can remove.", "")


# --- summary --------------------------------------------------------------------------------------
def report_summary(r: Report, runs: list[Run], skipped: str | None,
                   totals: dict[str, dict]) -> None:
    r("## Summary", "", *table("target / measure", "exec", "forkserver", "forkserver/exec",
                               "target", "result"))
    by_key = {run.backend.key: run for run in runs}
    for run in runs:
        key, label = run.backend.key, run.backend.label
        e_ready, f_ready = (med(vals(run.kills[x], "ready_s")) for x in LAUNCHERS)
        e_served, f_served = (med(vals(run.kills[x], "served_s")) for x in LAUNCHERS)
        if key == "tiny":
            target = f"forkserver ≤ {TINY_TARGET_S:g} s"
            ok = f_ready is not None and f_ready <= TINY_TARGET_S
            miss = f"MISS by {(f_ready or 0) - TINY_TARGET_S:.3f} s"
        else:
            target = f"forkserver ≤ {VLLM_TARGET_RATIO * 100:.0f} % of exec"
            rr = f_ready / e_ready if f_ready is not None and e_ready else None
            ok = rr is not None and rr <= VLLM_TARGET_RATIO
            miss = f"MISS by {((rr or 0) - VLLM_TARGET_RATIO) * 100:.0f} points"
        r(f"| {label}: crash → READY (median `since`) | {sec(e_ready, 3)} | {sec(f_ready, 3)} | "
          f"{num(ratio(f_ready, e_ready))} | {target} | {'PASS' if ok else miss} |",
          f"| {label}: crash → first token served (median) | {sec(e_served, 3)} | "
          f"{sec(f_served, 3)} | {num(ratio(f_served, e_served))} | – | report only |")
        t = totals[key]
        r(f"| {label}: PSS of {REPLICAS} engines (+ fork server) | "
          f"{t['exec']['pss_total']:.0f} MB | {t['forkserver']['pss_total']:.0f} MB | "
          f"{t['forkserver']['pss_total'] / t['exec']['pss_total']:.2f} | – | report only |")
    if "vllm" not in by_key:
        r(f"| vLLM backend: crash → READY | – | – | – | forkserver ≤ "
          f"{VLLM_TARGET_RATIO * 100:.0f} % of exec | skipped: {skipped} |")
    for run in runs:
        label = run.backend.label
        ready = med([p.ready_s for p in run.promotions])
        if run.standby is not None or ready is None:
            verdict = run.standby or "not measured"
        else:
            ok = ready <= STANDBY_TARGET_S and all(p.promoted for p in run.promotions)
            floor = med(run.floor)
            verdict = ("PASS" if ok else
                       f"MISS by {(ready - STANDBY_TARGET_S) * 1e3:.1f} ms"
                       if ready > STANDBY_TARGET_S else "MISS: not promoted")
            if floor is not None and not ok:
                verdict += (f" (the kernel's teardown of the victim alone: "
                            f"{floor * 1e3:.0f} ms)")
        r(f"| {label}: warm standby promotion: SIGKILL of the serving replica → READY under its "
          f"name (median `since`) | – | {sec(ready, 3)} | – | ≤ {STANDBY_TARGET_S * 1e3:g} ms | "
          f"{verdict} |")
    r("")
