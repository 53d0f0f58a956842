"""vLLM benchmark: vLLM under engined against the same engine driven directly and against
`vllm serve`, in one run.

    python -m bench.vllm [--quick] [--trials N] [--serving-rounds N] [--vllm-python PATH]

The run: the model built (untimed); the direct worker, `vllm serve` alone and engined (its
`backend: vllm` engine and `vllm serve` as a command engine, behind its gateway) started at once,
untimed; section 1 (bench/vllm/direct.py), then section 2 (serving.py); the tables and the
summary of the targets.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from bench.common import Cleanup, Tracker, build_checkpoint, expose_engine_package
from bench.report import Report, add_out_option, out_path, signed_pct, table
from bench.vllm.direct import TARGET_PCT, DirectWorker, report_direct, sustained
from bench.vllm.engine import (
    GROUP,
    SEQS,
    SERVED,
    Daemon,
    VllmServe,
    default_vllm_python,
    engine_spec,
    vllm_versions,
    warm,
)
from bench.vllm.serving import FULL, QUICK, Workload, serving
from bench.vllm.serving_report import report_serving, report_serving_summary
from testkit.driver import VLLM_PYTHON_ENV

PROG = "python -m bench.vllm"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 sustained trial of 4 and 16 requests; vLLM's serving benchmark "
                        "with 8 and 16 requests of 32 tokens, 1 round")
    parser.add_argument("--trials", type=int, default=None,
                        help="section 1: sustained-load trials per path (default 5)")
    parser.add_argument("--serving-rounds", type=int, default=None,
                        help=f"section 2: rounds of every target at every concurrency (default "
                        f"{FULL.rounds})")
    parser.add_argument("--vllm-python", default=None,
                        help=f"the vLLM venv's interpreter (default ${VLLM_PYTHON_ENV}, else "
                        "<repo>/.venv-vllm/bin/python)")
    add_out_option(parser, "vllm")
    args = parser.parse_args(argv)
    python = args.vllm_python or default_vllm_python()
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise SystemExit(f"no vLLM interpreter at {python} (--vllm-python, or set "
                         f"{VLLM_PYTHON_ENV})")
    trials = args.trials or (1 if args.quick else 5)
    sizes = {1: 4, 8: 16} if args.quick else {1: 24, 8: 96}
    base = QUICK if args.quick else FULL
    workload = Workload(base.length, base.prompts, args.serving_rounds or base.rounds)

    r, tracker = Report(), Tracker()
    cleanup = Cleanup(tracker)
    scratch = cleanup.scratch("evb")
    r.header("engined vLLM benchmark", args.quick, PROG,
             f"- vLLM interpreter: {python} ({vllm_versions(python)})",
             f"- section 1: {trials} sustained trial(s) per path "
             f"({', '.join(f'{n} requests at {c}' for c, n in sizes.items())}); section 2: "
             f"{workload.text()}")
    try:
        checkpoint = build_checkpoint(scratch / "cache")  # untimed, as an engine would
        backend = {**engine_spec(python, scratch / "cache"), "max_batch_size": SEQS}
        worker = cleanup.start(DirectWorker(backend, expose_engine_package(scratch / "python"),
                                            scratch, tracker))
        bare = cleanup.start(VllmServe(python, checkpoint, scratch, tracker))
        daemon = cleanup.start(Daemon(backend, checkpoint, scratch, tracker))
        dtypes = {"direct": worker.wait_ready()["dtype"], "engined": daemon.engine()["dtype"]}
        bare.wait_health()
        for port, model in ((daemon.gateway_port, GROUP), (daemon.gateway_port, SERVED),
                            (bare.port, str(checkpoint))):
            warm(port, model)
        res = asyncio.run(sustained(worker, daemon.gateway_port, trials, sizes))
        cleanup.stop(worker)  # its memory and CPU back before section 2
        served = serving(python, checkpoint, scratch, bare, daemon, workload)
    finally:
        leftovers = cleanup.close()
    spec_text = ", ".join(f"{k}: {v}" for k, v in backend["engine_args"].items())
    r(f"- model: builtin:tiny-llama ({checkpoint.name}, random weights, {dtypes['engined']}; "
      f"direct: {dtypes['direct']}); engined's engine: `backend: vllm`, engine_args "
      f"{{{spec_text}}}, threads 1, max_batch_size {SEQS} (max_num_seqs), "
      f"VLLM_CPU_KVCACHE_SPACE=1", "")
    verdicts = report_direct(r, res, trials, sizes)
    summary = report_serving(r, served)
    report_summary(r, verdicts, summary)
    return r.finish(leftovers, out_path(args, "vllm"))


def report_summary(r: Report, verdicts: list[tuple[float, str]],
                   serving_verdicts: list[dict[str, Any]]) -> None:
    r("## Summary", "", *table("target", "engined", "baseline", "result"))
    for loss, verdict in verdicts:
        r(f"| throughput at 8 concurrent (sustained) within {TARGET_PCT:g} % of direct | "
          f"{signed_pct(loss)} | the same `LLMEngine` driven directly | {verdict} |")
    report_serving_summary(r, serving_verdicts)
    r("")


if __name__ == "__main__":
    sys.exit(main())
