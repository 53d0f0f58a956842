"""A cluster gateway's spec (`upstreams:`), what it reads from a node gateway's model server
protocol, and how it picks a node."""

from __future__ import annotations

import asyncio

import pytest

from engined.supervisor.cluster.nodes import Load, Node, Nodes, parse_loads
from engined.supervisor.cluster.router import NodeRouter
from engined.supervisor.gateway.serverstats import render
from engined.supervisor.lifecycle.notices import Lost
from engined.supervisor.routing.routes import LostOn, NoReplica
from engined.supervisor.spec import SpecError, parse_fleet
from engined.supervisor.spec.model import UpstreamsSpec

CLUSTER = """\
version: 1
supervisor: {gateway: "0.0.0.0:8000"}
upstreams:
  nodes: ["engined-nodes.inference.svc.cluster.local:8000", "10.0.0.7:8000", "[fd00::7]:8000"]
  probe_interval: 500ms
  probe_timeout: 2s
  api_key_file: /etc/engined/node-token
  migration_limit: 5
"""


def test_a_cluster_spec_resolves_with_its_nodes_and_no_engines():
    fleet = parse_fleet(CLUSTER, "c.yaml")
    up = fleet.upstreams
    assert fleet.engines == () and up is not None
    assert up.nodes == (("engined-nodes.inference.svc.cluster.local", 8000),
                        ("10.0.0.7", 8000), ("fd00::7", 8000))
    assert (up.probe_interval_s, up.probe_timeout_s, up.resolve_interval_s) == (0.5, 2.0, 10.0)
    assert (up.api_key_file, up.migration_limit, up.queue_limit) == (
        "/etc/engined/node-token", 5, 1024)


@pytest.mark.parametrize("text, problem", [
    ("upstreams: {nodes: []}", "upstreams.nodes: must be a non-empty list"),
    ("upstreams: {nodes: [localhost]}", "missing port"),
    ('upstreams: {nodes: ["a:1", "a:1"]}', "listed twice"),
    ('upstreams: {nodes: ["a:1"], probe_timeout: 1s}', "must exceed probe_interval"),
    ('upstreams: {nodes: ["a:1"], probe_interval: 0s}', "must be greater than 0"),
    ('upstreams: {nodes: ["a:1"], retries: 3}', "unknown key 'retries'"),
    ('upstreams: {nodes: ["a:1"]}\nengines: [{name: e, model: "builtin:echo"}]',
     "has no engines of its own"),
    ("upstreams: [a]", "upstreams: must be a mapping"),
])
def test_a_bad_upstreams_section_is_named(text: str, problem: str):
    with pytest.raises(SpecError) as info:
        parse_fleet(f'version: 1\nsupervisor: {{gateway: "127.0.0.1:8000"}}\n{text}\n', "c.yaml")
    assert problem in str(info.value)


def test_a_cluster_gateway_needs_its_gateway_address():
    with pytest.raises(SpecError, match="set supervisor.gateway"):
        parse_fleet('version: 1\nupstreams: {nodes: ["a:1"]}\n', "c.yaml")


NODE_METRICS = """\
# HELP vllm:num_requests_running Requests in the model's serving engines' batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama"} 3
vllm:num_requests_running{model_name="qu\\"oted"} 1
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama"} 7
vllm:kv_cache_usage_perc{model_name="llama"} 0.5
vllm:cache_config_info{block_size="16",model_name="llama"} 1
engined_build_info{version="1"} 1
"""


def test_a_node_gateways_model_server_protocol_is_read_per_model():
    assert parse_loads(NODE_METRICS) == {"llama": Load(3, 7, 0.5), 'qu"oted': Load(1, 0, 0.0)}
    assert parse_loads("") == {}


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _cluster(clock: _Clock) -> tuple[Nodes, NodeRouter, list[Lost]]:
    lost: list[Lost] = []
    spec = UpstreamsSpec(nodes=(("a", 1), ("b", 1)), probe_interval_s=1.0, probe_timeout_s=3.0)
    box: list[NodeRouter] = []
    nodes = Nodes(spec, clock, lost.append, lambda: box[0].changed())
    router = NodeRouter(nodes, clock)
    box.append(router)
    for host in ("10.0.0.1", "10.0.0.2"):
        nodes.nodes[(host, 8000)] = Node(host, 8000, "nodes:8000")
    return nodes, router, lost


def test_nodes_are_picked_by_room_then_load_and_a_silent_node_is_lost():
    async def main() -> None:
        clock = _Clock()
        nodes, router, lost = _cluster(clock)
        a, b = nodes.nodes[("10.0.0.1", 8000)], nodes.nodes[("10.0.0.2", 8000)]
        nodes._answered(a, {"llama": Load(running=1, waiting=4, kv_usage=0.2)})
        nodes._answered(b, {"llama": Load(running=1, waiting=0, kv_usage=0.99)})
        assert router.models() == {"llama": "llama"}
        route = router.route_of("llama")  # proxied to vLLM-shaped servers
        assert (route.proxied, route.vllm, route.migration_limit) == (True, True, 3)
        first = await router.acquire("llama", clock.now + 1)
        assert first.name == a.name  # b's KV cache is full: a, though it has more waiting
        assert first.endpoint == ("10.0.0.1", 8000)
        assert first.served_as == "llama"
        nodes._answered(b, {"llama": Load(running=0, waiting=0, kv_usage=0.1)})
        second = await router.acquire("llama", clock.now + 1)
        assert second.name == b.name  # 4 waiting + 1 leased on a against none on b
        router.release(first)
        router.release(second)
        text = render(router, [("llama", "llama")])
        assert 'vllm:num_requests_waiting{model_name="llama"} 4' in text
        assert 'vllm:num_requests_running{model_name="llama"} 1' in text

        # silent: down only once no probe answered for probe_timeout, then its calls end
        life = a.life
        clock.now += 2.0
        nodes._silent(a, "TimeoutError", refused=False)
        assert a.life is life and not lost
        clock.now += 1.5
        nodes._silent(a, "TimeoutError", refused=False)
        assert a.life is None and lost == [Lost(("10.0.0.1:8000", 1), "down (TimeoutError)")]
        avoid = LostOn(clock)
        avoid.add(second.target, "cut")
        assert second.target in avoid  # not sent back while it may be dead
        with pytest.raises(NoReplica):
            await router.acquire("llama", clock.now, avoid)
        clock.now += 10
        assert second.target not in avoid

        # refused: out of routing at once; an answer brings a node back as a new life
        nodes._silent(b, "ClientConnectorError", refused=True)
        assert router.models() == {}
        nodes._answered(a, {"llama": Load()})
        assert a.life is not None and a.life.address == ("10.0.0.1:8000", 2)
        assert (await router.acquire("llama", clock.now + 1)).name == a.name

    asyncio.run(main())
