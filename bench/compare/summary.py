"""The summary of the issue's targets (engined against the floor and the peers, PASS or MISS and
by how much) and the method notes.
"""

from __future__ import annotations

from bench.compare.fleet import FLEET, HB_AGE_LIMIT_S
from bench.compare.labels import CIRCUS, CIRCUS_FAST, ENGINED, FLOOR, FLOOR_ECHO, SV, SV_ECHO
from bench.compare.latency import kill_med, kill_share
from bench.core import SETTLE_S
from bench.report import Report, med, ms_auto, ratio, times


def verdict(ok: bool | None, miss: str) -> str:
    return "n/a" if ok is None else ("PASS" if ok else f"MISS ({miss})")


def report_summary(r: Report, res: dict) -> None:
    kills = res["kills"]

    def m(label: str, attr: str) -> float | None:
        return kill_med(kills, label, attr)

    def share(label: str, attr: str) -> float | None:
        return kill_share(kills, label, attr)

    idle, ctl, sc = res["idle"], res["ctl"], res["scrape"]
    e_idle, e_ctl = idle[ENGINED], med(ctl["enginectl"]["t"])
    e_resp, e_det = m(ENGINED, "respawn_s"), m(ENGINED, "detect_s")
    ready = res["ready"]
    idle_peers = {k: v for k, v in idle.items() if k in (SV, CIRCUS, CIRCUS_FAST)}
    better_cpu = min(idle_peers.items(), key=lambda kv: kv[1]["cpu_pct"]) if idle_peers else None
    peer_ctl = {k: med(v["t"]) for k, v in ctl.items() if k != "enginectl"}
    better_ctl = min(peer_ctl.items(), key=lambda kv: kv[1]) if peer_ctl else None
    f_resp = m(FLOOR, "respawn_s")
    sv_det = m(SV, "detect_s")
    e_det_share, sv_det_share = share(ENGINED, "detect_s"), share(SV_ECHO, "detect_s")
    e_ready = med([x["since_s"] for x in ready])
    scrape_med = med(sc["single"])
    rows_out = []

    def add(target: str, value: str, ref: str, ok: bool | None, miss: str) -> None:
        rows_out.append(f"| {target} | {value} | {ref} | {verdict(ok, miss)} |")

    add("respawn median < 5 ms", ms_auto(e_resp), "", e_resp < 5e-3, f"+{ms_auto(e_resp - 5e-3)}")
    add("respawn within 3× of the floor", f"{times(ratio(e_resp, f_resp))} of the floor",
        f"floor (sleeping child) {ms_auto(f_resp)}; floor (echo engine child) "
        f"{ms_auto(m(FLOOR_ECHO, 'respawn_s'))}", e_resp <= 3 * f_resp,
        f"{e_resp / f_resp:.2f}× > 3×")
    add("detection median < 2 ms", ms_auto(e_det), "", e_det < 2e-3, f"+{ms_auto(e_det - 2e-3)}")
    sv_echo_det = m(SV_ECHO, "detect_s")
    if sv_echo_det is not None:
        add("detection no worse than supervisord's (piped output), the same echo engine child",
            ms_auto(e_det), f"supervisord {ms_auto(sv_echo_det)}", e_det <= sv_echo_det,
            f"+{ms_auto(e_det - sv_echo_det)}, {e_det / sv_echo_det:.2f}×")
        add("… against supervisord with a sleeping child (a lighter child dies sooner: compare "
            "the two floor rows)", ms_auto(e_det), f"supervisord {ms_auto(sv_det)}",
            e_det <= sv_det, f"+{ms_auto(e_det - sv_det)}, {e_det / sv_det:.2f}×")
        if e_det_share is not None and sv_det_share is not None:
            add("… same echo engine child, from the victim's kernel exit event → recorded "
                "(the supervisor's own share)", ms_auto(e_det_share),
                f"supervisord {ms_auto(sv_det_share)}", e_det_share <= sv_det_share,
                f"+{ms_auto(e_det_share - sv_det_share)}")
    else:
        add("detection no worse than supervisord's", ms_auto(e_det), "supervisord not run", None,
            "")
    add("echo kill → READY median < 100 ms", ms_auto(e_ready), "", e_ready < 0.1,
        f"+{ms_auto(e_ready - 0.1)}")
    if better_cpu:
        limit = better_cpu[1]["cpu_pct"] + 1.0
        add(f"idle CPU at {FLEET} children ≤ better peer + 1 % of a core",
            f"{e_idle['cpu_pct']:.3f} %", f"{better_cpu[0]} {better_cpu[1]['cpu_pct']:.3f} % "
            f"→ limit {limit:.3f} %", e_idle["cpu_pct"] <= limit,
            f"+{e_idle['cpu_pct'] - limit:.3f} points of a core over the limit")
    else:
        add(f"idle CPU at {FLEET} children ≤ better peer + 1 %", f"{e_idle['cpu_pct']:.3f} %",
            "no peer run", None, "")
    add(f"idle RSS at {FLEET} children < 80 MB", f"{e_idle['rss_peak'] / 1e6:.1f} MB", "",
        e_idle["rss_peak"] < 80e6, f"+{(e_idle['rss_peak'] - 80e6) / 1e6:.1f} MB")
    if better_ctl:
        add("`enginectl status` ≤ the better peer's wall time", ms_auto(e_ctl),
            f"{better_ctl[0]} {ms_auto(better_ctl[1])}", e_ctl <= better_ctl[1],
            f"+{ms_auto(e_ctl - better_ctl[1])}, {e_ctl / better_ctl[1]:.2f}×")
    else:
        add("`enginectl status` ≤ the better peer's", ms_auto(e_ctl), "no peer run", None, "")
    add(f"scrape median < 20 ms ({FLEET} engines; issue 4)", ms_auto(scrape_med), "",
        scrape_med < 0.02, f"+{ms_auto(scrape_med - 0.02)}")
    hb = max(sc["metric_age_max"], sc["status_age_max"] or 0.0)
    add(f"heartbeats flow during {len(sc['burst'])} back-to-back scrapes (age < 2 s)",
        f"max age {hb:.3f} s, {sc['restarts']} restarts", "", hb < HB_AGE_LIMIT_S and
        not sc["restarts"], f"max age {hb:.3f} s, {sc['restarts']} restarts")
    r("## Summary of the targets", "", "| target | engined | reference (same run) | result |",
      "| --- | --- | --- | --- |", *rows_out, "")


def report_method(r: Report, proc_events: bool, leftovers: list[int], overruns: int) -> None:
    r("## Method", "",
      "- engined: `python -m engined.supervisor.daemon -c SPEC` with `builtin:echo` engines, 1 s "
      "heartbeats, `backoff: {initial: 0s, max: 0s, reset_after: 0s}`, "
      "`start_limit.burst: 1000000` (every restart immediate); `http: off` in scenarios 1-2, "
      "`127.0.0.1:<free port>` for the fleet of 100.",
      "- floor: `bench/floor.py` (asyncio + pidfd + posix_spawn), once with the sleeping child "
      "and once with the very `python -m engined.engine` echo child engined runs.",
      "- supervisord and circus: pinned versions in their own venvs (see the peers line at the "
      "top), run from the venvs' binaries with PYTHONPATH removed; their child is the floor's "
      "sleeping interpreter (one more supervisord runs engined's own echo engine child, for a "
      "like-for-like detection); supervisord with an event listener in scenarios 1-2 and "
      "without one at 100 children.",
      f"- Each kill: wait until the child is up (engined: READY; supervisord: RUNNING) plus "
      f"{SETTLE_S * 1e3:.0f} ms (supervisord: + a random 0–1 s; circus: + a random "
      "0–check_delay), take `time.time()` and "
      "CLOCK_MONOTONIC, `os.kill(pid, SIGKILL)`. " + (
          "The kernel's proc connector stamps the victim's exit and the replacement's fork; "
          "the bench sleeps through each kill and reads those events afterwards (nothing "
          "polls while a supervisor reacts)." if proc_events else
          "No proc connector: a poller reads /proc/<supervisor>/task/<pid>/children."),
      f"- Cleanup: SIGTERM to each supervisor, wait, SIGKILL leftovers by pid; leftovers after "
      f"the clean shutdowns: {leftovers or 'none'}" +
      (f"; proc-event overruns: {overruns}." if proc_events else "."))
