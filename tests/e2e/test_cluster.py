"""A cluster gateway (`upstreams:`): engined's gateway with no engines of its own, in front of the
engined gateways of other nodes. Each node is a real daemon whose engine is tests/commandserver.py
as an `openai: vllm` command engine: its next token is a function of the whole sequence, so a
stream continued on another node from the token ids already delivered is an exact oracle.

On loopback: three nodes, one SIGKILLed (daemon and engines) under a stream, then started again
and used again. In network namespaces (real separate hosts: each node in a namespace of its
own, the cluster gateway in a fourth, the nodes found through a name in the gateway's hosts
file): a node SIGKILLed, and a node whose link is cut (no FIN, no RST: silence), each under a
stream that completes on the other nodes with identical text; the cut node, reconnected, is
used again."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from driver import PYTHON, REPO_ROOT, BackgroundStream, Daemon, build_spec, free_port

sys.path.insert(0, str(REPO_ROOT / "tests"))
from commandserver import next_token  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SERVER = str(REPO_ROOT / "tests" / "commandserver.py")
PROMPT = "a prompt that crosses nodes"
TOKENS = 160
TICK = "0.03"  # seconds per token: a stream runs ~5 s, long enough to lose its node mid-way
NODE_SUPERVISOR = {"heartbeat_interval": "0.2s", "heartbeat_timeout": "3s"}
UPSTREAMS = {"probe_interval": "0.3s", "probe_timeout": "2s", "resolve_interval": "1s"}


def expected(prompt: str, n: int) -> str:
    sequence, out = list(prompt.encode()), []
    for _ in range(n):
        token = next_token(sequence)
        sequence.append(token)
        out.append(token)
    return bytes(out).decode()


def node_engines() -> list[dict[str, Any]]:
    return [{"name": "fake", "replicas": 1,
             "command": [PYTHON, SERVER, "--port", "{port}", "--tick", TICK],
             "port": "auto", "openai": "vllm",
             "progress": {"busy": "fake:num_requests_running",
                          "counter": "fake:generation_tokens"},
             "probe": {"interval": "200ms", "timeout": "1s", "failures": 3},
             "stop_timeout": "2s"}]


def cluster_spec(root: Path, nodes: list[str], gateway: str, http: str) -> dict[str, Any]:
    return {"version": 1,
            "supervisor": {"gateway": gateway, "http": http, "runtime_dir": str(root / "rt")},
            "upstreams": {"nodes": nodes, **UPSTREAMS}}


class Cluster:
    """The node daemons and the cluster gateway's, each stopped by pid at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.daemons: list[Daemon] = []

    def daemon(self, name: str, spec: dict[str, Any], wrapper: list[str]) -> Daemon:
        root = self.root / name
        root.mkdir(exist_ok=True)
        daemon = Daemon(root, spec)
        daemon.wrapper = wrapper
        self.daemons.append(daemon)
        daemon.start()
        return daemon

    def node(self, name: str, gateway: str, http: str, wrapper: tuple[str, ...] = (),
             **supervisor: Any) -> Daemon:
        root = self.root / name
        root.mkdir(exist_ok=True)
        spec = build_spec(root, node_engines(), {**NODE_SUPERVISOR, "gateway": gateway,
                                                 "http": http, **supervisor}, None)
        daemon = self.daemon(name, spec, list(wrapper))
        daemon.wait_all_ready()
        return daemon

    def close(self) -> list[str]:
        problems = []
        for daemon in self.daemons:
            if daemon.alive():
                daemon.spawned_pids()
            code = daemon.stop()
            if code not in (0, None) and not daemon.expect_unclean_exit:
                problems.append(f"engined pid {daemon.pid} exited {code} on SIGTERM")
            for pid in daemon.seen_pids:  # a SIGKILLed node's engines, say
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return problems


def kill_node(node: Daemon) -> None:
    """SIGKILL the node: its daemon and its engines, as a host that dies takes them all."""
    pids = node.spawned_pids()
    node.expect_unclean_exit = True
    node.signal(signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def busy(nodes: dict[str, Daemon]) -> list[str]:
    """The nodes whose engine says it runs a request (its server's gauge, probed)."""
    return [name for name, node in nodes.items() if node.alive() and any(
        (e.get("queue") or {}).get("running") for e in node.engines().values())]


def serving(gw: Daemon, nodes: dict[str, Daemon]) -> str:
    """The node whose engine runs the one request in flight."""
    def find() -> str | None:
        running = busy(nodes)
        return running[0] if len(running) == 1 else None
    return gw.wait_for(find, 30, "one node running the request")


def metric(url: str, name: str, labels: str = "") -> float:
    """A sample's value in Prometheus text at `url` (0 when absent)."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    want = name + ("{" + labels + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def moved_stream(client: openai.OpenAI, gw: Daemon, nodes: dict[str, Daemon],
                 fault: Callable[[str], None]) -> str:
    """A stream that loses its node to `fault(name)` mid-way; its whole text. Started once
    every node says it is idle, so the busy one is the stream's."""
    gw.wait_for(lambda: not busy(nodes), 30, "every node idle")
    stream = BackgroundStream(client, "fake", PROMPT, TOKENS)
    assert stream.started.wait(60), "no first chunk"
    fault(serving(gw, nodes))
    stream.join(120)
    return stream.text()


def served_by(node_metrics: str) -> float:
    return metric(node_metrics, "engined_gateway_requests_total", 'model="fake",outcome="ok"')


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
class Hosts:
    """Namespaces `gw` (the cluster gateway) and `n0`..`n2` (the nodes), each node joined to the
    gateway's namespace by a veth pair of its own (10.213.{i+1}.2 <-> .1), the gateway's joined
    to this one (10.213.0.2 <-> .1) for the test's client. The gateway's namespace has a hosts
    file (ip netns exec puts /etc/netns/NAME/hosts in place of /etc/hosts) in which one name,
    NODES_NAME, resolves to every node: membership from a resolver, as from a headless Service."""

    NODES_NAME = "nodes.engined.test"

    def __init__(self, count: int) -> None:
        tag = f"eg{os.getpid() % 100000}"
        self.gw, self.nodes = f"{tag}gw", [f"{tag}n{i}" for i in range(count)]
        self.root_link, self.gw_links = f"{tag}r", [f"{tag}g{i}" for i in range(count)]
        self.node_links = [f"{tag}v{i}" for i in range(count)]
        self.etc = Path("/etc/netns") / self.gw
        self.made: list[str] = []

    def node_address(self, i: int) -> str:
        return f"10.213.{i + 1}.2"

    def exec(self, ns: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", ns)

    def make(self) -> None:
        for ns in (self.gw, *self.nodes):
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", self.root_link, "type", "veth", "peer", "name", f"{self.root_link}x",
            "netns", self.gw)
        _ip("addr", "add", "10.213.0.1/24", "dev", self.root_link)
        _ip("link", "set", self.root_link, "up")
        _ip("-n", self.gw, "addr", "add", "10.213.0.2/24", "dev", f"{self.root_link}x")
        _ip("-n", self.gw, "link", "set", f"{self.root_link}x", "up")
        for i, ns in enumerate(self.nodes):
            g, v = self.gw_links[i], self.node_links[i]
            _ip("-n", self.gw, "link", "add", g, "type", "veth", "peer", "name", v, "netns", ns)
            _ip("-n", self.gw, "addr", "add", f"10.213.{i + 1}.1/24", "dev", g)
            _ip("-n", self.gw, "link", "set", g, "up")
            _ip("-n", ns, "addr", "add", f"{self.node_address(i)}/24", "dev", v)
            _ip("-n", ns, "link", "set", v, "up")
        self.etc.mkdir(parents=True, exist_ok=True)
        (self.etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{self.node_address(i)} {self.NODES_NAME}\n" for i in range(len(self.nodes))))

    def cut(self, i: int) -> None:
        """The node's link down, on the node's side: the gateway hears nothing more from it."""
        _ip("-n", self.nodes[i], "link", "set", self.node_links[i], "down")

    def mend(self, i: int) -> None:
        _ip("-n", self.nodes[i], "link", "set", self.node_links[i], "up")

    def remove(self) -> None:
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.root_link], capture_output=True, timeout=30)
        shutil.rmtree(self.etc, ignore_errors=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _netns_or_skip() -> None:
    """Network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2: without them
    skip, except under CI=true, where .ci/run provides them and this must run."""
    why = None
    if shutil.which("ip") is None:
        why = "no `ip` command (iproute2)"
    elif os.geteuid() != 0:
        why = "network namespaces need root"
    else:
        probe = f"egprobe{os.getpid()}"
        done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                              timeout=30)
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
        if done.returncode != 0:
            why = f"cannot make a network namespace: {done.stderr.strip()}"
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
