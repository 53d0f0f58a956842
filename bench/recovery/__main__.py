"""Fast recovery: engines forked from a preloaded fork server against engines started by exec.

    python -m bench.recovery [--quick] [--out FILE] [-n KILLS] [--vllm-python PATH]

The run: the options and the vLLM interpreter (without one, the vLLM part is skipped and the
report says so), tiny-llama then the vLLM backend (bench/recovery/run.py), then the report
(bench/recovery/tables.py). The sections are described in bench/recovery/__init__.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import psutil

from bench.common import HEARTBEATS, BenchError, Cleanup, Tracker
from bench.models import build_checkpoint
from bench.recovery.daemon import REPLICAS, tiny_backend, vllm_backend, warm_vllm_imports
from bench.recovery.run import Run, run_backend
from bench.recovery.tables import (
    report_crash,
    report_memory,
    report_standby,
    report_startup,
    report_summary,
)
from bench.report import (
    Report,
    add_out_option,
    cpu_busy_pct,
    engined_revision,
    load_average,
    machine_lines,
    out_path,
    title,
)
from bench.vllm.engine import default_vllm_python, vllm_versions
from testkit.driver import VLLM_PYTHON_ENV


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 tiny-llama kills per launcher, 1 vLLM kill (if its interpreter "
                             "exists)")
    add_out_option(parser, "recovery")
    parser.add_argument("-n", type=int, default=None,
                        help="kills per launcher per backend (default 5; --quick: 2 tiny-llama, "
                             "1 vLLM)")
    parser.add_argument("--vllm-python", default=None,
                        help=f"the vLLM venv's interpreter (default ${VLLM_PYTHON_ENV}, else "
                             f"<repo>/.venv-vllm/bin/python)")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM backend")
    parser.add_argument("--cache-dir", default=None,
                        help="ENGINED_CACHE_DIR for the model (default: a fresh temporary one)")
    args = parser.parse_args(argv)
    n_tiny = args.n or (2 if args.quick else 5)
    n_vllm = args.n or (1 if args.quick else 5)
    out = out_path(args, "recovery")

    python = args.vllm_python or default_vllm_python()
    skipped: str | None = None
    versions = ""
    if args.no_vllm:
        skipped = "--no-vllm"
    elif not (os.path.isfile(python) and os.access(python, os.X_OK)):
        skipped = (f"no vLLM interpreter at {python} (--vllm-python, or set "
                   f"{VLLM_PYTHON_ENV})")
    else:
        try:
            versions = vllm_versions(python)
        except BenchError as exc:
            skipped = f"the vLLM interpreter does not run: {str(exc)[:200]}"

    r, tracker = Report(), Tracker()
    cleanup = Cleanup(tracker)
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="engined-bench-cache-"))
    if args.cache_dir is None:
        cleanup.dirs.append(cache)
    runs: list[Run] = []
    cpu_start = psutil.cpu_times()
    try:
        r(title("engined fast-recovery benchmark: fork server vs exec", args.quick), "",
          *machine_lines(), engined_revision(), load_average("start"),
          f"- kills per launcher: tiny-llama {n_tiny}"
          + (f", vLLM {n_vllm}" if skipped is None else "")
          + f"; {REPLICAS} replicas per daemon; heartbeats every "
          f"{HEARTBEATS['heartbeat_interval']}, restarts immediate (backoff 0)")
        checkpoint = build_checkpoint(cache)  # untimed, exactly as an engine would on first use
        r(f"- tiny-llama: torch {version('torch')}, transformers {version('transformers')}; "
          f"builtin:tiny-llama ({checkpoint.name}), float32, CPU, threads 1, max_batch_size 8")
        if skipped is None:
            r(f"- vLLM backend: {python} ({versions}); the same checkpoint, engine_args "
              f"{{enforce_eager: true, max_model_len: 1024}}, VLLM_CPU_KVCACHE_SPACE=1, "
              f"threads 1, max_batch_size 8")
        else:
            r(f"- vLLM backend: **skipped**: {skipped}")
        r("")
        runs.append(run_backend(tiny_backend(cache), n_tiny, cleanup, tracker))
        if skipped is None:
            warm_s = warm_vllm_imports(python)
            print(f"(page cache warmed: `import vllm` took {warm_s:.1f} s, untimed)",
                  file=sys.stderr, flush=True)
            runs.append(run_backend(vllm_backend(python, cache), n_vllm, cleanup, tracker))
    finally:
        leftovers = cleanup.close()

    busy = cpu_busy_pct(cpu_start)
    pids = ", ".join(f"{run.backend.key} {kind} {pid}" for run in runs
                     for kind, pid in run.daemon_pids.items())
    report_crash(r, runs, skipped)
    totals = report_memory(r, runs, skipped)
    report_startup(r, runs, skipped)
    report_standby(r, runs, skipped)
    report_summary(r, runs, skipped, totals)
    notes = [f"{run.backend.label} {x}: {d.stop_note}" for run in runs
             for x, d in run.daemons.items() if d.stop_note]
    r(f"- daemon pids: {pids}",
      f"{load_average('end')}; all CPUs {busy:.0f} % busy "
      f"during the run; processes left over and killed by pid: {leftovers or 'none'}"
      + (f"; {'; '.join(notes)}" if notes else ""))
    r.write(out)
    return 0  # a report, not a gate: the verdicts are in the summary


if __name__ == "__main__":
    sys.exit(main())
