"""Scenarios 3, 4 and 6: fleets of 100 children. Idle overhead (all five supervisors at once,
nobody calling: CPU and peak RSS), control latency (`enginectl status` against `supervisorctl`
and `circusctl`, a fresh process per call, tools in turn), and GET /metrics with 100 echo engines
(single scrapes, then a burst while another connection polls the heartbeats).
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from bench.common import (
    ROOT,
    BenchError,
    Cleanup,
    StatusConnection,
    cpu_s,
    engine_processes,
    without_engined_vars,
)
from bench.compare.labels import CIRCUS, CIRCUS_FAST, ENGINED, FLOOR, SV
from bench.core import Engined, Floor
from bench.metrics import Scraper
from bench.peers import Circus, Supervisord, peer_env
from bench.report import Report, med, ms_auto, ms_range, ratio, table, times
from testkit.driver import free_port

FLEET = 100  # children in scenarios 3, 4 and 6
HB_AGE_LIMIT_S = 2.0
HEARTBEAT_S = 1.0  # bench.common.HEARTBEATS: heartbeat_interval 1s



def sample_idle(pids: dict[str, int], duration_s: float) -> dict[str, dict]:
    """CPU (user+sys of the supervisor process itself) over the window; RSS sampled each second."""
    procs = {label: psutil.Process(pid) for label, pid in pids.items()}
    c0 = {k: cpu_s(p) for k, p in procs.items()}
    rss = {k: [p.memory_info().rss] for k, p in procs.items()}
    w0 = time.monotonic()
    deadline = w0 + duration_s
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(1.0, left))
        for k, p in procs.items():
            rss[k].append(p.memory_info().rss)
    wall = time.monotonic() - w0
    out = {}
    for k, p in procs.items():
        used = cpu_s(p) - c0[k]
        out[k] = {"cpu_s": used, "cpu_pct": 100 * used / wall, "rss_peak": max(rss[k]),
                  "children": len(engine_processes(p)), "wall_s": wall, "samples": len(rss[k])}
    return out


def enginectl_argv(sock: str) -> tuple[list[str], str]:
    script = Path(sys.executable).parent / "enginectl"
    if script.exists():
        return [str(script), "--socket", sock, "status"], f"`{script.name} status` (console script)"
    return ([sys.executable, "-m", "engined.supervisor.cli", "--socket", sock, "status"],
            "`python -m engined.supervisor.cli status` (no enginectl script next to this "
            "interpreter)")


def timed_call(argv: list[str], env: dict, cwd: Path) -> tuple[float, int, int]:
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=60)
    return time.perf_counter() - started, done.returncode, len(done.stdout.splitlines())


_HB_RE = re.compile(rb'^engined_engine_heartbeat_timestamp_seconds\{engine="([^"]+)"\} (\S+)$',
                    re.M)


def scrape_scenario(daemon: Engined, port: int, n: int, burst: int) -> dict:
    scraper = Scraper(port)
    try:
        scraper.get()  # warm-up: connection, first collection
        single = [scraper.get()[0] for _ in range(n)]
        size = len(scraper.get()[2])
        restarts_before = sum(e["restarts"] for e in daemon.status()["engines"])

        status_ages: list[tuple[float, float]] = []  # (time, max heartbeat_age_s over engines)
        stop = threading.Event()

        def poll_status() -> None:  # its own connection to the control socket
            probe = StatusConnection(daemon.socket)
            try:
                while not stop.is_set():
                    ages = [e["heartbeat_age_s"] for e in probe.get()["engines"]
                            if e["heartbeat_age_s"] is not None]
                    status_ages.append((time.time(), max(ages)))
                    stop.wait(0.2)
            finally:
                probe.close()
        poller = threading.Thread(target=poll_status, daemon=True)
        poller.start()
        t0 = time.monotonic()
        results = [scraper.get() for _ in range(burst)]
        burst_wall = time.monotonic() - t0
        stop.set()
        poller.join(10)
        restarts_after = sum(e["restarts"] for e in daemon.status()["engines"])
    finally:
        scraper.close()
    metric_ages = []
    for _took, recv, body in results:
        stamps = [float(v) for _name, v in _HB_RE.findall(body)]
        metric_ages.append(max(recv - s for s in stamps) if stamps else float("inf"))
        if len(stamps) != daemon.replicas:
            raise BenchError(f"a scrape showed {len(stamps)} heartbeat timestamps, "
                             f"expected {daemon.replicas}")
    return {"single": single, "size": size, "burst": [r[0] for r in results],
            "burst_wall": burst_wall, "metric_age_max": max(metric_ages),
            "status_age_max": max((a for _t, a in status_ages), default=None),
            "status_polls": len(status_ages), "restarts": restarts_after - restarts_before}


def fleet_scenarios(cleanup: Cleanup, venvs: dict[str, Path | None], idle_s: float, ctl_n: int,
                    scrape_n: int, burst_n: int) -> dict:
    """engined with 100 echo engines beside the floor and the peers with 100 children each:
    scenario 3 (idle), 4 (status calls); then 6 (scrapes) with the peers gone."""
    tracker = cleanup.tracker
    sv_venv, circus_venv = venvs["supervisord"], venvs["circus"]
    res: dict = {}
    port = free_port()
    big = Engined(FLEET, tracker, http=f"127.0.0.1:{port}")
    fleets: dict[str, object] = {ENGINED: big, FLOOR: Floor(FLEET, tracker)}
    if sv_venv:
        fleets[SV] = Supervisord(sv_venv, FLEET, tracker, listener=False, label=SV)
    if circus_venv:
        fleets[CIRCUS] = Circus(circus_venv, FLEET, tracker, None, CIRCUS)
        fleets[CIRCUS_FAST] = Circus(circus_venv, FLEET, tracker, 0.1, CIRCUS_FAST)
    t0 = time.monotonic()
    cleanup.start(big, timeout_s=900)
    res["fleet_start_s"] = time.monotonic() - t0
    for thing in fleets.values():
        if thing is not big:
            if hasattr(thing, "dir"):
                cleanup.dirs.append(thing.dir)
            cleanup.start(thing)
    time.sleep(3.0)  # last READY and spawns done, heartbeats flowing
    res["idle"] = sample_idle({k: v.pid for k, v in fleets.items()}, idle_s)
    kids = engine_processes(psutil.Process(big.pid))
    res["echo_rss_median"] = statistics.median(c.memory_info().rss for c in kids)

    # scenario 4: status calls, tools in turn
    ctl_argv, ctl_how = enginectl_argv(big.socket)
    calls = {"enginectl": (ctl_argv, without_engined_vars(), ROOT)}
    if sv_venv:
        calls["supervisorctl"] = (fleets[SV].ctl_argv(), peer_env(), fleets[SV].dir)
    if circus_venv:
        calls["circusctl (default check_delay)"] = (fleets[CIRCUS].ctl_argv(), peer_env(),
                                                    fleets[CIRCUS].dir)
        calls["circusctl (check_delay = 0.1 s)"] = (fleets[CIRCUS_FAST].ctl_argv(),
                                                    peer_env(), fleets[CIRCUS_FAST].dir)
    ctl: dict[str, dict] = {k: {"t": [], "rc": set(), "lines": 0} for k in calls}
    for i in range(ctl_n + 1):
        for k, (argv_, env, cwd) in calls.items():
            took, rc, lines = timed_call(argv_, env, cwd)
            if i:  # the first round warms the page cache
                ctl[k]["t"].append(took)
            ctl[k]["rc"].add(rc)
            ctl[k]["lines"] = lines
    res.update(ctl=ctl, ctl_how=ctl_how)
    for thing in fleets.values():
        if thing is not big:
            cleanup.stop(thing)

    # scenario 6: scrape (the peers are gone; engined's 100 engines keep heartbeating)
    res["scrape"] = scrape_scenario(big, port, scrape_n, burst_n)
    cleanup.stop(big, 60)
    big.remove_dir()
    return res


# --- report ---------------------------------------------------------------------------------------
def report_idle(r: Report, res: dict) -> None:
    """Scenario 3."""
    idle = res["idle"]
    e_idle = idle[ENGINED]
    r(f"## 3. Idle overhead ({FLEET} children, {e_idle['wall_s']:.0f} s, nobody calling)", "",
      "| supervisor | children | CPU s | % of one core | peak RSS | CPU ÷ engined | "
      "RSS ÷ engined |", "| --- | --- | --- | --- | --- | --- | --- |")
    names = {ENGINED: "engined (100 echo engines, 1 s heartbeats)", FLOOR: FLOOR,
             SV: "supervisord (100 sleeping programs, numprocs=100)",
             CIRCUS: "circus, default check_delay (one watcher, numprocesses=100)",
             CIRCUS_FAST: "circus, check_delay = 0.1 s"}
    for label, x in idle.items():
        r(f"| {names[label]} | {x['children']} | {x['cpu_s']:.3f} | {x['cpu_pct']:.3f} % | "
          f"{x['rss_peak'] / 1e6:.1f} MB | {times(ratio(x['cpu_s'], e_idle['cpu_s']))} | "
          f"{times(ratio(x['rss_peak'], e_idle['rss_peak']))} |")
    r("", f"All five ran at once over the same window (so the same load hit them). CPU = user+sys "
      f"of the supervisor process itself (all its threads), RSS sampled once a second, "
      f"MB = 10^6 bytes. engined's fleet of {FLEET} echo engines took "
      f"{res['fleet_start_s']:.1f} s from spawn to all READY; one echo engine's RSS is "
      f"{res['echo_rss_median'] / 1e6:.1f} MB (median). The peers' children are the floor's "
      f"sleeping interpreter (`python -c 'import time; time.sleep(1e9)'`): peers have no "
      f"heartbeats to handle, engined receives {FLEET} per second: its CPU is "
      f"{1e6 * e_idle['cpu_s'] / (FLEET * e_idle['wall_s'] / HEARTBEAT_S):.0f} µs per "
      f"heartbeat received, everything included.", "")



def report_control(r: Report, res: dict) -> None:
    """Scenario 4."""
    ctl = res["ctl"]
    e_ctl = med(ctl["enginectl"]["t"])
    r(f"## 4. Control latency: `status` with {FLEET} children (wall time per call)", "",
      "| command | median | min – max | n | this ÷ enginectl | exit codes | output lines |",
      "| --- | --- | --- | --- | --- | --- | --- |")
    for k, x in ctl.items():
        r(f"| {k} | {ms_auto(med(x['t']))} | {ms_range(x['t'])} | {len(x['t'])} | "
          f"{times(ratio(med(x['t']), e_ctl))} | {', '.join(map(str, sorted(x['rc'])))} | "
          f"{x['lines']} |")
    r("", f"engined: {res['ctl_how']}; supervisorctl and circusctl are their venvs' console "
      "scripts. Each call is a fresh process (interpreter start, imports, one request, output), "
      "timed from spawn to exit; tools take turns, after one untimed warm-up round. "
      "circusctl prints one line per watcher, the others one per process.", "")



def report_scrape(r: Report, res: dict) -> None:
    """Scenario 6."""
    sc = res["scrape"]
    r(f"## 6. Scrape: GET /metrics with {FLEET} echo engines", "",
      *table("measure", "median", "min – max", "n"),
      f"| one scrape (keep-alive connection, one at a time) | {ms_auto(med(sc['single']))} | "
      f"{ms_range(sc['single'])} | {len(sc['single'])} |",
      f"| a scrape during a burst of {len(sc['burst'])} back-to-back | "
      f"{ms_auto(med(sc['burst']))} | {ms_range(sc['burst'])} | {len(sc['burst'])} |", "",
      f"Body: {sc['size'] / 1e3:.0f} kB. During the burst ({sc['burst_wall']:.1f} s): the oldest "
      f"heartbeat in any scrape (receive time − `engined_engine_heartbeat_timestamp_seconds`) "
      f"was {sc['metric_age_max']:.3f} s; the largest `heartbeat_age_s` in "
      f"`GET /v1/status` (polled every 0.2 s from another connection, {sc['status_polls']} "
      f"polls) was "
      f"{'–' if sc['status_age_max'] is None else format(sc['status_age_max'], '.3f')} s; "
      f"restarts during the burst: {sc['restarts']}.", "")

