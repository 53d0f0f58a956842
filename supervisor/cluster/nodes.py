"""A cluster gateway's nodes: membership and probes.

* **Membership** is what names resolve to: each `upstreams.nodes` entry is `HOST:PORT`, and
  every address its host resolves to is a node (a Kubernetes headless Service's A records, a
  hosts file, a plain IP), resolved again every `resolve_interval`. A node whose address is no
  longer returned takes no new request; the requests on it finish.
* **Health and load** come from each node gateway's model server protocol (`GET /metrics`,
  which asks no token): its models, their waiting and running requests and KV cache usage,
  probed every `probe_interval`. A node is up from a probe that answered; it is down when no
  probe answered for `probe_timeout` (a node that died, hung, or whose link was cut: no FIN,
  no RST, only silence), and every request on it moves then, as a request on a lost engine
  moves between replicas. A probe refused outright (a closed port) takes it out of routing at
  once. A node that answers again is a new life of it, routed to as any other.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from engined.supervisor.lifecycle.notices import Lost
from engined.supervisor.spec.model import UpstreamsSpec

log = logging.getLogger("engined.cluster")

_SAMPLE_RE = re.compile(r'^(vllm:[a-z_]+)\{[^}]*model_name="((?:[^"\\]|\\.)*)"[^}]*\}\s+(\S+)',
                        re.M)


@dataclass(frozen=True)
class Load:
    """What a node's gateway said of one model at its last probe."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


def parse_loads(text: str) -> dict[str, Load]:
    """Model name -> Load from a node gateway's model server protocol text."""
    raw: dict[str, dict[str, float]] = {}
    for name, model, value in _SAMPLE_RE.findall(text):
        try:
            number = float(value)
        except ValueError:
            continue
        raw.setdefault(model.replace('\\"', '"').replace("\\\\", "\\"), {})[name] = number
    return {model: Load(int(v.get("vllm:num_requests_running", 0)),
                        int(v.get("vllm:num_requests_waiting", 0)),
                        float(v.get("vllm:kv_cache_usage_perc", 0.0)))
            for model, v in raw.items()}


@dataclass(eq=False)
class Life:
    """One life of a node, from the probe that found it up to the one that found it down: the
    routing identity of the requests on it (an incarnation, for the gateway's proxy)."""

    address: tuple[str, int]  # (the node's name, its life's number)
    host: str
    port: int
    avoid_after_loss_s: float  # a request lost on it is not sent back while it may be dead


@dataclass(eq=False)
class Node:
    """One node gateway, at one address."""

    host: str
    port: int
    listed_as: str  # the `upstreams.nodes` entry it was found by
    life: Life | None = None  # up: its current life
    lives: int = 0
    loads: dict[str, Load] = field(default_factory=dict)
    answered_at: float | None = None  # monotonic: its last probe that answered
    refused: bool = False  # its last probe was refused: no new request until one answers
    why: str = "not probed yet"
    listed: bool = True  # its name still resolves to it
    probing: bool = False

    @property
    def name(self) -> str:
        return f"{url_host(self.host)}:{self.port}"

    def routable(self) -> bool:
        return self.life is not None and self.listed and not self.refused


class Nodes:
    """Membership and probes; `on_lost(Lost)` ends the calls in flight on a node's life."""

    def __init__(self, spec: UpstreamsSpec, clock: Callable[[], float],
                 on_lost: Callable[[Lost], None], on_change: Callable[[], None]) -> None:
        self.spec, self.clock, self.on_lost, self.on_change = spec, clock, on_lost, on_change
        self.nodes: dict[tuple[str, int], Node] = {}
        self._session: aiohttp.ClientSession | None = None
        self._resolved_at = float("-inf")
        self.resolve_errors: dict[str, str] = {}  # entry -> why it did not resolve

    def update(self, spec: UpstreamsSpec) -> None:
        """A reload: the new list is resolved at the next round."""
        self.spec, self._resolved_at = spec, float("-inf")

    async def run(self) -> None:
        """Resolve and probe until cancelled."""
        try:
            while True:
                if self.clock() - self._resolved_at >= self.spec.resolve_interval_s:
                    self._resolved_at = self.clock()
                    await self.resolve()
                for node in list(self.nodes.values()):
                    if not node.probing:
                        node.probing = True
                        asyncio.get_running_loop().create_task(self._probe(node))
                await asyncio.sleep(self.spec.probe_interval_s)
        finally:
            if self._session is not None:
                await self._session.close()

    async def resolve(self) -> None:
        """Every address each entry's host resolves to is a node."""
        loop = asyncio.get_running_loop()
        found: dict[tuple[str, int], str] = {}
        for host, port in self.spec.nodes:
            entry = f"{host}:{port}"
            try:
                infos = await asyncio.wait_for(
                    loop.getaddrinfo(host, port, type=socket.SOCK_STREAM),
                    self.spec.probe_timeout_s)
            except (OSError, asyncio.TimeoutError) as exc:
                why = f"{type(exc).__name__}: {exc}"
                if self.resolve_errors.get(entry) != why:
                    log.warning("[cluster] %s does not resolve: %s", entry, why)
                self.resolve_errors[entry] = why
                # its nodes stay as they were: a resolver's hiccup is not a membership change
                found.update({a: n.listed_as for a, n in self.nodes.items()
                              if n.listed_as == entry})
                continue
            self.resolve_errors.pop(entry, None)
            for info in infos:
                found.setdefault((str(info[4][0]), port), entry)
        for address, entry in found.items():
            node = self.nodes.get(address)
            if node is None:
                self.nodes[address] = Node(address[0], address[1], entry)
                log.info("[cluster] node %s:%d (from %s)", address[0], address[1], entry)
            elif not node.listed:
                node.listed = True
                self.on_change()
        for address, node in list(self.nodes.items()):
            if address not in found and node.listed:
                node.listed = False
                log.info("[cluster] node %s is no longer listed by %s: no new request goes "
                         "to it", node.name, node.listed_as)
                self.on_change()
            if not node.listed and node.life is None:
                del self.nodes[address]

    def states(self) -> list[tuple[str, bool]]:
        """(node, whether it takes requests) by name: engined_cluster_node_up."""
        return [(n.name, n.routable()) for n in sorted(self.nodes.values(), key=lambda n: n.name)]

    def readiness(self) -> tuple[int, dict[str, Any]]:
        """/readyz: 200 while a node takes requests."""
        listed = {n.name: "up" if n.routable() else n.why or "down" for n in self.nodes.values()}
        up = sum(1 for state in listed.values() if state == "up")
        return (200 if up else 503), {"status": "ready" if up else "not ready", "nodes": listed,
                                      "unresolved": self.resolve_errors}

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True))
        return self._session

    async def _probe(self, node: Node) -> None:
        timeout = self.spec.probe_timeout_s
        try:
            session = self.session()
            async with session.get(f"http://{url_host(node.host)}:{node.port}/metrics",
                                   timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                text = await response.text()
                if response.status != 200:
                    raise ValueError(f"GET /metrics: HTTP {response.status}")
            self._answered(node, parse_loads(text))
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
            self._silent(node, f"{type(exc).__name__}: {exc}" if str(exc) else
                         f"no answer to GET /metrics within {timeout:g}s"
                         if isinstance(exc, asyncio.TimeoutError) else type(exc).__name__,
                         refused=isinstance(exc, aiohttp.ClientConnectorError))
        finally:
            node.probing = False

    def _answered(self, node: Node, loads: dict[str, Load]) -> None:
        node.answered_at, node.loads, node.why = self.clock(), loads, ""
        changed = node.refused
        node.refused = False
        if node.life is None:
            node.lives += 1
            node.life = Life((node.name, node.lives), node.host, node.port,
                             self.spec.probe_timeout_s + self.spec.probe_interval_s)
            log.info("[cluster] node %s is up (life %d): %s", node.name, node.lives,
                     ", ".join(sorted(loads)) or "no model")
            changed = True
        if changed:
            self.on_change()

    def _silent(self, node: Node, why: str, refused: bool) -> None:
        node.why = why
        if refused and not node.refused and node.life is not None:
            log.warning("[cluster] node %s refused its probe (%s): no new request until it "
                        "answers", node.name, why)
        node.refused = refused
        quiet_for = self.clock() - (node.answered_at or float("-inf"))
        if node.life is not None and quiet_for >= self.spec.probe_timeout_s:
            life, node.life = node.life, None
            log.warning("[cluster] node %s is down: no probe answered for %.1fs (%s); its "
                        "requests move", node.name, min(quiet_for, 1e9), why)
            self.on_lost(Lost(life.address, f"down ({why})"))
            self.on_change()


def url_host(host: str) -> str:
    """A host as a URL names it (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


__all__ = ["Life", "Load", "Node", "Nodes", "parse_loads", "url_host"]
