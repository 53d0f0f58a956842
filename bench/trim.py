"""Memory given back: an engine's resident memory after long bursts, with the heap trimmed when a
burst ends (engine.memory.trim, glibc's malloc_trim(0)) and without (ENGINE_MALLOC_TRIM=0).

    python -m bench.trim [--quick] [--bursts N] [--out FILE]   # default bench/results/trim.md

One daemon serves two `builtin:tiny-llama` engines side by side (transformers, CPU, one thread,
max_batch_size 8, the gateway on a free loopback port), `trim` as shipped and `notrim` with
ENGINE_MALLOC_TRIM=0 in its environment. Each burst sends 32 requests of a long prompt with
max_tokens 200 (greedy) to one engine, then the same to the other; after each burst and a
second of quiet, the bench reads each engine's RSS (`/proc/PID/status` VmRSS, by the engine's
pid from status). Reported: RSS once loaded, after the first burst, after the last, and the
peak, per engine, and the difference. Nothing is asserted about speed or size; a report.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import tempfile
import time
from pathlib import Path

import openai

from bench.common import BenchDaemon, Cleanup, Tracker
from bench.models import build_checkpoint
from bench.report import (
    Report,
    add_out_option,
    engined_revision,
    load_average,
    machine_lines,
    num,
    out_path,
    table,
    title,
)
from testkit.driver import free_port

MiB = 1 << 20
ENGINES = ("trim", "notrim")
PROMPT = "the quick brown fox jumps over the lazy dog " * 12


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def burst(client: openai.OpenAI, model: str, size: int) -> None:
    def one(i: int) -> None:
        client.completions.create(model=model, prompt=f"{i}: {PROMPT}", max_tokens=200,
                                  temperature=0)
    with concurrent.futures.ThreadPoolExecutor(size) as pool:
        list(pool.map(one, range(size)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trim",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 bursts of 16")
    parser.add_argument("--bursts", type=int, default=None, help="bursts (default 8)")
    add_out_option(parser, "trim")
    args = parser.parse_args(argv)
    bursts = args.bursts or (2 if args.quick else 8)
    size = 16 if args.quick else 32
    r, tracker = Report(), Tracker()
    cleanup = Cleanup(tracker)
    cache = Path(tempfile.mkdtemp(prefix="engined-bench-cache-"))
    cleanup.dirs.append(cache)
    seen: dict[str, list[int]] = {name: [] for name in ENGINES}
    try:
        r(title("engined memory given back: RSS after bursts, heap trimmed or not", args.quick),
          "", *machine_lines(), engined_revision(), load_average("start"))
        checkpoint = build_checkpoint(cache)
        port = free_port()
        engines = [{"name": name, "model": "builtin:tiny-llama", "launcher": "exec",
                    "max_batch_size": 8, "threads": 1, "stall_timeout": "120s",
                    "env": {"ENGINED_CACHE_DIR": str(cache),
                            **({"ENGINE_MALLOC_TRIM": "0"} if name == "notrim" else {})}}
                   for name in ENGINES]
        d = cleanup.start(BenchDaemon("et", tracker, engines,
                                      supervisor={"gateway": f"127.0.0.1:{port}"}), 300.0)
        pids = {name: d.engine(f"{name}-0")["pid"] for name in ENGINES}
        time.sleep(1.0)
        loaded = {name: rss(pid) for name, pid in pids.items()}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=600)
        for i in range(bursts):
            for name in ENGINES:
                burst(client, name, size)
            time.sleep(1.0)
            for name, pid in pids.items():
                seen[name].append(rss(pid))
            print(f"(burst {i + 1}: " + ", ".join(f"{n} {seen[n][-1] / MiB:.1f} MiB"
                                                 for n in ENGINES) + ")", file=sys.stderr)
        r(f"- engines: 2 × builtin:tiny-llama ({checkpoint.name}), transformers, CPU, threads 1, "
          f"max_batch_size 8, launcher exec; `notrim` has ENGINE_MALLOC_TRIM=0",
          f"- load: {bursts} bursts of {size} requests (a {len(PROMPT.split())}-word prompt, "
          f"max_tokens 200, greedy) to each engine in turn; RSS read 1 s after each burst", "",
          *table("RSS (VmRSS)", "trim (shipped)", "notrim", "trim − notrim"))
        rows = [("once loaded", loaded["trim"], loaded["notrim"]),
                ("after the first burst", seen["trim"][0], seen["notrim"][0]),
                ("after the last burst", seen["trim"][-1], seen["notrim"][-1]),
                ("largest after a burst", max(seen["trim"]), max(seen["notrim"]))]
        for label, a, b in rows:
            r(f"| {label} | {num(a / MiB, 1, 'MiB')} | {num(b / MiB, 1, 'MiB')} | "
              f"{num((a - b) / MiB, 1, 'MiB')} |")
        r("")
    finally:
        leftovers = cleanup.close()
    return r.finish(leftovers, out_path(args, "trim"))


if __name__ == "__main__":
    sys.exit(main())
