"""A cluster gateway (`upstreams:`): engined's gateway with no engines of its own, in front of the
engined gateways of other nodes. Each node is a real daemon whose engine is testkit/commandserver.py
as an `openai: vllm` command engine: its next token is a function of the whole sequence, so a
stream continued on another node from the token ids already delivered is an exact oracle.

On loopback: three nodes, one SIGKILLed (daemon and engines) under a stream, then started again
and used again. In network namespaces (real separate hosts: each node in a namespace of its
own, the cluster gateway in a fourth, the nodes found through a name in the gateway's hosts
file): a node SIGKILLed, and a node whose link is cut (no FIN, no RST: silence), each under a
stream that completes on the other nodes with identical text; the cut node, reconnected, is
used again."""

from __future__ import annotations

import os
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from testkit.clusternet import (
    PROMPT,
    TOKENS,
    Cluster,
    Hosts,
    busy,
    cluster_spec,
    expected,
    kill_node,
    metric,
    moved_stream,
    netns_problem,
    served_by,
)
from testkit.driver import BackgroundStream, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def cluster(short_tmp: Path) -> Iterator[Cluster]:
    c = Cluster(short_tmp)
    try:
        yield c
    finally:
        problems = c.close()
        assert not problems, problems


def test_a_stream_survives_its_node_and_the_node_is_used_again(cluster: Cluster):
    # the nodes ask a token of their clients (the cluster gateway's upstreams.api_key_file),
    # and the cluster gateway another of its own (supervisor.api_key_file)
    node_token, client_token = cluster.root / "node-token", cluster.root / "client-token"
    node_token.write_text("node-secret\n")
    client_token.write_text("client-secret\n")
    ports = [free_port() for _ in range(3)]
    https = [free_port() for _ in range(3)]
    nodes = {f"n{i}": cluster.node(f"n{i}", f"127.0.0.1:{p}", f"127.0.0.1:{h}",
                                   api_key_file=str(node_token))
             for i, (p, h) in enumerate(zip(ports, https))}
    gateway, http = free_port(), free_port()
    spec = cluster_spec(cluster.root / "gw", [f"127.0.0.1:{p}" for p in ports],
                        f"127.0.0.1:{gateway}", f"127.0.0.1:{http}")
    spec["supervisor"]["api_key_file"] = str(client_token)
    spec["upstreams"]["api_key_file"] = str(node_token)
    gw = cluster.daemon("gw", spec, [])
    metrics = f"http://127.0.0.1:{http}/metrics"

    def up(port: int) -> bool:
        return metric(metrics, "engined_cluster_node_up", f'node="127.0.0.1:{port}"') == 1
    gw.wait_for(lambda: all(up(p) for p in ports), 30, "three nodes up")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="client-secret",
                           max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="node-secret",
                      max_retries=0).models.list()
    assert [m.id for m in client.models.list()] == ["fake"]
    done = client.completions.create(model="fake", prompt=PROMPT, max_tokens=12)
    assert done.choices[0].text == expected(PROMPT, 12)
    assert done.model == "fake" and done.usage.completion_tokens == 12

    killed: list[str] = []

    def kill(name: str) -> None:
        killed.append(name)
        kill_node(nodes[name])
    assert moved_stream(client, gw, nodes, kill) == expected(PROMPT, TOKENS)
    assert metric(metrics, "engined_gateway_migrations_total", 'model="fake"') >= 1, \
        gw.stderr_path.read_text()[-3000:]
    index = int(killed[0][1:])
    gw.wait_for(lambda: not up(ports[index]), 30, "the killed node down")

    # the node comes back: up again, and routed to again (least loaded: every node is idle)
    node = nodes[killed[0]]
    node.expect_unclean_exit = False
    node.start()
    node.wait_all_ready()
    gw.wait_for(lambda: up(ports[index]), 30, "the node up again")
    for _ in range(6):
        done = client.completions.create(model="fake", prompt=PROMPT, max_tokens=4)
        assert done.choices[0].text == expected(PROMPT, 4)
    assert served_by(f"http://127.0.0.1:{https[index]}/metrics") >= 1, \
        "the node that came back got no request"

    # SIGTERM: a drain; /readyz 503 at once, the stream in flight finishes, exit 0
    stream = BackgroundStream(client, "fake", PROMPT, TOKENS)
    assert stream.started.wait(60)
    gw.signal(signal.SIGTERM)
    gw.wait_for(lambda: _status(f"http://127.0.0.1:{http}/readyz") == 503, 10, "readyz 503")
    stream.join(120)
    assert stream.text() == expected(PROMPT, TOKENS)
    assert gw.wait_exit() == 0


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


# --- real separate hosts: network namespaces ----------------------------------------------------
def _netns_or_skip() -> None:
    """Without network namespaces skip, except under CI=true, where .ci/run provides them and
    this must run."""
    why = netns_problem()
    if why is not None:
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(why)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    _netns_or_skip()
    h = Hosts(3)
    try:
        h.make()
        yield h
    finally:
        h.remove()


def test_streams_survive_a_killed_node_and_a_cut_link_on_separate_hosts(cluster: Cluster,
                                                                        hosts: Hosts):
    port = 8000  # every node's gateway on the same port, each on its own address
    nodes = {f"n{i}": cluster.node(f"n{i}", f"{hosts.node_address(i)}:{port}",
                                   f"{hosts.node_address(i)}:9400", hosts.exec(ns))
             for i, ns in enumerate(hosts.nodes)}
    gateway, http = 8000, 9400
    spec = cluster_spec(cluster.root / "gw", [f"{Hosts.NODES_NAME}:{port}"],
                        f"10.213.0.2:{gateway}", f"10.213.0.2:{http}")
    gw = cluster.daemon("gw", spec, list(hosts.exec(hosts.gw)))
    metrics = f"http://10.213.0.2:{http}/metrics"

    def up(i: int) -> bool:
        return metric(metrics, "engined_cluster_node_up",
                      f'node="{hosts.node_address(i)}:{port}"') == 1
    gw.wait_for(lambda: all(up(i) for i in range(3)), 60, "the name to resolve to three nodes")
    client = openai.OpenAI(base_url=f"http://10.213.0.2:{gateway}/v1", api_key="none",
                           max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == ["fake"]

    # a node SIGKILLed, daemon and engines: its stream goes on elsewhere
    killed: list[int] = []

    def kill(name: str) -> None:
        killed.append(int(name[1:]))
        kill_node(nodes[name])
    assert moved_stream(client, gw, nodes, kill) == expected(PROMPT, TOKENS)
    gw.wait_for(lambda: not up(killed[0]), 30, "the killed node down")

    # a node's link cut: no FIN, no RST, only silence; its stream goes on elsewhere
    cut: list[int] = []

    def cut_link(name: str) -> None:
        cut.append(int(name[1:]))
        hosts.cut(cut[0])
    alive = {name: node for name, node in nodes.items() if int(name[1:]) not in killed}
    assert moved_stream(client, gw, alive, cut_link) == expected(PROMPT, TOKENS)
    assert metric(metrics, "engined_gateway_migrations_total", 'model="fake"') >= 2
    assert not up(cut[0])

    # the link mended: the node is up again and takes requests again
    hosts.mend(cut[0])
    gw.wait_for(lambda: up(cut[0]), 30, "the mended node up again")
    gw.wait_for(lambda: not busy(alive), 30, "every node idle")
    streams = [BackgroundStream(client, "fake", PROMPT, TOKENS) for _ in range(2)]
    gw.wait_for(lambda: f"n{cut[0]}" in busy(alive), 30, "a request on the mended node")
    for stream in streams:
        stream.join(120)
        assert stream.text() == expected(PROMPT, TOKENS)
