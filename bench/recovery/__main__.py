"""Recovery and upgrade gaps: an engine's crash by launcher and with a warm standby, new engined
code put in place under load, and a sleeping model's wake.

    python -m bench.recovery [--quick] [-n KILLS] [--rounds N] [--wakes N] [--vllm-python PATH]
                             [--no-vllm]

The run: for tiny-llama, then the vLLM backend (a full run; without its interpreter it is skipped
and the report says so), an exec and a forkserver daemon side by side (sections 1-2), then a
standby daemon (section 3); then the upgrade rounds (section 4, bench/recovery/upgrade.py); then
engines on demand: a wake by kind, the vLLM kinds in a full run (section 5), a swap under load
(section 6, bench/recovery/ondemand.py); the tables and the summary of the targets.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from importlib.metadata import version

import psutil

from bench.common import BenchError, Cleanup, Tracker, build_checkpoint
from bench.recovery.daemon import (
    LAUNCHERS,
    REPLICAS,
    Backend,
    Daemon,
    Generate,
    tiny_backend,
    vllm_backend,
)
from bench.recovery.measure import kill_once, measure_memory, teardown_floor
from bench.recovery.ondemand import kinds, report_swap, report_wake, swap_section, wake_section
from bench.recovery.tables import (
    Run,
    report_crash,
    report_memory,
    report_standby,
    report_summary,
)
from bench.recovery.upgrade import LABELS, Round, report_upgrade, upgrade_section
from bench.report import Report, add_out_option, cpu_busy_pct, med, out_path
from bench.vllm.engine import default_vllm_python, serve_env, vllm_versions

PROG = "python -m bench.recovery"


def run_backend(backend: Backend, n: int, cleanup: Cleanup) -> Run:
    """The exec and the forkserver daemon (started one after the other: each start has the
    machine to itself), kills alternating between them, their memory; then the standby daemon
    and the kernel's teardown floor."""
    daemons = {x: cleanup.start(Daemon(backend, x, cleanup.tracker)) for x in LAUNCHERS}
    gens = {x: Generate(d.socket) for x, d in daemons.items()}
    cleanup.closers.extend(g.close for g in gens.values())
    kills: dict[str, list] = {x: [] for x in LAUNCHERS}
    for i in range(n):
        for x in (LAUNCHERS if i % 2 == 0 else LAUNCHERS[::-1]):
            kills[x].append(kill_once(daemons[x], gens[x]))
    run = Run(backend, kills, {x: measure_memory(daemons[x], gens[x]) for x in LAUNCHERS})
    for x in LAUNCHERS:
        gens[x].close()
        cleanup.stop(daemons[x])  # its memory back before the next daemon starts
    d = cleanup.start(Daemon(backend, "forkserver", cleanup.tracker, standby=1))
    gen = Generate(d.socket)
    cleanup.closers.append(gen.close)
    run.promotions = [kill_once(d, gen, f"{backend.group}-standby-0") for _ in range(n)]
    own = med(p.victim_uss_mb for p in run.promotions) or 1.0
    mapped = med(p.victim_rss_mb for p in run.promotions) or own
    run.floor = teardown_floor(own, max(0.0, mapped - own), cleanup.tracker)
    gen.close()
    cleanup.stop(d)
    return run


def vllm_python(args: argparse.Namespace) -> tuple[str, str | None, str]:
    """(the interpreter, why the vLLM part is skipped or None, its versions)."""
    python = args.vllm_python or default_vllm_python()
    if args.no_vllm or args.quick:
        return python, "--quick (the full run measures it)" if args.quick else "--no-vllm", ""
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return python, f"no vLLM interpreter at {python}", ""
    try:
        return python, None, vllm_versions(python)
    except BenchError as exc:
        return python, f"the vLLM interpreter does not run: {str(exc)[:200]}", ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny-llama only, 2 kills per launcher; 1 upgrade round of each, "
                        "4 clients")
    parser.add_argument("-n", type=int, default=None,
                        help="kills per launcher and promotions, per backend (default 5)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="upgrade rounds of each scenario (default 5)")
    parser.add_argument("--wakes", type=int, default=None,
                        help="timed wakes per kind of engine (default 5; --quick 3)")
    parser.add_argument("--vllm-python", default=None,
                        help="the vLLM venv's interpreter (default $ENGINED_VLLM_PYTHON, else "
                        "<repo>/.venv-vllm/bin/python)")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM backend")
    add_out_option(parser, "recovery")
    args = parser.parse_args(argv)
    n = args.n or (2 if args.quick else 5)
    rounds, clients = args.rounds or (1 if args.quick else 5), 4 if args.quick else 8
    wakes, swaps = args.wakes or (3 if args.quick else 5), (1, 8) if args.quick else (3, 25)
    python, skipped, versions = vllm_python(args)

    r, tracker = Report(), Tracker()
    cleanup = Cleanup(tracker)
    cache = cleanup.scratch("erc")
    cpu_start = psutil.cpu_times()
    r.header("engined recovery: crash by launcher, warm standby, upgrade under load, on demand",
             args.quick, PROG, f"- kills per launcher and promotions: {n} per backend; upgrade "
             f"rounds: {rounds} of each scenario, {clients} clients; wakes: {wakes} per kind; "
             f"swap: {swaps[0]} round(s) of 4 clients × {swaps[1]} requests per fleet",
             f"- tiny-llama: torch {version('torch')}, transformers {version('transformers')}; "
             "builtin:tiny-llama, float32, CPU, threads 1, max_batch_size 8",
             f"- vLLM backend: {python} ({versions}), bench.vllm's engine" if skipped is None
             else f"- vLLM backend: **skipped**: {skipped}")
    try:
        checkpoint = build_checkpoint(cache)  # untimed, as an engine would on first use
        runs = [run_backend(tiny_backend(cache), n, cleanup)]
        if skipped is None:  # vLLM's files read once, untimed: no daemon pays for a cold cache
            subprocess.run([python, "-c", "import vllm.v1.engine.llm_engine"], cwd="/tmp",
                           env=serve_env(), capture_output=True, timeout=600, check=True)
            runs.append(run_backend(vllm_backend(python, cache), n, cleanup))
        upgrades = upgrade_section(cleanup, cache, rounds, clients, args.quick)
        wake = wake_section(cleanup, kinds(cache, checkpoint, None if skipped else python), wakes)
        swap = swap_section(cleanup, cache, swaps[0], 4, swaps[1])
    finally:
        leftovers = cleanup.close()
    r(f"- all CPUs {cpu_busy_pct(cpu_start):.0f} % busy during the run", "")
    report_crash(r, runs, skipped)
    fleet = report_memory(r, runs)
    report_standby(r, runs)
    report_upgrade(r, upgrades, clients)
    report_wake(r, wake, skipped)
    report_swap(r, swap, 4)
    report_summary(r, runs, skipped, fleet, upgrade_summary(upgrades))
    return r.finish(leftovers, out_path(args, "recovery"))


def upgrade_summary(rounds: dict[str, list[Round]]) -> dict[str, str]:
    out = {}
    for key, label in LABELS.items():
        xs = rounds[key]
        gap = [x.facts["gap_s"] for x in xs if x.facts.get("gap_s") is not None]
        out[label] = (f"gap {statistics.median(gap):.3f} s, " if gap else "") + (
            f"{statistics.median(len(x.failed()) for x in xs):.0f} requests failed, "
            f"{statistics.median(x.engines_kept for x in xs):.0f} of {REPLICAS} engines kept "
            "(medians)")
    return out


if __name__ == "__main__":
    sys.exit(main())
