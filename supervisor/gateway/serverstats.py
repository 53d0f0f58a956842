"""The model server protocol on the gateway's port: `GET /metrics` there says, per model, what
the Gateway API Inference Extension's endpoint picker reads from a vLLM server to choose an
endpoint (and what vLLM's own `/metrics` names them):

* `vllm:num_requests_running`: requests the model's serving replicas are computing (their
  heartbeats; a command engine's from its own metrics, or engined's requests on it);
* `vllm:num_requests_waiting`: requests queued in those engines plus those the gateway has
  admitted and not yet handed to a replica;
* `vllm:kv_cache_usage_perc`: 0..1, the mean over the serving replicas of vLLM's KV cache usage
  where the engine reports it, else of its batch fill (running over its batch limit);
* `vllm:cache_config_info`: 1, labelled with the KV cache's `block_size` and `num_gpu_blocks`
  where the engine said them.

Each sample is labelled `model_name` (the served model name), as vLLM labels its own. No bearer
token is asked for `/metrics`, as vLLM asks none. On a replica's own port
(`supervisor.replica_ports`) the figures are that replica's alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from engined.engine import protocol as proto
from engined.supervisor.lifecycle.incarnation import Incarnation
from engined.supervisor.lifecycle.replica import Replica
from engined.supervisor.routing import PINNED, Router

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_HELP = {
    "vllm:num_requests_running": "Requests in the model's serving engines' batches.",
    "vllm:num_requests_waiting": "Requests waiting for a place in a batch (engines and gateway).",
    "vllm:kv_cache_usage_perc": "KV cache usage (or batch fill where there is no KV cache), 0..1.",
    "vllm:cache_config_info": "The KV cache's configuration, in labels.",
}


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _beat(inc: Incarnation) -> proto.Heartbeat | None:
    return inc.vitals.heartbeat if inc.vitals is not None else None


def _fill(replica: Replica, inc: Incarnation) -> float:
    hb = _beat(inc)
    if hb is None:
        return 0.0
    if hb.kv_cache_usage is not None:
        return min(1.0, max(0.0, hb.kv_cache_usage))
    limit = hb.batch_limit or replica.spec.max_batch_size
    return min(1.0, hb.running / limit) if limit > 0 else 0.0


def model_stats(router: Router, group: str) -> tuple[int, int, float, dict[str, float]]:
    """running, waiting, KV usage (0..1) and KV cache info of one group's serving replicas."""
    pinned = PINNED.get()  # a replica's own port (supervisor.replica_ports): that replica's
    members = [r for r in router.replicas()
               if r.spec.group == group and pinned in (None, r.spec.name)]
    serving = [(r, inc) for r in members if not r.standby and (inc := r.serving()) is not None]
    beats = [hb for _, inc in serving if (hb := _beat(inc)) is not None]
    running = sum(hb.running for hb in beats)
    leased = sum(router.load(r) for r in members)
    waiting = sum(hb.waiting for hb in beats)
    if pinned is None:  # what the gateway admitted and has not placed yet
        waiting += max(0, router.queued[group] - leased)
    usage = sum(_fill(r, inc) for r, inc in serving) / len(serving) if serving else 0.0
    info: dict[str, float] = {}
    for _, inc in serving:
        ready = inc.vitals.ready if inc.vitals is not None else None
        if ready is not None and ready.cache:
            info = dict(ready.cache)
            break
    return running, waiting, usage, info


def render(router: Router, models: Iterable[tuple[str, str]]) -> str:
    """Prometheus text for (model name, group) pairs."""
    rows: dict[str, list[str]] = {name: [] for name in _HELP}
    for model, group in models:
        known = router.stats_of(group)  # a cluster gateway's, summed over its nodes
        running, waiting, usage, info = (*known, {}) if known else model_stats(router, group)
        label = f'model_name="{_label(model)}"'
        rows["vllm:num_requests_running"].append(f"{{{label}}} {running}")
        rows["vllm:num_requests_waiting"].append(f"{{{label}}} {waiting}")
        rows["vllm:kv_cache_usage_perc"].append(f"{{{label}}} {usage:.6g}")
        extra = "".join(f',{k}="{v:.0f}"' for k, v in sorted(info.items()))
        rows["vllm:cache_config_info"].append(f"{{{label}{extra}}} 1")
    lines: list[str] = []
    for name, samples in rows.items():
        lines += [f"# HELP {name} {_HELP[name]}", f"# TYPE {name} gauge"]
        lines += [name + sample for sample in samples]
    return "\n".join(lines) + "\n"
