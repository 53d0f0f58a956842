"""Cluster gateway benchmark: three nodes on real separate hosts, a cluster gateway in front.

    python -m bench.cluster [--quick] [--out FILE]   # default bench/results/cluster.md
                                                     # (--quick: cluster-quick.md)

The hosts are network namespaces (as root; testkit/clusternet.py): each node in one of its own,
joined by a veth pair to the cluster gateway's, which this one reaches by another; the nodes'
name resolves through the gateway's hosts file. Each node is a real engined whose engine is
testkit/commandserver.py as an `openai: vllm` command engine (its next token is a function of the
whole sequence: the expected text of every request is known exactly).

1. The extra hop: streamed completions, one at a time, alternating between the cluster gateway
   and a node's gateway directly (the same path through the gateway's namespace, forwarded):
   time to the first token and to the last.
2. Faults under load: streamed requests, several at a time, through the cluster gateway; a
   third of the way in one node is SIGKILLed (its daemon and engines), two thirds in another
   node's link is cut (no FIN, no RST: silence). Every answer is compared with the oracle's;
   each stream's longest pause between two chunks says how long a move took.

Prints markdown tables and writes them to --out. Every process is stopped by pid.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import openai

from bench.report import Report, add_out_option, dist_row, out_path, table
from testkit.clusternet import (
    Cluster,
    Hosts,
    cluster_spec,
    expected,
    kill_node,
    metric,
    netns_problem,
)

PORT, HTTP = 8000, 9400  # every node's gateway and metrics, each on its own address
TICK = "0.01"  # seconds per token of the nodes' engines
HOP_TOKENS, LOAD_TOKENS = 32, 64
FAULT_WAIT_S = 10.0  # the most a fault waits for half the streams to be mid-way


@dataclass(eq=False)
class Stream:
    """One streamed request as the client saw it."""

    prompt: str
    started: float = 0.0
    chunks: list[float] = field(default_factory=list)  # monotonic time of each chunk
    text: str = ""
    error: str = ""

    def first_s(self) -> float | None:
        return self.chunks[0] - self.started if self.chunks else None

    def total_s(self) -> float | None:
        return self.chunks[-1] - self.started if self.chunks else None

    def longest_gap(self) -> tuple[float, float]:
        """(when it began, how long) of the longest wait between two chunks."""
        gaps = [(a, b - a) for a, b in zip(self.chunks, self.chunks[1:])]
        return max(gaps, key=lambda g: g[1]) if gaps else (0.0, 0.0)


def stream(client: openai.OpenAI, prompt: str, tokens: int,
           live: set[Stream] | None = None) -> Stream:
    """One streamed completion; `live`: the streams past their first chunk and not done."""
    s = Stream(prompt, time.monotonic())
    try:
        for chunk in client.completions.create(model="fake", prompt=prompt, max_tokens=tokens,
                                               stream=True):
            s.chunks.append(time.monotonic())
            s.text += "".join(c.text for c in chunk.choices)
            if live is not None and len(s.chunks) == 1:
                live.add(s)
    except openai.OpenAIError as exc:
        s.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        if live is not None:
            live.discard(s)
    return s


def hop(cluster: openai.OpenAI, direct: openai.OpenAI, n: int) -> dict[str, list[Stream]]:
    """Section 1: alternating, so a change in the box's load hits both alike."""
    out: dict[str, list[Stream]] = {"cluster": [], "direct": []}
    for i in range(n + 2):  # the first two of each warm the connections up, not counted
        for name, client in (("direct", direct), ("cluster", cluster)):
            s = stream(client, f"hop {i}: a prompt", HOP_TOKENS)
            if s.error or s.text != expected(s.prompt, HOP_TOKENS):
                raise SystemExit(f"{name}: a wrong answer: {s.error or s.text!r}")
            if i >= 2:
                out[name].append(s)
    return out


def under_faults(client: openai.OpenAI, requests: int, concurrency: int,
                 faults: list[tuple[float, Callable[[], None]]]) -> tuple[list[Stream], list]:
    """Section 2: `requests` streams, `concurrency` at a time; each fault runs once that share
    of the requests has been started and half the streams are mid-way (a busy box may have none
    at a given instant: the fault waits for them, at most FAULT_WAIT_S). Returns the streams
    and (when, what) of each fault."""
    started = 0
    live: set[Stream] = set()
    done_faults: list[tuple[float, str]] = []
    finished = threading.Event()

    def one(i: int) -> Stream:
        nonlocal started
        started += 1
        return stream(client, f"request {i}: a prompt that crosses nodes", LOAD_TOKENS, live)

    def controller() -> None:
        for share, fault in sorted(faults, key=lambda f: f[0]):
            deadline = None
            while not finished.is_set():
                if started >= share * requests:
                    deadline = deadline or time.monotonic() + FAULT_WAIT_S
                    if len(live) >= concurrency // 2 or time.monotonic() > deadline:
                        break
                time.sleep(0.005)
            fault()
            done_faults.append((time.monotonic(), getattr(fault, "__name__", "fault")))

    thread = threading.Thread(target=controller, name="faults")
    thread.start()
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            streams = list(pool.map(one, range(requests)))
    finally:
        finished.set()
        thread.join()
    return streams, done_faults


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="12 requests per path in section 1, 60 under faults")
    parser.add_argument("--hop", type=int, default=None, help="section 1 requests per path "
                        "(default 40)")
    parser.add_argument("--requests", type=int, default=None,
                        help="section 2 requests (default 300)")
    parser.add_argument("--concurrency", type=int, default=12,
                        help="section 2 requests at a time (default 12)")
    add_out_option(parser, "cluster")
    args = parser.parse_args(argv)
    why = netns_problem()
    if why is not None:
        raise SystemExit(f"bench.cluster needs network namespaces ({why}): run it as root")
    n_hop = args.hop or (12 if args.quick else 40)
    n_load = args.requests or (60 if args.quick else 300)

    r = Report()
    r.header("engined cluster gateway benchmark", args.quick, parser.prog,
             f"- three nodes, each an engined in a network namespace of its own, its engine "
             f"testkit/commandserver.py (`openai: vllm`, a token every {TICK} s); the cluster "
             f"gateway in a fourth namespace, the nodes found through a name in its hosts file; "
             f"probes every 0.3 s, a node down after 2 s without an answer")
    hosts, root = Hosts(3), Path(tempfile.mkdtemp(prefix="ecb", dir="/tmp"))
    cluster = Cluster(root)
    try:
        hosts.make()
        hosts.route_to_nodes()
        nodes = {f"n{i}": cluster.node(f"n{i}", f"{hosts.node_address(i)}:{PORT}",
                                       f"{hosts.node_address(i)}:{HTTP}", hosts.exec(ns), TICK)
                 for i, ns in enumerate(hosts.nodes)}
        spec = cluster_spec(root / "gw", [f"{Hosts.NODES_NAME}:{PORT}"], f"10.213.0.2:{PORT}",
                            f"10.213.0.2:{HTTP}")
        gw = cluster.daemon("gw", spec, list(hosts.exec(hosts.gw)))
        metrics = f"http://10.213.0.2:{HTTP}/metrics"
        gw.wait_for(lambda: sum(metric(metrics, "engined_cluster_node_up",
                                       f'node="{hosts.node_address(i)}:{PORT}"')
                                for i in range(3)) == 3, 60, "three nodes up")
        via = openai.OpenAI(base_url=f"http://10.213.0.2:{PORT}/v1", api_key="none",
                            max_retries=0, timeout=120)
        direct = openai.OpenAI(base_url=f"http://{hosts.node_address(0)}:{PORT}/v1",
                               api_key="none", max_retries=0, timeout=120)
        hops = hop(via, direct, n_hop)

        def sigkill_node_1() -> None:
            kill_node(nodes["n1"])

        def cut_node_2() -> None:
            hosts.cut(2)
        streams, faults = under_faults(via, n_load, args.concurrency,
                                       [(1 / 3, sigkill_node_1), (2 / 3, cut_node_2)])
        moves = metric(metrics, "engined_gateway_migrations_total", 'model="fake"')
    finally:
        problems = cluster.close()
        hosts.remove()
        shutil.rmtree(root, ignore_errors=True)
    report(r, hops, streams, faults, moves, args.concurrency)
    if problems:
        r(f"- problems at the stop: {'; '.join(problems)}")
    return r.finish(cluster.killed, out_path(args, "cluster"))


def report(r: Report, hops: dict[str, list[Stream]], streams: list[Stream],
           faults: list[tuple[float, str]], moves: float, concurrency: int) -> None:
    r(f"## 1. The extra hop ({len(hops['cluster'])} streamed completions per path, "
      f"{HOP_TOKENS} tokens, one at a time, alternating)", "",
      *table("measure", "median", "min–max", "n"))
    for name, label in (("direct", "a node's gateway directly"),
                        ("cluster", "through the cluster gateway")):
        r(dist_row(f"time to first token, {label}", [s.first_s() for s in hops[name]],
                   1, "ms", 1000),
          dist_row(f"time to last token, {label}", [s.total_s() for s in hops[name]],
                   1, "ms", 1000))
    added = [statistics.median(s.first_s() or 0 for s in hops["cluster"])
             - statistics.median(s.first_s() or 0 for s in hops["direct"]),
             statistics.median(s.total_s() or 0 for s in hops["cluster"])
             - statistics.median(s.total_s() or 0 for s in hops["direct"])]
    r("", f"The hop adds {added[0] * 1000:+.1f} ms to the median time to the first token and "
          f"{added[1] * 1000:+.1f} ms to the median time to the last.", "")

    ok = [s for s in streams if not s.error and s.text == expected(s.prompt, LOAD_TOKENS)]
    wrong = [s for s in streams if not s.error and s not in ok]
    failed = [s for s in streams if s.error]
    r(f"## 2. Faults under load ({len(streams)} streamed completions of {LOAD_TOKENS} tokens, "
      f"{concurrency} at a time)", "", *table("measure", "value"),
      f"| requests | {len(streams)} |", f"| identical to the oracle | {len(ok)} |",
      f"| answered with other text | {len(wrong)} |", f"| failed | {len(failed)} |",
      f"| moved to another node (engined_gateway_migrations_total) | {moves:.0f} |", "")
    for s in failed[:5]:
        r(f"- failed: {s.error}")
    r(*table("fault", "longest wait, median", "longest wait, min–max", "streams in flight"))
    for when, what in faults:
        waits = [s.longest_gap()[1] for s in streams
                 if s.chunks and s.chunks[0] < when < s.chunks[-1]]
        label = {"sigkill_node_1": "a node SIGKILLed (daemon and engines)",
                 "cut_node_2": "a node's link cut (silence)"}.get(what, what)
        r(dist_row(label, waits, 2, "s"))
    r("", "Streams in flight at a fault: each one's longest wait between two chunks (those on "
          "the lost node wait for the move: a kill is seen at once, a silent node once no "
          f"probe answered for the probe timeout; the others wait one token, {TICK} s).", "")


if __name__ == "__main__":
    sys.exit(main())
