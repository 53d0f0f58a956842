"""The cluster gateway's test hosts (tests/e2e/test_cluster.py, bench/cluster.py): node daemons
whose engine is testkit/commandserver.py as an `openai: vllm` command engine (its next token is a
function of the whole sequence: an exact oracle for a stream continued on another node), the
cluster gateway's daemon, and real separate hosts in network namespaces."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai

from testkit.commandserver import next_token
from testkit.driver import PYTHON, REPO_ROOT, BackgroundStream, Daemon, build_spec

SERVER = str(REPO_ROOT / "testkit" / "commandserver.py")
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


def node_engines(tick: str = TICK) -> list[dict[str, Any]]:
    return [{"name": "fake", "replicas": 1,
             "command": [PYTHON, SERVER, "--port", "{port}", "--tick", tick],
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
        self.killed: list[int] = []  # processes left after their daemon's stop, killed by pid

    def daemon(self, name: str, spec: dict[str, Any], wrapper: list[str]) -> Daemon:
        root = self.root / name
        root.mkdir(exist_ok=True)
        daemon = Daemon(root, spec)
        daemon.wrapper = wrapper
        self.daemons.append(daemon)
        daemon.start()
        return daemon

    def node(self, name: str, gateway: str, http: str, wrapper: tuple[str, ...] = (),
             tick: str = TICK, **supervisor: Any) -> Daemon:
        root = self.root / name
        root.mkdir(exist_ok=True)
        spec = build_spec(root, node_engines(tick), {**NODE_SUPERVISOR, "gateway": gateway,
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
                if _alive(pid):
                    self.killed.append(pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        return problems


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


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

    def route_to_nodes(self) -> None:
        """This namespace reaches the nodes through the gateway's (which forwards), as a
        client talking to a node's gateway directly would, one hop fewer."""
        subprocess.run([*self.exec(self.gw), "sysctl", "-qw", "net.ipv4.ip_forward=1"],
                       check=True, capture_output=True, timeout=30)
        for i, ns in enumerate(self.nodes):
            _ip("-n", ns, "route", "add", "default", "via", f"10.213.{i + 1}.1")
            _ip("route", "add", f"10.213.{i + 1}.0/24", "via", "10.213.0.2")

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


def netns_problem() -> str | None:
    """Why network namespaces cannot be made here (they need root: CAP_SYS_ADMIN and
    CAP_NET_ADMIN, and iproute2), or None."""
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
    return why
