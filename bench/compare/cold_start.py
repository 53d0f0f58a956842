"""Scenario 5: crash → READY of one tiny-llama replica (`launcher: exec`: every restart a cold
start) against the cold-start floor, a fresh `python -c` that imports, loads and generates once:
bench/llm.py's functions and daemon.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench import llm
from bench.common import Cleanup
from bench.models import build_checkpoint
from bench.report import Report, dist_row, med, table


def cold_start_scenario(cleanup: Cleanup, llm_n: int) -> dict:
    """`llm_n` crashes of the replica and as many cold starts, interleaved."""
    tracker = cleanup.tracker
    res: dict = {}
    if llm_n:
        cache = Path(tempfile.mkdtemp(prefix="engined-bench-cache-"))
        cleanup.dirs.append(cache)
        checkpoint = build_checkpoint(cache)
        ld = cleanup.start(llm.Daemon(cache, tracker))
        crashes, colds = [], []
        for _ in range(llm_n):
            crashes.append(llm.crash_to_ready(ld))
            colds.append(llm.cold_start(checkpoint, cache, tracker))
        cleanup.stop(ld)
        ld.remove_dir()
        res.update(crashes=crashes, colds=colds)
    return res


def report_cold_start(r: Report, res: dict) -> None:
    if "crashes" in res:
        cr, co = res["crashes"], res["colds"]

        def srow(label: str, vals: list[float]) -> str:
            return dist_row(label, vals, 3, sep=" – ")
        crash, cold = med([c["ready_s"] for c in cr]), med([c["generated_s"] for c in co])
        r("## 5. Crash → READY for a tiny-llama replica vs the cold-start floor", "",
          *table("measure", "median", "min – max", "n"),
          srow("engined: SIGKILL → READY (`since`)", [c["ready_s"] for c in cr]),
          srow("… of which spawn → READY (`startup_s`)", [c["startup_s"] for c in cr]),
          srow("cold `python -c`: spawn → imports, `from_pretrained`, first generate done",
               [c["generated_s"] for c in co]),
          srow("… of which interpreter + `import torch, transformers`",
               [c["import_s"] for c in co]), "",
          f"engined's crash → READY is {crash - cold:+.3f} s ({100 * (crash / cold - 1):+.1f} %) "
          "against a fresh interpreter that only loads and generates (bench/llm.py's functions "
          "and daemon, whose replica runs with `launcher: exec`: every restart a cold start; "
          "CPU, 1 thread). The peers would take their respawn latency plus the same cold start, "
          "and could not tell when the replica is ready. engined's default launcher, the fork "
          "server, is measured against exec by `python -m bench.recovery`.", "")
    else:
        r("## 5. Crash → READY for a tiny-llama replica", "", "skipped (--llm-n 0)", "")

