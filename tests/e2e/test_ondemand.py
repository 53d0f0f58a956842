"""Engines on demand through the real daemon (docs/on-demand.md): models asleep from the start,
woken by a gateway request, swapped within supervisor.memory_budget (the least recently used
idle one sleeps), told in status, events and /metrics; `enginectl sleep` / `wake`. The wiring
only: deadlines and the eviction rules are proven on the jumping clock
(tests/lifecycle/test_ondemand.py)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.driver import BackgroundStream, Daemon, free_port

GIB = 1 << 30
MODELS = ("a", "b", "c", "d")


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def samples(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics, parsed by prometheus_client: (sample name, sorted labels) -> value."""
    code, text = get(port, "/metrics")
    assert code == 200, text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def events(d: Daemon) -> list[dict[str, Any]]:
    done = d.ctl("events", "-n", "1000")
    assert done.returncode == 0, done
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def sleeps_and_wakes(d: Daemon) -> list[tuple[str, str, str]]:
    """(engine, event, reason) of every sleep and wake event, in order."""
    return [(e["engine"], e["event"], e["reason"]) for e in events(d) if "event" in e]


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                         max_retries=0, timeout=60)


def complete(api: openai.OpenAI, model: str, text: str = "hello there") -> str:
    answer = api.completions.create(model=model, prompt=text, max_tokens=4)
    return answer.choices[0].text


def start(engined: Any, token_ms: int = 0, idle: str = "30s") -> tuple[Daemon, int, int]:
    """Four echo models of 1 GiB each, a budget of 2 GiB: (daemon, gateway port, http port)."""
    gateway, http = free_port(), free_port()
    env = {"ENGINED_ECHO_TOKEN_MS": str(token_ms)} if token_ms else {}
    d = engined([{"name": m, "model": "builtin:echo", "memory_limit": "1GiB",
                  "idle_timeout": idle, "env": env} for m in MODELS],
                supervisor={"gateway": f"127.0.0.1:{gateway}", "http": f"127.0.0.1:{http}",
                            "memory_budget": {"host": "2GiB"}}, ready=False)
    d.wait_for(lambda: all(e["state"] == "ASLEEP" for e in d.engines().values()), 20,
               "every model asleep")
    return d, gateway, http


@pytest.mark.smoke
def test_four_models_swap_within_a_budget_of_two(engined):
    d, gateway, http = start(engined, token_ms=5)
    table = d.ctl("status").stdout
    assert table.count("ASLEEP (on demand, wakes on request)") == 4, table
    assert d.engine("a-0")["desired"] == "asleep" and d.engine("a-0")["pid"] is None
    # asleep is not down: nothing is expected to run, and a request would wake any of them
    assert get(http, "/health")[0] == 200 and get(http, "/readyz")[0] == 200
    code, listed = get(gateway, "/v1/models")
    assert code == 200 and sorted(m["id"] for m in json.loads(listed)["data"]) == list(MODELS)

    api = client(gateway)
    for model in MODELS:  # each wakes on its request; from c on, the oldest idle one sleeps
        assert complete(api, model)
    engines = d.engines()
    assert [engines[f"{m}-0"]["state"] for m in MODELS] == ["ASLEEP", "ASLEEP", "READY", "READY"]
    assert all(e["restarts"] == 0 for e in engines.values()), engines
    evicted = engines["a-0"]
    assert evicted["on_demand"]["reason"] == "budget" and evicted["on_demand"]["wakes"] == 1
    assert evicted["on_demand"]["held_bytes"] == GIB
    status = json.loads(d.ctl("status", "--json", "a-0").stdout)
    assert status["engines"][0]["on_demand"]["reason"] == "budget", status
    assert "ASLEEP (for the memory budget, wakes on request)" in d.ctl("status").stdout
    told = sleeps_and_wakes(d)
    for m in MODELS:
        assert (f"{m}-0", "wake", "request") in told, told
    assert [t for t in told if t[1] == "sleep"] == [("a-0", "sleep", "budget"),
                                                   ("b-0", "sleep", "budget")], told
    metrics = samples(http)
    assert metrics[("engined_engine_wakes_total", (("engine", "a-0"), ("reason", "request")))] == 1
    assert metrics[("engined_engine_sleeps_total", (("engine", "a-0"), ("reason", "budget")))] == 1
    assert metrics[("engined_engine_wake_seconds_count", (("engine", "d-0"),))] == 1
    assert metrics[("engined_memory_budget_bytes", (("pool", "host"),))] == 2 * GIB
    assert metrics[("engined_memory_budget_held_bytes", (("pool", "host"),))] == 2 * GIB

    # an operator's sleep and wake
    done = d.ctl("sleep", "c")
    assert done.returncode == 0, done
    assert d.engine("c-0")["state"] == "ASLEEP" and d.engine("c-0")["on_demand"]["reason"] == \
        "operator"
    done = d.ctl("wake", "a")  # fits beside d once c sleeps
    assert done.returncode == 0, done
    assert d.engine("a-0")["state"] == "READY"
    assert samples(http)[("engined_engine_wakes_total",
                          (("engine", "a-0"), ("reason", "operator")))] == 1
    # a and d both busy: b cannot wake (only busy memory), said at once, naming the budget
    streams = [BackgroundStream(api, m, "x" * 200, 200) for m in ("a", "d")]
    for stream in streams:
        assert stream.started.wait(20)
    began = time.monotonic()
    done = d.ctl("wake", "b")
    assert done.returncode == 1, done
    assert "memory_budget.host" in done.stdout + done.stderr, done
    assert time.monotonic() - began < 5  # at once, not at its timeout
    assert d.engine("b-0")["state"] == "ASLEEP"
    for stream in streams:
        stream.join(30)
        assert stream.text() == "x" * 200
    assert get(http, "/readyz")[0] == 200


# --- the judged scenario, and a real model (slow tier) ------------------------------------------

MIX_S = 20.0  # how long the clients ask
CLIENTS = 6  # concurrent streams
EDGE_S = 0.1  # a request's client-side span is its server-side one plus a little at both ends


class Mix:
    """Clients streaming completions over the four models (some more wanted than others) for
    MIX_S: what each request asked for, when it began and ended (wall clock, as events are),
    and how it ended."""

    def __init__(self, port: int, seed: int) -> None:
        self.port, self.seed = port, seed
        self.done: list[tuple[str, float, float, str | None]] = []  # model, began, ended, error
        self._lock = threading.Lock()

    def run(self) -> None:
        threads = [threading.Thread(target=self._client, args=(i,)) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(MIX_S + 120)

    def _client(self, index: int) -> None:
        import random
        rng = random.Random(self.seed + index)
        api = client(self.port)
        until = time.monotonic() + MIX_S
        while time.monotonic() < until:
            model = rng.choices(MODELS, weights=(4, 3, 2, 1))[0]
            tokens = rng.randint(5, 40)
            began, error = time.time(), None
            try:
                chunks = [c.choices[0] for c in api.completions.create(
                    model=model, prompt="w " * 60, max_tokens=tokens, stream=True)]
                text = "".join(c.text for c in chunks)
                if len(text) != tokens or chunks[-1].finish_reason != "length":
                    error = f"{text!r} ({chunks[-1].finish_reason}) for {tokens} tokens"
            except openai.OpenAIError as exc:
                error = repr(exc)
            with self._lock:
                self.done.append((model, began, time.time(), error))
            time.sleep(rng.uniform(0, 0.3))


@pytest.mark.slow
def test_a_client_mix_over_four_models_in_a_budget_of_two_loses_nothing(engined, rng_seed):
    d, gateway, http = start(engined, token_ms=10, idle="2s")
    mix = Mix(gateway, rng_seed)
    mix.run()
    failed = [r for r in mix.done if r[3] is not None]
    assert not failed, failed[:5]
    asked = {m for m, *_ in mix.done}
    assert asked == set(MODELS) and len(mix.done) > 50, (asked, len(mix.done))
    # idle for idle_timeout, the last awake ones sleep too: then nothing moves any more
    d.wait_for(lambda: all(e["state"] == "ASLEEP" for e in d.engines().values()), 20,
               "every model asleep again")

    log = [e for e in events(d) if "event" in e]
    metrics = samples(http)
    told: dict[tuple[str, str, str], int] = {}
    for e in log:
        key = (e["event"], e["engine"], e["reason"])
        told[key] = told.get(key, 0) + 1
    counted = {(kind[len("engined_engine_"):-len("s_total")], labels[0][1], labels[1][1]): v
               for (kind, labels), v in metrics.items()
               if kind in ("engined_engine_wakes_total", "engined_engine_sleeps_total") and v}
    assert told == counted, (told, counted)  # every sleep and wake in events and metrics
    evictions = [e for e in log if e["event"] == "sleep" and e["reason"] == "budget"]
    assert evictions, told  # the budget swapped models
    assert any(e["event"] == "sleep" and e["reason"] == "idle" for e in log), told
    print(f"[mix] {len(mix.done)} requests, {len(evictions)} evictions, {told}")
    # nothing was evicted with a request in flight: no request of its model spans the moment
    for e in evictions:
        model = e["engine"].rsplit("-", 1)[0]
        spanning = [r for r in mix.done if r[0] == model
                    and r[1] + EDGE_S < e["at"] < r[2] - EDGE_S]
        assert not spanning, (e, spanning)
    moved = {k: v for (k, labels), v in metrics.items()
             if k == "engined_gateway_migrations_total" and v}
    assert not moved, moved  # and none was lost on an engine put to sleep and moved
    for model in MODELS:  # each wake timed, start to READY
        wakes = sum(n for (kind, engine, _), n in told.items()
                    if kind == "wake" and engine == f"{model}-0")
        assert metrics[("engined_engine_wake_seconds_count", (("engine", f"{model}-0"),))] \
            == wakes, (model, told)
    assert not [key for key in told if key[2] == "load"], told  # one replica each: never full
    assert metrics[("engined_memory_budget_held_bytes", (("pool", "host"),))] <= 2 * GIB
    assert all(e["restarts"] == 0 for e in d.engines().values())


@pytest.mark.slow
def test_a_sleeping_tiny_llama_wakes_on_its_first_request(engined, tiny_cache):
    gateway = free_port()
    d = engined([{"name": "tiny", "model": "builtin:tiny-llama", "idle_timeout": "1m",
                  "env": {"ENGINED_CACHE_DIR": str(tiny_cache)}}],
                supervisor={"gateway": f"127.0.0.1:{gateway}"}, ready=False)
    d.wait_state("tiny-0", "ASLEEP")
    began = time.monotonic()
    stream = client(gateway).completions.create(model="tiny", prompt="Once upon a time",
                                                max_tokens=8, stream=True)
    first = next(iter(stream))
    took = time.monotonic() - began
    assert first.choices, first
    rest = "".join(c.choices[0].text for c in stream)
    print(f"[tiny-llama] asleep -> first token in {took:.3f}s ({first.choices[0].text + rest!r})")
    engine = d.engine("tiny-0")
    assert engine["state"] == "READY" and engine["restarts"] == 0
    assert engine["on_demand"]["wakes"] == 1


@pytest.mark.slow
def test_an_upgrade_in_place_keeps_sleeping_engines_asleep(engined):
    gateway = free_port()
    d = engined([{"name": m, "model": "builtin:echo", "idle_timeout": "1m"} for m in "xyz"],
                supervisor={"gateway": f"127.0.0.1:{gateway}"}, ready=False)
    d.wait_for(lambda: all(e["state"] == "ASLEEP" for e in d.engines().values()), 20,
               "every model asleep")
    api = client(gateway)
    assert complete(api, "x") and complete(api, "y")
    assert d.ctl("sleep", "y").returncode == 0
    awake = d.engine("x-0")
    done = d.ctl("upgrade")
    assert done.returncode == 0, done
    assert d.status()["supervisor"]["handovers"] == 1
    engines = d.engines()
    assert engines["x-0"]["state"] == "READY" and engines["x-0"]["pid"] == awake["pid"]
    for name in ("y-0", "z-0"):  # asleep by an operator, and from the start
        assert engines[name]["state"] == "ASLEEP" and engines[name]["pid"] is None, engines
        assert engines[name]["desired"] == "asleep" and engines[name]["restarts"] == 0
    assert "ASLEEP (" in d.ctl("status", "y-0").stdout
    # the new code wakes them on a request, and puts the awake one to sleep on operator's word
    assert complete(api, "z")
    assert d.engine("z-0")["state"] == "READY"
    assert d.ctl("sleep", "x").returncode == 0
    assert d.engine("x-0")["state"] == "ASLEEP"


def test_a_model_measured_over_the_budget_is_put_to_sleep_and_then_told_at_once(engined):
    """Without a memory_limit a model holds what it was measured to hold (resident memory of
    its process tree): unknown until it is READY, so it wakes once; measured over the budget,
    it is put to sleep when idle, and the next request gets a 503 at once naming the budget."""
    gateway, http = free_port(), free_port()
    d = engined([{"name": "m", "model": "builtin:echo", "idle_timeout": "1m"}],
                supervisor={"gateway": f"127.0.0.1:{gateway}", "http": f"127.0.0.1:{http}",
                            "memory_budget": {"host": "4MiB"}}, ready=False)
    d.wait_state("m-0", "ASLEEP")
    assert complete(client(gateway), "m")
    asleep = d.wait_state("m-0", "ASLEEP", timeout_s=10)  # the next tick measures it
    assert asleep["on_demand"]["reason"] == "budget", asleep
    assert asleep["on_demand"]["held_bytes"] > 4 << 20, asleep
    began = time.monotonic()
    request = urllib.request.Request(
        f"http://127.0.0.1:{gateway}/v1/completions", method="POST",
        data=json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert time.monotonic() - began < 5  # at once, not at wake_timeout (5m)
    body = info.value.read().decode()
    assert info.value.code == 503 and info.value.headers["Retry-After"], (info.value, body)
    assert "'m'" in body and "memory_budget.host" in body and "never wake" in body, body
    assert d.engine("m-0")["state"] == "ASLEEP"
    held = samples(http)[("engined_memory_budget_held_bytes", (("pool", "host"),))]
    assert held == 0  # asleep: it holds nothing now


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="the hand-over (upgrade/snapshot.py, handover.py) keeps "
                   "no on-demand state: after an upgrade in place engined_engine_wakes_total, "
                   "_sleeps_total and _wake_seconds start again from nothing (counters go "
                   "back) and a sleeping engine's reason becomes 'start' (status: 'on demand')")
def test_an_upgrade_in_place_keeps_the_sleep_and_wake_counts_and_reasons(engined):
    gateway, http = free_port(), free_port()
    d = engined([{"name": "x", "model": "builtin:echo", "idle_timeout": "1m"}],
                supervisor={"gateway": f"127.0.0.1:{gateway}", "http": f"127.0.0.1:{http}"},
                ready=False)
    d.wait_state("x-0", "ASLEEP")
    assert complete(client(gateway), "x")
    assert d.ctl("sleep", "x").returncode == 0
    wakes = ("engined_engine_wakes_total", (("engine", "x-0"), ("reason", "request")))
    assert samples(http)[wakes] == 1
    assert d.ctl("upgrade").returncode == 0
    assert d.engine("x-0")["on_demand"]["reason"] == "operator"
    assert samples(http).get(wakes) == 1
