"""The cluster gateway's router (the gateway's Routes, as routing.replicas is over replicas): a
model is a group, a node's life is what a lease is on.

* **Routing**: among the up nodes serving the model, those with room in their KV cache first,
  then the fewest waiting requests plus this gateway's own in flight there, round-robin among
  equals.
* **Moves**: the node gateways are spoken to as `openai: vllm` servers (gateway.proxy): they
  return the token ids of the prompt and of each token (`return_token_ids`), so a stream cut
  mid-way continues on another node from the tokens already delivered.
"""

from __future__ import annotations

from collections.abc import Callable, Container

from engined.supervisor.cluster.nodes import Life, Node, Nodes, url_host
from engined.supervisor.routing.routes import BaseRouter, GroupLoad, Lease, Route
from engined.supervisor.spec.model import UpstreamsSpec

KV_FULL = 0.95  # a node's KV cache this full is chosen only when every node's is
RECHECK_S = 0.5  # a waiting request looks again this often (the probes announce changes)


class NodeRouter(BaseRouter):
    def __init__(self, nodes: Nodes, clock: Callable[[], float]) -> None:
        super().__init__(clock)
        self.nodes = nodes
        self._route: tuple[UpstreamsSpec, Route] | None = None  # (the spec it was made from)

    def models(self) -> dict[str, str]:
        """Every model an up node serves, by the name its clients use."""
        return {m: m for node in self.nodes.nodes.values() if node.routable()
                for m in node.loads}

    def route_of(self, group: str) -> Route:
        """The same for every model: `upstreams:`'s limits, to vLLM-shaped servers."""
        up = self.nodes.spec
        if self._route is None or self._route[0] is not up:
            self._route = (up, Route(up.queue_limit, up.request_timeout_s, up.migration_limit,
                                     proxied=True, vllm=True))
        return self._route[1]

    def pick(self, group: str, avoid: Container[object] = ()) -> Lease | None:
        candidates = [(node, node.life) for node in self.nodes.nodes.values()
                      if node.life is not None and node.routable() and group in node.loads
                      and node.life not in avoid]
        if not candidates:
            return None

        def key(pair: tuple[Node, Life]) -> tuple[bool, int]:
            node, life = pair
            load = node.loads[group]
            return load.kv_usage >= KV_FULL, load.waiting + self._load[life]

        node, life = self.least(candidates, key)
        self._load[life] += 1
        # a node gateway serves the model by the name its clients use
        return Lease(node.name, life, (url_host(life.host), life.port), served_as=group)

    async def acquire(self, group: str, deadline: float,
                      avoid: Container[object] = ()) -> Lease:
        return await self.wait_for(
            lambda: self.pick(group, avoid), deadline,
            f"no node serving '{group}' could take the request in time", RECHECK_S)

    def peers(self, lease: Lease) -> list[tuple[str, int]]:
        return []  # a node gateway wakes its own data-parallel ranks

    def load_of(self, group: str) -> GroupLoad:
        """Summed over the up nodes (KV usage: their mean), plus what waits here for one."""
        loads = [n.loads[group] for n in self.nodes.nodes.values()
                 if n.routable() and group in n.loads]
        waiting = sum(x.waiting for x in loads) + max(0, self.queued[group] - sum(
            self._load[n.life] for n in self.nodes.nodes.values() if n.life is not None))
        usage = sum(x.kv_usage for x in loads) / len(loads) if loads else 0.0
        return GroupLoad(sum(x.running for x in loads), waiting, usage)


__all__ = ["KV_FULL", "NodeRouter"]
