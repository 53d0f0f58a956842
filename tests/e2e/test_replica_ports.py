"""supervisor.replica_ports: each serving replica also on a port of its own (BASE + i, in spec
order), with its own OpenAI API and model-server /metrics, so that an inference pool's endpoint
picker can route per engine. A request there goes to that replica; a stopped replica's port
answers 503 at once (engined_replica_up says 0); a stream on a replica that dies goes on on a
sibling, as the gateway moves any request."""

from __future__ import annotations

import os
import signal
import threading
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.driver import BackgroundStream, free_port
from testkit.probes import free_port_range

pytestmark = pytest.mark.timeout(300)


def _samples(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                         max_retries=0, timeout=60)


def test_each_replica_on_a_port_of_its_own(engined):
    base, gateway, http = free_port_range(3), free_port(), free_port()
    d = engined([{"name": "echo", "replicas": 2, "model": "builtin:echo",
                  "env": {"ENGINED_ECHO_TOKEN_MS": "20"}},
                 {"name": "other", "model": "builtin:echo", "served_model_name": "other-model",
                  "env": {"ENGINED_ECHO_TOKEN_MS": "20"}}],
                supervisor={"gateway": f"127.0.0.1:{gateway}", "http": f"127.0.0.1:{http}",
                            "replica_ports": base, "heartbeat_interval": "0.2s"})

    def running() -> dict[str, int]:
        return {n: (e["queue"] or {}).get("running", 0) for n, e in d.engines().items()}

    for port, (name, model) in enumerate((("echo-0", "echo"), ("echo-1", "echo"),
                                          ("other-0", "other-model")), start=base):
        client = _client(port)
        assert [m.id for m in client.models.list()] == [model]
        # a slow request sent to this port runs on this replica, and on no other
        slow = threading.Thread(target=lambda c=client, m=model: c.completions.create(
            model=m, prompt="x" * 75, max_tokens=75))  # 1.5 s at 20 ms a token
        slow.start()
        seen = d.wait_for(lambda: (r := running()) and sum(r.values()) and r, 30,
                          f"the request sent to {name}'s port running")
        assert seen[name] == 1 and sum(seen.values()) == 1, seen
        slow.join(60)
        done = client.completions.create(model=model, prompt="hello", max_tokens=5)
        assert done.choices[0].text == "hello"
        stats = d.wait_for(lambda p=port, m=model: (st := _samples(p)) and st[(
            "vllm:num_requests_running", (("model_name", m),))] == 0 and st, 10,
            "the replica's port to say it runs nothing")
        assert {k[1] for k in stats if k[0] == "vllm:num_requests_waiting"} == \
            {(("model_name", model),)}  # this replica's model alone
        assert _samples(http)[("engined_replica_up", (("port", str(port)),))] == 1
    with pytest.raises(openai.NotFoundError):  # another replica's model is not served there
        _client(base).completions.create(model="other-model", prompt="x", max_tokens=1)

    # a stopped replica's port answers at once, and says so
    assert d.ctl("stop", "echo-1").returncode == 0
    with pytest.raises(openai.APIStatusError) as refused:
        _client(base + 1).completions.create(model="echo", prompt="hello", max_tokens=5)
    assert refused.value.status_code == 503 and "echo-1 is not serving" in str(refused.value)
    assert _samples(http)[("engined_replica_up", (("port", str(base + 1)),))] == 0
    assert _client(gateway).completions.create(model="echo", prompt="hi",
                                               max_tokens=2).choices[0].text == "hi"

    # a stream on echo-0's port whose engine dies goes on on its sibling
    assert d.ctl("start", "echo-1").returncode == 0
    d.wait_state("echo-1", "READY", 60)
    pid = d.engine("echo-0")["pid"]
    reader = BackgroundStream(_client(base), "echo", "z" * 150, 150)
    assert reader.started.wait(30)
    os.kill(pid, signal.SIGKILL)
    reader.join(60)
    assert reader.text() == "z" * 150
    d.wait_restarted("echo-0", pid, 60)
