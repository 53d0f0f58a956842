"""Memory that adapts (engine.memory), through the real daemon and gateway: a tiny-llama engine
whose `memory_limit` fits only a few of a burst's sequences runs out of memory in its steps; it
shrinks its batch instead of dying, continues each cut request from the tokens it had delivered
and answers all of them with the text an unlimited engine gives (greedy), counts the OOMs,
grows its batch limit back, refuses a request that does not fit even alone with a 400 naming the
prompt and max_tokens, and serves on. No engine restarts.

The limit's headroom is not a figure tuned on one machine: what one of the burst's sequences,
the request too large alone and the burst take is measured on the unlimited incarnation (from
/proc: the peak resident memory each adds, reset before each, plus the address space each
leaves mapped, such as MKL's buffer cache), and the headroom is placed between one sequence and
the smaller of the other two, a factor of margin from each; a box that gives no such window
fails, naming the figures."""

from __future__ import annotations

import concurrent.futures
import math
import re
import urllib.request
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
import yaml

from testkit.driver import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
MiB = 1 << 20
# The headroom goes between what one of the burst's sequences takes and the least of what the
# request too large alone and a step of the burst (max_batch_size sequences) take, a factor of
# sqrt(least / one) from each (geometrically in the middle); that factor must be MARGIN or more.
MARGIN = 1.4
HEADROOM_SLACK = 0.1  # the headroom an incarnation actually gets, within this part of the wanted
BURST = 32
# ~190 tokens (byte-level): one sequence takes a third of what the request too large alone does
PROMPTS = [f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 4
           for i in range(BURST)]
TOO_LARGE = "fox " * 480  # with max_tokens 100: fits the model's context, not the headroom


def _engine(name: str, cache: Path, **extra: object) -> dict:
    return {"name": name, "model": "builtin:tiny-llama", "max_batch_size": 8,
            "launcher": "exec", "stall_timeout": "120s", "env": {"ENGINED_CACHE_DIR": str(cache)},
            **extra}


def _burst(client: openai.OpenAI, model: str) -> list[str]:
    def one(prompt: str) -> str:
        return client.completions.create(model=model, prompt=prompt, max_tokens=200,
                                         temperature=0).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        return list(pool.map(one, PROMPTS))


def _metric(port: int, name: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return None


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
        and what earlier requests left mapped (MKL's buffers: its own GEMMs reuse them, and on
        their own would map them). RLIMIT_AS, the limit's measure, counts all of it."""
        with open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = _status(self.pid)
        run()
        after = _status(self.pid)
        return (max(0, before["VmSize"] - self.base) + after["VmHWM"] - before["VmRSS"]
                + max(0, after["VmSize"] - before["VmSize"]))


def _resident_at_limit(d, name: str, incarnation: int) -> int:
    """What the engine held once loaded, from its `[memory]` line (engine.memory)."""
    def found() -> int | None:
        log = d.log_text(name).split("spawned pid")[incarnation:]
        hit = re.search(r"resident_at_limit_bytes (\d+)", "".join(log))
        return int(hit.group(1)) if hit else None
    return d.wait_for(found, 300, f"{name}'s [memory] line")


def test_an_engine_out_of_memory_shrinks_its_batch_and_loses_nothing(engined, tiny_cache):
    gateway, http = free_port(), free_port()
    # first with a limit far above need: the reference answers (nothing runs out of memory),
    # and what the engine holds once loaded, to set the real limit from
    d = engined([_engine("lim", tiny_cache, memory_limit="4GiB")], supervisor={
        "gateway": f"127.0.0.1:{gateway}", "http": f"127.0.0.1:{http}",
        "heartbeat_interval": "0.2s", "heartbeat_timeout": "60s"}, ready=False)
    d.wait_all_ready(300)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="none",
                           max_retries=0, timeout=600)
    # What each takes, on the fresh incarnation: one sequence first (what it maps for itself
    # counts), then the burst, then the request too large alone (with what the others left).
    meter = _Meter(d.engine("lim-0")["pid"])
    one = meter.need(lambda: client.completions.create(model="lim", prompt=PROMPTS[0],
                                                       max_tokens=200, temperature=0))
    box: list[list[str]] = []
    burst = meter.need(lambda: box.append(_burst(client, "lim")))
    reference = box[0]
    large = meter.need(lambda: client.completions.create(model="lim", prompt=TOO_LARGE,
                                                         max_tokens=100, temperature=0))
    assert d.engine("lim-0")["oom_total"] == 0 and d.engine("lim-0")["batch_limit"] == 8
    least = min(large, burst)
    headroom = int(math.sqrt(one * least))
    figures = (f"one sequence takes {one / MiB:.1f} MiB, the request too large alone "
               f"{large / MiB:.1f} MiB, the burst {burst / MiB:.1f} MiB: headroom "
               f"{headroom / MiB:.1f} MiB")
    print(figures)
    assert least >= MARGIN ** 2 * one, f"no window for the headroom on this box: {figures}"
    loaded = _resident_at_limit(d, "lim-0", 1)

    # The limit is set from what the previous incarnation held once loaded; the next may hold a
    # little more or less, so set it again until this one's headroom is what the test wants.
    incarnation, limit = 1, 0
    for _ in range(4):
        limit = loaded + headroom
        spec = yaml.safe_load(d.spec_path.read_text())
        spec["engines"][0]["memory_limit"] = limit
        d.spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
        assert d.ctl("reload").returncode == 0  # a changed engine: its replica restarts
        incarnation += 1
        d.wait_state("lim-0", "READY", timeout_s=300,
                     where=lambda e, n=incarnation: e["incarnation"] == n)
        loaded = _resident_at_limit(d, "lim-0", incarnation)
        if abs(limit - loaded - headroom) <= HEADROOM_SLACK * headroom:
            break
    print(f"incarnation {incarnation}: {loaded / MiB:.1f} MiB once loaded under a limit of "
          f"{limit / MiB:.1f} MiB")
    assert abs(limit - loaded - headroom) <= HEADROOM_SLACK * headroom, (limit, loaded, figures)
    restarts = d.engine("lim-0")["restarts"]

    limited = _burst(client, "lim")
    assert limited == reference  # every request answered, each with the unlimited text
    e = d.engine("lim-0")
    assert e["restarts"] == restarts and e["incarnation"] == incarnation, e
    assert e["oom_total"] >= 1, (figures, e, d.log_text("lim-0")[-2000:])
    assert "[oom] a step of" in d.log_text("lim-0")
    assert e["memory_headroom_bytes"] is not None
    assert _metric(http, 'engined_engine_oom_total{engine="lim-0"}') == e["oom_total"]

    # the limit comes back once steps succeed and the failure is old (engine.memory)
    d.wait_for(lambda: (client.completions.create(model="lim", prompt="hi", max_tokens=2,
                                                  temperature=0)
                        and d.engine("lim-0")["batch_limit"] == 8), 120,
               "the batch limit back at max_batch_size", interval_s=1.0)

    # a request that cannot fit even alone: a clear client error, and the engine serves on
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="lim", prompt=TOO_LARGE, max_tokens=100,
                                  temperature=0)
    message = str(refused.value)
    assert "out of memory" in message and "prompt" in message and "max_tokens" in message
    again = client.completions.create(model="lim", prompt=PROMPTS[0], max_tokens=200,
                                      temperature=0)
    assert again.choices[0].text == reference[0]
    assert d.engine("lim-0")["restarts"] == restarts


def test_a_memory_limit_below_the_loaded_engine_is_a_config_error(engined, tiny_cache):
    d = engined([_engine("small", tiny_cache, memory_limit="8MiB")], ready=False)
    e = d.wait_state("small-0", "FAILED", timeout_s=300)
    assert "memory_limit" in e["fail_reason"] and "raise it" in e["fail_reason"], e
    assert e["last_exit"]["code"] == 78, e


def test_an_engine_that_grows_past_its_limit_is_restarted_for_memory(engined):
    """Memory mapped before the limit and touched after it (`!grow`, fault injection) takes the
    engine past memory_limit without an allocation failing: its heartbeats say so, and the
    daemon restarts it with the reason `memory`."""
    d = engined([{"name": "grow", "model": "builtin:echo", "memory_limit": "256MiB"}],
                supervisor={"heartbeat_interval": "0.2s"})
    assert d.engine("grow-0")["memory"]["memory_limit_bytes"] == 256 * MiB
    d.http("POST", "/v1/generate", b'{"prompt": "!grow", "max_tokens": 1}',
           {"Content-Type": "application/json"})
    e = d.wait_for(lambda: (lambda e: e if e["restarts_by_reason"].get("memory") == 1
                            and e["state"] == "READY" and e["memory_headroom_bytes"] is not None
                            else None)(d.engine("grow-0")), 120, "a restart for memory")
    assert e["last_exit"]["reason"] == "memory", e
    assert e["incarnation"] == 2 and e["memory_headroom_bytes"] > 0, e
    assert "holds more than its memory_limit" in d.stderr_text(), d.stderr_text()[-2000:]
