"""Section 2: vLLM's own serving benchmark (`vllm.benchmarks.serve`, what `vllm bench serve`
runs) against three servers of the same tiny-llama, all up at once, one measured at a time:
`vllm serve` alone, engined's gateway in front of a `backend: vllm` engine, and engined's gateway
in front of that same `vllm serve` as a command engine. Random prompts, fixed input and output
lengths (`--ignore-eos`), greedy, 8 and 32 requests in flight; vLLM's figures are read from its
`--save-result` JSON. Reported by bench/vllm/serving_report.py.

The client is one process under the vLLM interpreter (`CLIENT`: vLLM's `add_cli_args` and
`main`, as tests/vllm drives it; the CPU wheel's `vllm` command cannot read its own version) that
runs every measurement in turn, so vLLM is imported once and never during a run. Each run starts
SETTLE_S after the previous one, with vLLM's own warm-up (`--num-warmups C`), then the measured
requests. The order (`schedule`): every permutation of the three targets, one per round, so that
over six rounds each runs in every position and after each other target equally often.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench.common import BenchError
from bench.vllm.engine import GROUP, SERVED, Daemon, VllmServe, serve_env

CONCURRENCY = (8, 32)
TARGETS = ("serve", "backend", "command")
ORDERS = list(itertools.permutations(TARGETS))
SETTLE_S = 3.0  # the pause before each run, untimed: the previous target's processes go idle
# vLLM's serving benchmark, as every run calls it (the capitals are the run's values); the seed
# is the run's place in the schedule: every target gets the same prompts at the same round and
# concurrency, and no run meets prompts an earlier one left in a server's prefix cache
CLIENT_FLAGS = ["--backend", "openai", "--endpoint", "/v1/completions", "--base-url", "URL",
                "--model", "MODEL", "--tokenizer", "MODEL_DIR", "--dataset-name", "random",
                "--random-input-len", "L", "--random-output-len", "L", "--ignore-eos",
                "--temperature", "0", "--num-prompts", "N", "--max-concurrency", "C",
                "--num-warmups", "C", "--seed", "SEED", "--disable-tqdm", "--save-result",
                "--save-detailed", "--result-dir", "DIR", "--result-filename", "NAME.json"]
DIGEST = {  # what a run keeps of vLLM's result JSON
    "completed": "completed", "failed": "failed", "input_tokens": "total_input_tokens",
    "request_throughput": "request_throughput", "output_throughput": "output_throughput",
    "median_ttft_ms": "median_ttft_ms", "p99_ttft_ms": "p99_ttft_ms",
    "median_tpot_ms": "median_tpot_ms", "median_itl_ms": "median_itl_ms"}
# The client: one process, every run in turn ({runs: [{name, argv}], settle_s}); per run a RUN line
# with its wall times, how busy the machine's CPUs were, how much of that was not the bench's own
# process tree (the load others put on a shared machine).
CLIENT = """
import json, os, sys, time, traceback
import psutil
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

plan = json.load(open(sys.argv[1]))

def ours():
    root = psutil.Process(os.getppid())
    cpu = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            cpu[(p.pid, p.create_time())] = t.user + t.system
        except psutil.Error:
            pass
    return cpu

def busy_s(t):
    return sum(t) - t.idle - t.iowait

for run in plan["runs"]:
    time.sleep(plan["settle_s"])
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(run["argv"])
    print("BEGIN " + run["name"], flush=True)
    own0, cpu0, t0, error = ours(), psutil.cpu_times(), time.time(), None
    try:
        main(args)
    except BaseException as exc:
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()[-2000:]
    cpu1, own1, t1 = psutil.cpu_times(), ours(), time.time()
    total = sum(cpu1) - sum(cpu0)
    busy = busy_s(cpu1) - busy_s(cpu0)
    own = sum(v - own0.get(k, 0.0) for k, v in own1.items())
    line = {"name": run["name"], "t0": t0, "t1": t1, "error": error,
            "cpu_busy_pct": 100.0 * busy / max(total, 1e-9),
            "others_pct": 100.0 * max(0.0, busy - own) / max(total, 1e-9)}
    print("RUN " + json.dumps(line), flush=True)
"""


@dataclass(frozen=True)
class Workload:
    """What each target is sent: `length` tokens in and out, `prompts[c]` requests at
    concurrency c, `rounds` times."""

    length: int
    prompts: dict[int, int]
    rounds: int

    def text(self) -> str:
        return (f"random prompts, {self.length} tokens in and {self.length} out (`--ignore-eos`), "
                f"greedy; " + ", ".join(f"{n} requests at {c} concurrent"
                                        for c, n in self.prompts.items())
                + f"; {self.rounds} round(s)")


# six rounds (every order of the targets once): the runs are short (3-13 s here), and on 2 cores
# one run of the same server can be twice as fast as the next (see the README), so a median needs
# several
FULL = Workload(128, {8: 64, 32: 128}, 6)
QUICK = Workload(32, {8: 8, 32: 16}, 1)


@dataclass(frozen=True)
class Target:
    """One server under test: where the client sends its requests and the model name it uses."""

    key: str
    url: str
    model: str


def client_argv(target: Target, tokenizer: Path, c: int, n: int, length: int, seed: int,
                result_dir: Path, name: str) -> list[str]:
    """CLIENT_FLAGS with the run's values in place of the placeholders."""
    values = {"URL": target.url, "MODEL": target.model, "MODEL_DIR": str(tokenizer),
              "L": str(length), "N": str(n), "C": str(c), "SEED": str(seed),
              "DIR": str(result_dir), "NAME.json": f"{name}.json"}
    return [values.get(flag, flag) for flag in CLIENT_FLAGS]


def schedule(workload: Workload) -> list[tuple[int, int, int, str]]:
    """(round, concurrency, position, target) in the order they run: round r at the k-th
    concurrency runs the targets in ORDERS[(r + 3k) mod 6]."""
    runs = []
    for r in range(workload.rounds):
        for k, c in enumerate(workload.prompts):
            order = ORDERS[(r + 3 * k) % len(ORDERS)]
            runs.extend((r, c, pos, key) for pos, key in enumerate(order))
    return runs


def digest(result: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """What the report needs of one run: vLLM's figures, its distinct errors with their count,
    the run's wall time and CPU load."""
    out = {k: result.get(v) for k, v in DIGEST.items()}
    errors: dict[str, int] = {}
    for e in result.get("errors") or []:
        if e:
            key = e.strip().splitlines()[-1][:300] if e.strip() else e
            errors[key] = errors.get(key, 0) + 1
    out["errors"] = errors
    out["output_lens"] = sorted(set(result.get("output_lens") or []))
    # each request's text (in the order of the prompts), hashed: greedy on the same model and
    # prompts, every target should write the same
    out["texts"] = [hashlib.sha1(t.encode()).hexdigest()[:16] if ok else None
                    for t, ok in zip(result.get("generated_texts") or [],
                                     [not e for e in result.get("errors") or []])]
    out["wall_s"] = run["t1"] - run["t0"]
    out["cpu_busy_pct"] = run["cpu_busy_pct"]
    out["others_pct"] = run["others_pct"]
    return out


def run_client(python: str, runs: list[dict[str, Any]], scratch: Path, timeout_s: float
               ) -> list[dict[str, Any]]:
    plan = scratch / "serving-runs.json"
    plan.write_text(json.dumps({"runs": runs, "settle_s": SETTLE_S}))
    log = scratch / "serving-client.log"
    env = {**serve_env(), "TMPDIR": str(scratch)}
    try:
        done = subprocess.run([python, "-c", CLIENT, str(plan)], cwd=scratch, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"vLLM's serving benchmark did not end within {timeout_s:g} s: "
                         f"{str(exc.stdout or '')[-3000:]}") from None
    log.write_text(done.stdout + done.stderr)
    lines = [json.loads(x[4:]) for x in done.stdout.splitlines() if x.startswith("RUN ")]
    if done.returncode != 0 or len(lines) != len(runs):
        raise BenchError(f"vLLM's serving benchmark exited with {done.returncode} after "
                         f"{len(lines)} of {len(runs)} runs:\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    return lines


def processes(pid: int, tree: bool = True) -> list[str]:
    """`NAME (CPUs LIST)` of a process and its descendants: what runs where."""
    out = []
    root = psutil.Process(pid)
    for p in [root, *(root.children(recursive=True) if tree else [])]:
        try:
            name = p.name()
            if "resource_tracker" in " ".join(p.cmdline()):
                continue  # multiprocessing's helper
            out.append(f"{name} (CPUs {','.join(map(str, p.cpu_affinity()))})")
        except psutil.Error:
            pass
    return out


def serving(python: str, checkpoint: Path, scratch: Path, bare: VllmServe, daemon: Daemon,
            workload: Workload) -> dict[str, Any]:
    """vLLM's client runs the schedule against the three targets, which are up (and stay up,
    idle, through each other's runs)."""
    began = time.monotonic()
    restarts0 = {e["name"]: e["restarts"] for e in daemon.status()["engines"]}
    gateway = f"http://127.0.0.1:{daemon.gateway_port}"
    targets = {"serve": Target("serve", f"http://127.0.0.1:{bare.port}", str(checkpoint)),
               "backend": Target("backend", gateway, GROUP),
               "command": Target("command", gateway, SERVED)}
    served_pid = daemon.engine(f"{SERVED}-0")["pid"]
    engine_pid = daemon.engine(f"{GROUP}-0")["pid"]
    for p in psutil.Process(served_pid).children(recursive=True):
        daemon.tracker.add(p.pid)
    assert bare.proc is not None
    bare.track()
    layout = {"serve": processes(bare.proc.pid), "backend": processes(engine_pid),
              "command": processes(served_pid), "daemon": processes(daemon.pid, False)}
    result_dir = scratch / "serving-results"
    runs, keys = [], []
    for r, c, pos, key in schedule(workload):
        name = f"r{r}-c{c}-{key}"
        seed = 1 + r * len(workload.prompts) + list(workload.prompts).index(c)
        runs.append({"name": name, "argv": client_argv(targets[key], checkpoint, c,
                                                        workload.prompts[c], workload.length,
                                                        seed, result_dir, name)})
        keys.append((r, c, pos, key))
    # a bound, generous: 30 s per 128-token request wave, plus the pauses and 10 min
    bound = (600.0 + SETTLE_S * len(runs) + 30.0 * sum(workload.prompts.values())
             * workload.rounds * len(TARGETS) * workload.length / 128)
    t0 = time.time()
    lines = run_client(python, runs, scratch, bound)
    client_s = time.time() - t0
    measured = []
    for (r, c, pos, key), run, line in zip(keys, runs, lines):
        if line["error"]:
            raise BenchError(f"vLLM's serving benchmark, run {run['name']}: {line['error']}")
        result = json.loads((result_dir / f"{run['name']}.json").read_text())
        measured.append({"round": r, "concurrency": c, "position": pos, "target": key,
                         **digest(result, line)})
    # nothing restarted under engined, the bare server still up: every run met the same server
    engines = daemon.status()["engines"]
    restarts = {e["name"]: (e["restarts"] - restarts0[e["name"]], e["restarts_by_reason"],
                            ((e["last_exit"] or {}).get("log_tail") or [""])[-1][:300])
                for e in engines if e["restarts"]}
    return {"workload": workload, "runs": measured, "layout": layout, "client_s": client_s,
            "section_s": time.monotonic() - began, "restarts": restarts,
            "serve_alive": bare.alive()}
