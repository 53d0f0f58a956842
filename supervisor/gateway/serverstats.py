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

from engined.supervisor.routing.routes import Routes

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_HELP = {
    "vllm:num_requests_running": "Requests in the model's serving engines' batches.",
    "vllm:num_requests_waiting": "Requests waiting for a place in a batch (engines and gateway).",
    "vllm:kv_cache_usage_perc": "KV cache usage (or batch fill where there is no KV cache), 0..1.",
    "vllm:cache_config_info": "The KV cache's configuration, in labels.",
}


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(routes: Routes, models: Iterable[tuple[str, str]]) -> str:
    """Prometheus text for (model name, group) pairs, with the figures the router knows
    (routing.replicas.group_load; a cluster gateway's summed over its nodes)."""
    rows: dict[str, list[str]] = {name: [] for name in _HELP}
    for model, group in models:
        load = routes.load_of(group)
        running, waiting, usage, info = load.running, load.waiting, load.kv_usage, load.cache
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
