"""The model server protocol on the gateway's port (serverstats): `GET /metrics` there carries,
per served model, the gauges the Gateway API Inference Extension's endpoint picker reads from a
vLLM server: vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc and
vllm:cache_config_info, parsed here by prometheus_client's own text parser. Under a burst that
saturates the engines' batches they say so (waiting > 0); idle, they come back to 0."""

from __future__ import annotations

import concurrent.futures
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.driver import free_port

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:cache_config_info")


def _scrape(port: int) -> dict[str, dict[str, float]]:
    """gauge -> model_name -> value; every family parsed by Prometheus' own parser."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        assert family.type == "gauge", family
        for sample in family.samples:
            out.setdefault(sample.name, {})[sample.labels["model_name"]] = sample.value
    return out


@pytest.mark.smoke
def test_the_gateway_port_serves_the_model_server_protocol(engined, short_tmp: Path,
                                                           tiny_cache: Path):
    key = short_tmp / "key"
    key.write_text("sesame\n")
    gateway = free_port()
    d = engined([{"name": "tiny", "model": "builtin:tiny-llama", "max_batch_size": 2,
                  "env": {"ENGINED_CACHE_DIR": str(tiny_cache)}},
                 {"name": "other", "model": "builtin:echo", "served_model_name": "other-model"}],
                supervisor={"gateway": f"127.0.0.1:{gateway}", "heartbeat_interval": "0.2s",
                            "api_key_file": str(key)})
    idle = _scrape(gateway)  # no token asked, as vLLM's own /metrics asks none
    assert set(GAUGES) <= set(idle), idle
    for gauge in GAUGES[:3]:
        assert idle[gauge] == {"tiny": 0.0, "other-model": 0.0}, (gauge, idle)
    assert idle["vllm:cache_config_info"] == {"tiny": 1.0, "other-model": 1.0}
    with pytest.raises(openai.AuthenticationError):  # the API itself still asks for it
        openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="wrong",
                      max_retries=0).models.list()

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="sesame",
                           max_retries=0, timeout=120)
    burst = 8  # a batch of two places: six requests wait at first
    max_tokens = 400  # the saturated state spans several heartbeats on a fast idle box too

    def one(i: int) -> int:
        done = client.completions.create(model="tiny", prompt=f"request {i}: the quick brown "
                                         "fox", max_tokens=max_tokens, temperature=0)
        return done.usage.completion_tokens

    seen: list[dict[str, dict[str, float]]] = []
    with concurrent.futures.ThreadPoolExecutor(burst) as pool:
        answers = [pool.submit(one, i) for i in range(burst)]

        def saturated() -> bool:
            seen.append(m := _scrape(gateway))
            return (m["vllm:num_requests_waiting"]["tiny"] > 0
                    and m["vllm:num_requests_running"]["tiny"] > 0)
        d.wait_for(saturated, 120, "the gauges to show a saturated model", interval_s=0.05)
        assert all(a.result() == max_tokens for a in answers)
    busy = seen[-1]
    print(f"saturated: {({g: busy[g]['tiny'] for g in GAUGES[:3]})}")
    assert busy["vllm:num_requests_running"]["tiny"] <= 2  # a batch of two
    assert 0 < busy["vllm:kv_cache_usage_perc"]["tiny"] <= 1  # the batches' fill
    assert all(s[g]["other-model"] == 0 for s in seen for g in GAUGES[:3])  # untouched
    d.wait_for(lambda: all(_scrape(gateway)[g]["tiny"] == 0 for g in GAUGES[:3]), 30,
               "the gauges back to 0 once the burst is done")
