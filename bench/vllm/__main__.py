"""vLLM benchmark: vLLM under engined against vLLM on its own, in one run.

    python -m bench.vllm [--quick] [--only all|backend|serve|serving] [--out FILE]

The run: the options (`Plan`); sections 1-3 (`measure_backend`: the overhead paths, then kills
and `vllm serve` cold starts interleaved, then freezes, then the heavier model on processes of
its own), section 4 (bench/vllm/served.py), section 5 (bench/vllm/serving.py); then the report
of each and the summary of the targets. The sections themselves are the package's other
modules (bench/vllm/__init__.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import HEARTBEATS, Cleanup, Tracker, expose_engine_package
from bench.models import build_checkpoint
from bench.report import (
    Report,
    add_out_option,
    engined_revision,
    load_average,
    machine_lines,
    med,
    out_path,
    sec,
    signed_pct,
    table,
    title,
)
from bench.vllm.engine import (
    SERVE_ARGS,
    SERVE_MODULE,
    VLLM_ENV,
    BackendDaemon,
    default_vllm_python,
    engine_spec,
    vllm_versions,
)
from bench.vllm.failover import (
    crash_to_ready,
    engined_freeze,
    report_crash,
    report_freeze,
    serve_run,
)
from bench.vllm.overhead import (
    HEAVY_SUSTAINED_REQUESTS,
    HEAVY_SUSTAINED_REQUESTS_QUICK,
    OVERHEAD_TARGET_PCT,
    PATH_LABELS,
    SUSTAINED_REQUESTS,
    SUSTAINED_REQUESTS_QUICK,
    DirectWorker,
    Heavy,
    Results,
    heavy_overhead,
    overhead,
)
from bench.vllm.overhead_report import (
    direct_step_ms,
    report_heavy,
    report_overhead,
    report_sustained,
)
from bench.vllm.served import serve_section
from bench.vllm.served_report import report_serve, report_serve_summary
from bench.vllm.server import VllmServe
from bench.vllm.serving import FULL, QUICK, Workload, serving_section
from bench.vllm.serving_report import report_serving, report_serving_summary
from testkit.driver import VLLM_PYTHON_ENV


# --- the options --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """What a run does: the options, with the defaults of a full or a quick run filled in."""

    quick: bool
    only: str
    out: Path
    python: str
    cache_dir: str | None
    rounds: int
    trials: int
    sizes: dict[int, int]
    heavy_rounds: int
    heavy_trials: int
    heavy_sizes: dict[int, int]
    kills: int
    serves: int
    freezes: int
    window: float
    serve_kills: int
    serve_freezes: int
    k8s_window: float
    workload: Workload

    @property
    def backend(self) -> bool:
        return self.only == "all" or "backend" in self.only.split(",")

    @property
    def served(self) -> bool:
        return self.only == "all" or "serve" in self.only.split(",")

    @property
    def serving(self) -> bool:
        return self.only == "all" or "serving" in self.only.split(",")


def _sections(text: str) -> str:
    names = [n.strip() for n in text.split(",")]
    if text == "all" or (names and set(names) <= {"backend", "serve", "serving"}):
        return ",".join(names)
    raise argparse.ArgumentTypeError(f"{text!r}: all, or a list of backend, serve, serving")


def parse(argv: list[str] | None) -> Plan:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 rounds, 1 kill, 1 cold start, 1 freeze, a 5 s window, not the "
                             "heavier model; "
                             "section 4: 1 kill and 1 freeze of each kind, a 30 s window; "
                             "section 5: 8 and 16 requests of 32 tokens in and out, 1 round")
    parser.add_argument("--only", type=_sections, default="all",
                        help="all sections (default), or a comma-separated list of: backend "
                             "(sections 1-3, `backend: vllm`), serve (section 4, `vllm serve` "
                             "as a command engine), serving (section 5, vLLM's serving "
                             "benchmark through the gateway and against `vllm serve`)")
    add_out_option(parser, "vllm")
    parser.add_argument("--rounds", type=int, default=None, help="overhead rounds (default 40)")
    parser.add_argument("--heavy-rounds", type=int, default=None,
                        help="section 1c rounds on the heavier model (default 12, --quick 0; "
                             "0 skips it)")
    parser.add_argument("--trials", type=int, default=None,
                        help="sustained-load trials per path (default 5, --quick 1)")
    parser.add_argument("-n", "--kills", type=int, default=None,
                        help="SIGKILLs of the engine (default 5)")
    parser.add_argument("--serves", type=int, default=None,
                        help="cold starts of vllm serve (default 3)")
    parser.add_argument("--freezes", type=int, default=None,
                        help="SIGSTOPs of the engine under engined (default 3)")
    parser.add_argument("--window", type=float, default=None,
                        help="seconds vllm serve's /health is polled with its EngineCore "
                             "stopped (default 30)")
    parser.add_argument("--serve-kills", type=int, default=None,
                        help="section 4: SIGKILLs of each kind, EngineCore and API server "
                             "(default 3, --quick 1)")
    parser.add_argument("--serve-freezes", type=int, default=None,
                        help="section 4: SIGSTOPs of each kind (default 3, --quick 1)")
    parser.add_argument("--k8s-window", type=float, default=None,
                        help="section 4: seconds the bare server's EngineCore stays stopped "
                             "under the k8s-style probe (default 60, --quick 30)")
    parser.add_argument("--serving-rounds", type=int, default=None,
                        help="section 5: rounds of every target at every concurrency (default "
                             f"{FULL.rounds}, --quick {QUICK.rounds})")
    parser.add_argument("--vllm-python", default=None,
                        help=f"the vLLM venv's interpreter (default ${VLLM_PYTHON_ENV}, else "
                             f"<repo>/.venv-vllm/bin/python)")
    parser.add_argument("--cache-dir", default=None,
                        help="ENGINED_CACHE_DIR for the model (default: a fresh temporary one)")
    args = parser.parse_args(argv)
    q = args.quick
    return Plan(
        quick=q, only=args.only, out=out_path(args, "vllm"),
        python=args.vllm_python or default_vllm_python(), cache_dir=args.cache_dir,
        rounds=args.rounds or (3 if q else 40), trials=args.trials or (1 if q else 5),
        sizes=SUSTAINED_REQUESTS_QUICK if q else SUSTAINED_REQUESTS,
        heavy_rounds=(args.heavy_rounds if args.heavy_rounds is not None else 0 if q else 12),
        heavy_trials=1 if q else 5,
        heavy_sizes=HEAVY_SUSTAINED_REQUESTS_QUICK if q else HEAVY_SUSTAINED_REQUESTS,
        kills=args.kills or (1 if q else 5), serves=args.serves or (1 if q else 3),
        freezes=args.freezes or (1 if q else 3), window=args.window or (5.0 if q else 30.0),
        serve_kills=args.serve_kills or (1 if q else 3),
        serve_freezes=args.serve_freezes or (1 if q else 3),
        k8s_window=args.k8s_window or (30.0 if q else 60.0),
        workload=Workload(QUICK.length if q else FULL.length,
                          QUICK.prompts if q else FULL.prompts,
                          args.serving_rounds or (QUICK.rounds if q else FULL.rounds)))


# --- sections 1-3 -------------------------------------------------------------------------------
@dataclass
class BackendRun:
    """What sections 1-3 measured."""

    bursts: Results
    sustained: Results
    dtypes: dict[str, str]
    crashes: list[dict] = field(default_factory=list)
    serves: list[dict] = field(default_factory=list)
    freezes: list[dict] = field(default_factory=list)
    heavy: Heavy | None = None


def measure_backend(plan: Plan, spec: dict[str, Any], checkpoint: Path, scratch: Path,
                    cache: Path, cleanup: Cleanup) -> BackendRun:
    tracker, python = cleanup.tracker, plan.python
    # Scenario 1: the direct worker builds while the daemon starts (both untimed).
    pythonpath = expose_engine_package(scratch / "python")
    worker = DirectWorker(python, spec, pythonpath, scratch / "direct.log", tracker)
    cleanup.started.append(worker)  # started by its constructor
    peer = VllmServe(python, checkpoint, scratch, tracker, "peer")
    peer.start()
    cleanup.started.append(peer)
    daemon = cleanup.start(BackendDaemon(spec, tracker))
    dtypes = {"direct": worker.wait_ready()["dtype"], "engined": daemon.engine()["dtype"]}
    peer.wait_health()
    bursts, sustained = asyncio.run(overhead(daemon, worker, peer, plan.rounds, plan.trials,
                                             plan.sizes))
    cleanup.stop(worker)  # its memory back before the next vLLM processes start
    cleanup.stop(peer)
    run = BackendRun(bursts, sustained, dtypes)

    # Scenario 2 (and `vllm serve`'s half of 3): engine kills and cold starts interleaved.
    for i in range(max(plan.kills, plan.serves)):
        if i < plan.kills:
            run.crashes.append(crash_to_ready(daemon))
        if i < plan.serves:
            run.serves.append(serve_run(python, checkpoint, scratch, tracker, i,
                                        plan.window if i == 0 else None))
    # Scenario 3: engined's half.
    run.freezes = [engined_freeze(daemon) for _ in range(plan.freezes)]
    cleanup.stop(daemon)  # its vLLM engine's memory back before section 4
    daemon.remove_dir()
    if plan.heavy_rounds:  # section 1c, on its own processes
        run.heavy = heavy_overhead(python, cache, scratch, pythonpath, cleanup, plan.heavy_rounds,
                                   plan.heavy_trials, plan.heavy_sizes)
    return run


# --- the run ------------------------------------------------------------------------------------
def header(r: Report, plan: Plan) -> None:
    r(title("engined vLLM benchmark", plan.quick)
      + ("" if plan.only == "all" else f" (--only {plan.only})"), "",
      *machine_lines(), engined_revision(),
      f"- vLLM interpreter: {plan.python} ({vllm_versions(plan.python)})",
      load_average("start"))
    if plan.backend:
        r(f"- overhead rounds: {plan.rounds} (on the heavier model: {plan.heavy_rounds}, and "
          f"{plan.heavy_trials} sustained trial(s)); "
          f"sustained-load trials: {plan.trials} "
          f"({', '.join(f'{n} requests at {c}' for c, n in plan.sizes.items())}); "
          f"engine kills: {plan.kills}; `vllm serve` cold starts: "
          f"{plan.serves}; freezes: {plan.freezes}, `vllm serve` window {plan.window:g} s")
    if plan.served:
        r(f"- `vllm serve` as a command engine (section 4): {plan.serve_kills} SIGKILL(s) and "
          f"{plan.serve_freezes} SIGSTOP(s) of each kind; the bare server's EngineCore stopped "
          f"for {plan.k8s_window:g} s under the k8s-style probe")
    if plan.serving:
        r(f"- vLLM's serving benchmark (section 5): {plan.workload.text()}")
    r("")


def main(argv: list[str] | None = None) -> int:
    plan = parse(argv)
    python = plan.python
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise SystemExit(f"no vLLM interpreter at {python} (--vllm-python, or set "
                         f"{VLLM_PYTHON_ENV}; see the README, \"Run vLLM under engined\")")

    r, tracker = Report(), Tracker()
    cleanup = Cleanup(tracker)
    scratch = cleanup.scratch("evb")
    cache = Path(plan.cache_dir or tempfile.mkdtemp(prefix="engined-bench-cache-"))
    if plan.cache_dir is None:
        cleanup.dirs.append(cache)
    backend: BackendRun | None = None
    serve_out: dict[str, Any] | None = None
    serving_out: dict[str, Any] | None = None
    try:
        header(r, plan)
        checkpoint = build_checkpoint(cache)  # untimed, exactly as an engine would on first use
        spec = engine_spec(python, cache)
        args_text = ", ".join(f"{k}: {v}" for k, v in spec["engine_args"].items())
        engine_text = (f"`backend: vllm`, `launcher: exec`, engine_args {{{args_text}}}, threads "
                       f"1, max_batch_size 8 (max_num_seqs), " if plan.backend or plan.served
                       else "")  # section 5 says its own
        r(f"- model: builtin:tiny-llama ({checkpoint.name}, random weights), {engine_text}"
          f"VLLM_CPU_KVCACHE_SPACE={VLLM_ENV['VLLM_CPU_KVCACHE_SPACE']}; daemon heartbeats "
          f"every {HEARTBEATS['heartbeat_interval']}, heartbeat_timeout "
          f"{HEARTBEATS['heartbeat_timeout']}, restarts immediate (backoff 0)", "")
        if plan.backend:
            backend = measure_backend(plan, spec, checkpoint, scratch, cache, cleanup)
        if plan.served:
            # Section 4: `vllm serve` under engined as a command engine.
            serve_out = serve_section(python, checkpoint, scratch, cleanup, plan.serve_kills,
                                      plan.serve_freezes, plan.k8s_window)
        if plan.serving:
            # Section 5: vLLM's serving benchmark, engined's gateway against `vllm serve`.
            serving_out = serving_section(python, checkpoint, cache, scratch, cleanup,
                                          plan.workload)
    finally:
        leftovers = cleanup.close()
    report(r, plan, backend, serve_out, serving_out, leftovers)
    r.write(plan.out)
    return 0  # a report, not a gate: the verdict is in the table


def report(r: Report, plan: Plan, backend: BackendRun | None, serve_out: dict[str, Any] | None,
           serving_out: dict[str, Any] | None, leftovers: list[int]) -> None:
    over = crash = serve_freeze_ = served_summary = None
    serves = backend.serves if backend is not None else []
    freezes = backend.freezes if backend is not None else []
    if backend is not None:
        over = report_overhead(r, backend.bursts, plan.rounds, backend.dtypes)
        over["sustained"] = report_sustained(r, backend.sustained, plan.trials, plan.sizes)
        if backend.heavy is not None:
            over["heavy"] = report_heavy(r, backend.heavy, plan.heavy_rounds, plan.heavy_trials,
                                         plan.heavy_sizes, direct_step_ms(backend.bursts, 8))
        crash = report_crash(r, backend.crashes, serves)
        serve_freeze_ = serves[0].get("freeze") if serves else None
        report_freeze(r, freezes, serve_freeze_, HEARTBEATS["heartbeat_timeout"])
    if serve_out is not None:
        served_summary = report_serve(r, serve_out, serves or None)
    serving = report_serving(r, serving_out) if serving_out is not None else None
    report_summary(r, over, crash, freezes, serve_freeze_, served_summary, serving)
    if plan.backend or plan.served:  # section 5 says how it ran `vllm serve`
        r(f"- `vllm serve` ran as `VLLM_PYTHON -m {SERVE_MODULE} --model DIR --host 127.0.0.1 "
          f"--port PORT {' '.join(SERVE_ARGS)}` (OMP_NUM_THREADS=1, VLLM_CPU_KVCACHE_SPACE="
          f"{VLLM_ENV['VLLM_CPU_KVCACHE_SPACE']}, offline, its own session, cwd a scratch dir)"
          + ("; in section 4 without `--disable-log-stats`, under engined as the command engine "
             "above and bare with the same argv" if plan.served else ""))
    r(f"{load_average('end')}; processes left over and killed by pid: {leftovers or 'none'}")


# --- the summary --------------------------------------------------------------------------------
def report_summary(r: Report, over: dict | None, crash: dict[str, float] | None,
                   freezes: list[dict], serve_freeze_: dict | None,
                   served: dict[str, Any] | None = None,
                   serving: list[dict[str, Any]] | None = None) -> None:
    r("## Summary", "", *table("target / measure", "engined", "baseline", "result"))
    if over is not None and crash is not None:
        report_backend_summary(r, over, crash, freezes, serve_freeze_)
    if served is not None:
        report_serve_summary(r, served)
    if serving is not None:
        report_serving_summary(r, serving)
    r("")


def report_backend_summary(r: Report, over: dict, crash: dict[str, float], freezes: list[dict],
                           serve_freeze_: dict | None) -> None:
    models = [(over, "tiny-llama")]
    if (heavy := over.get("heavy")) is not None:
        models.append((heavy, f"heavier model ({heavy['step_ms']:.1f} ms steps)"))
    def by_tokens(d: dict[tuple[str, int], float]) -> list[tuple[tuple[str, int], float]]:
        return sorted(d.items(), key=lambda kv: (kv[0][1], kv[0][0]))

    for section, model in models:
        sustained = section["sustained"]
        for (path, m), loss in by_tokens(sustained["verdicts"]):
            verdict = ("PASS" if loss > -OVERHEAD_TARGET_PCT
                       else f"MISS by {-loss - OVERHEAD_TARGET_PCT:.1f} points")
            r(f"| throughput at 8 concurrent (sustained) within {OVERHEAD_TARGET_PCT:g} % of "
              f"direct, {model}, max_tokens {m}, {PATH_LABELS[path].removeprefix('engined: ')} "
              f"| {signed_pct(loss)} | direct LLMEngine | {verdict} |")
        for (path, m), own in by_tokens(sustained["floor"]):
            r(f"| engined's own cost: throughput at 8 concurrent (sustained) vs the floor's, "
              f"{model}, max_tokens {m}, {PATH_LABELS[path].removeprefix('engined: ')} "
              f"| {signed_pct(own)} | the floor (minimal HTTP server, same process as the "
              f"engine) | report only |")
    for section, model in models:
        for (path, m), value in by_tokens(section["verdicts"]):
            verdict = ("PASS" if value < OVERHEAD_TARGET_PCT
                       else f"MISS by {value - OVERHEAD_TARGET_PCT:.1f} points")
            r(f"| overhead at 8 concurrent < {OVERHEAD_TARGET_PCT:g} % (bursts: round time), "
              f"{model}, max_tokens {m}, {PATH_LABELS[path].removeprefix('engined: ')} | "
              f"{signed_pct(value)} | direct LLMEngine | {verdict} |")
        for (path, m), own in by_tokens(section["floor"]):
            r(f"| engined's own cost: bursts at 8 concurrent, round time vs the floor's, "
              f"{model}, max_tokens {m}, {PATH_LABELS[path].removeprefix('engined: ')} | "
              f"{signed_pct(own)} | the floor (minimal HTTP server, same process as the "
              f"engine) | report only |")
    r(f"| crash → READY vs `vllm serve` cold start to `/health` 200 | {crash['crash']:.2f} s | "
      f"{crash['cold']:.2f} s | report only: {crash['cold'] / crash['crash']:.2f}× |")
    if crash["outer"] == crash["outer"]:
        r(f"| … with `vllm serve`'s own exit after an EngineCore SIGKILL | {crash['crash']:.2f} s "
          f"| {crash['outer']:.2f} s | report only: {crash['outer'] / crash['crash']:.2f}× |")
    detect = med(f["detect_s"] for f in freezes)
    base = ("–" if serve_freeze_ is None else
            f"{serve_freeze_['first_bad_s']:.2f} s" if serve_freeze_["first_bad_s"] is not None
            else f"never within {serve_freeze_['window_s']:g} s")
    r(f"| frozen core (SIGSTOP) detected | {sec(detect)} | `/health`: {base} | report only |")


if __name__ == "__main__":
    sys.exit(main())
