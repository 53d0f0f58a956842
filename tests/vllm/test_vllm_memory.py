"""Memory that adapts for `backend: vllm` (engine.memory, engine.vllm_backend), through the real
daemon and gateway: `memory_limit` sizes vLLM's KV cache by vLLM's own sizing (the sizes chosen
are in status), and an engine whose limit leaves a step too little memory runs out of memory in
vLLM's step: it aborts the step's requests in vLLM, lowers its batch limit (engined's admission
in front of vLLM's scheduler), continues each request from the tokens it had delivered and
answers all of them with the text an unlimited engine gives (greedy). No engine restarts.

On a CPU the limit is enforced by RLIMIT_AS once the engine is loaded, and what it leaves over
the KV cache is the reserve (ENGINE_MEMORY_RESERVE) less what vLLM's own sizing overshoots;
the test measures that overshoot on a first incarnation and sets the reserve so that a burst's
steps, not one sequence's, run out. That headroom is not a figure tuned on one machine: what one
of the burst's sequences and the burst take is measured on the first incarnation (from /proc:
the peak resident memory each adds, reset before each, plus the address space each leaves
mapped), and the headroom goes between the two, a factor of margin from each; a box that gives
no such window fails, naming the figures."""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from test_vllm_engine import DEFAULTS, READY_TIMEOUT_S, vllm_engine

from testkit.driver import free_port, running_daemon

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
MiB = 1 << 20
LIMIT = 800 * MiB
# The headroom (limit less resident memory once loaded) goes between what one of the burst's
# sequences takes and what the burst does, a factor of sqrt(burst / one) from each
# (geometrically in the middle); that factor must be MARGIN or more.
MARGIN = 1.4
HEADROOM_SLACK = 0.2  # the headroom an incarnation actually gets, within this part of the wanted
BURST = 32
PROMPTS = [f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 12
           for i in range(BURST)]


def _engine(python: str, cache: Path) -> dict[str, Any]:
    engine = vllm_engine("vm", python, cache, memory_limit=LIMIT, stall_timeout="120s")
    engine["env"].pop("VLLM_CPU_KVCACHE_SPACE")  # memory_limit sizes the KV cache
    return engine


def _burst(client: openai.OpenAI) -> list[str]:
    def one(prompt: str) -> str:
        return client.completions.create(model="vm", prompt=prompt, max_tokens=120,
                                         temperature=0).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        return list(pool.map(one, PROMPTS))


def _status(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in f)
                if k in ("VmRSS", "VmHWM", "VmSize")}


class _Meter:
    """What requests take in an engine, from /proc/PID/status."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.base = _status(pid)["VmSize"]

    def need(self, run: Callable[[], object]) -> int:
        """Bytes that `run` takes over what the engine held when the meter began: the peak
        resident memory it adds (the peak is reset first), the address space it leaves mapped,
        and what earlier requests left mapped (caches it reuses and on its own would map).
        RLIMIT_AS, the limit's measure, counts all of it."""
        with open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = _status(self.pid)
        run()
        after = _status(self.pid)
        return (max(0, before["VmSize"] - self.base) + after["VmHWM"] - before["VmRSS"]
                + max(0, after["VmSize"] - before["VmSize"]))


def _reload_with_reserve(d: Any, reserve: int, incarnation: int) -> dict[str, Any]:
    spec = yaml.safe_load(d.spec_path.read_text())
    spec["engines"][0]["env"]["ENGINE_MEMORY_RESERVE"] = str(reserve)
    d.spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    assert d.ctl("reload").returncode == 0  # a changed engine: its replica restarts
    return d.wait_state("vm-0", "READY", timeout_s=READY_TIMEOUT_S,
                        where=lambda e: e["incarnation"] == incarnation + 1
                        and e["memory_headroom_bytes"] is not None)


def test_a_vllm_engine_sizes_its_kv_cache_from_its_limit_and_survives_running_out(
        vllm_python: str, tiny_cache: Path) -> None:
    gateway = free_port()
    with running_daemon([_engine(vllm_python, tiny_cache)],
                        {"gateway": f"127.0.0.1:{gateway}", "heartbeat_interval": "0.2s",
                         "heartbeat_timeout": "60s"}, DEFAULTS, prefix="egm") as d:
        d.wait_all_ready(READY_TIMEOUT_S)
        e = d.engine("vm-0")
        memory = e["memory"]
        assert memory["memory_limit_bytes"] == LIMIT, e
        assert memory["kv_cache_bytes"] > 0 and 0 < memory["gpu_memory_utilization"] < 1, e
        assert memory["resident_at_limit_bytes"] + e["memory_headroom_bytes"] <= LIMIT * 1.01
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="none",
                               max_retries=0, timeout=600)
        # the default reserve: nothing runs out of memory. What one sequence takes first (on
        # the fresh incarnation, as the limited one meets it), then the burst.
        meter = _Meter(e["pid"])
        one = meter.need(lambda: client.completions.create(model="vm", prompt=PROMPTS[0],
                                                           max_tokens=120, temperature=0))
        box: list[list[str]] = []
        burst = meter.need(lambda: box.append(_burst(client)))
        reference = box[0]
        e = d.engine("vm-0")
        assert e["oom_total"] == 0 and e["batch_limit"] == 8, e
        headroom = int(math.sqrt(one * burst))
        figures = (f"one sequence takes {one / MiB:.1f} MiB, the burst {burst / MiB:.1f} MiB: "
                   f"headroom {headroom / MiB:.1f} MiB")
        print(figures)
        assert burst >= MARGIN ** 2 * one, f"no window for the headroom on this box: {figures}"

        # What vLLM's sizing left over the default reserve tells how much to reserve for the
        # headroom wanted; an incarnation may differ a little: set it again until it fits.
        reserve = max(64 * MiB, LIMIT // 10)
        for _ in range(4):
            overshoot = reserve - e["memory_headroom_bytes"]
            reserve = overshoot + headroom
            e = _reload_with_reserve(d, reserve, e["incarnation"])
            if abs(e["memory_headroom_bytes"] - headroom) <= HEADROOM_SLACK * headroom:
                break
        print(f"incarnation {e['incarnation']}: reserve {reserve / MiB:.1f} MiB, headroom "
              f"{e['memory_headroom_bytes'] / MiB:.1f} MiB, KV cache "
              f"{e['memory']['kv_cache_bytes'] / MiB:.1f} MiB")
        assert abs(e["memory_headroom_bytes"] - headroom) <= HEADROOM_SLACK * headroom, (
            figures, e)
        restarts, incarnation = e["restarts"], e["incarnation"]

        limited = _burst(client)
        assert limited == reference  # every request answered, each with the unlimited text
        e = d.engine("vm-0")
        assert e["restarts"] == restarts and e["incarnation"] == incarnation, e
        assert e["oom_total"] >= 1, (figures, e, d.log_text("vm-0")[-3000:])
        assert "[oom] a vLLM step of" in d.log_text("vm-0")

        # the limit comes back once steps succeed and the failure is old (engine.memory)
        d.wait_for(lambda: (client.completions.create(model="vm", prompt="hi", max_tokens=2,
                                                      temperature=0)
                            and d.engine("vm-0")["batch_limit"] == 8), 180,
                   "the batch limit back at max_batch_size", interval_s=1.0)
        assert d.engine("vm-0")["restarts"] == restarts
