"""A cluster gateway's services: the daemon's own (control API, monitoring, upgrade, the state
snapshot; its fleet is empty), composed with a gateway whose router is over node gateways.
What it does its own way: its nodes are resolved and probed beside the fleet, /readyz says
whether a node takes requests, engined_cluster_node_up shows each node, a reload brings a new
node list and token, and a shutdown lets its streams run for their request_timeout."""

from __future__ import annotations

import dataclasses
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from engined.supervisor.cluster.nodes import Nodes
from engined.supervisor.cluster.router import NodeRouter
from engined.supervisor.gateway.upstream import Upstream
from engined.supervisor.lifecycle.clock import SystemClock
from engined.supervisor.routing.replicas import Router
from engined.supervisor.services import Services
from engined.supervisor.spec.model import FleetSpec, UpstreamsSpec
from engined.supervisor.webserver import ApiKey


@dataclass(frozen=True)
class ClusterServices(Services):
    routes: NodeRouter = dataclasses.field(kw_only=True)

    @classmethod
    def gateway_routes(cls, spec: FleetSpec, router: Router, upstream: Upstream,
                       clock: SystemClock) -> NodeRouter:
        """The node gateways `upstreams:` lists; a node found down ends the calls on it (the
        upstream client's, as a lost incarnation does)."""
        assert spec.upstreams is not None, "a cluster gateway's spec has upstreams:"
        nodes = Nodes(spec.upstreams, clock.monotonic, upstream.on_lost,
                      lambda: routes.changed())
        routes = NodeRouter(nodes, clock.monotonic)
        upstream.headers = node_headers(spec.upstreams)
        return routes

    @property
    def nodes(self) -> Nodes:
        return self.routes.nodes

    def background(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {"nodes": self.nodes.run()}

    def reload_routes(self, spec: FleetSpec) -> None:
        """The new node list (resolved at the next round) and the node gateways' token."""
        assert spec.upstreams is not None, "a cluster gateway reloads into a cluster gateway"
        self.nodes.update(spec.upstreams)
        self.upstream.headers = node_headers(spec.upstreams)

    def drain_budget_s(self) -> float:
        """Its streams finish: a request's whole request_timeout."""
        return self.nodes.spec.request_timeout_s

    def readiness(self) -> tuple[int, dict[str, Any]]:
        """Ready while a node takes requests; from a shutdown on, as a fleet's (503)."""
        if self.fleet.stopping:
            return super().readiness()
        return self.nodes.readiness()

    def node_states(self) -> list[tuple[str, bool]]:
        return self.nodes.states()


def node_headers(spec: UpstreamsSpec) -> dict[str, str]:
    """What the cluster gateway sends the node gateways: their token, when they ask one."""
    return ApiKey(spec.api_key_file, "upstreams.api_key_file").headers()


__all__ = ["ClusterServices", "node_headers"]
