"""The `upstreams:` section: a cluster gateway's node gateways, in place of `engines:`.

    upstreams:
      nodes: ["engined-nodes.inference.svc.cluster.local:8000", "10.0.0.7:8000"]
      resolve_interval: 10s     # names are resolved again this often (membership changes)
      probe_interval: 1s        # each node's GET /metrics (the model server protocol)
      probe_timeout: 3s         # no answer this long: the node is down, its streams move
      api_key_file: /etc/engined/node-api-key   # the node gateways' bearer token, if they ask one
      queue_limit: 1024
      request_timeout: 600s
      migration_limit: 3
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engined.supervisor.spec.checks import (
    _any_bad,
    _duration,
    _int_in,
    _mapping,
    _parse_host_port,
    _Problems,
    _unknown_keys,
)
from engined.supervisor.spec.model import UpstreamsSpec
from engined.supervisor.spec.source import _describe

_CHECKS = {
    "resolve_interval": ("resolve_interval_s", _duration(True)),
    "probe_interval": ("probe_interval_s", _duration(True)),
    "probe_timeout": ("probe_timeout_s", _duration(True)),
    "queue_limit": ("queue_limit", _int_in(1, 1 << 20)),
    "request_timeout": ("request_timeout_s", _duration(True)),
    "migration_limit": ("migration_limit", _int_in(0, 100)),
}
KEYS = ("nodes", "api_key_file", *_CHECKS)


def upstreams(problems: _Problems, raw: Any) -> UpstreamsSpec | None:
    """The section, checked (every problem named by its path); None when it is not valid."""
    section = _mapping(problems, raw, "upstreams", null_ok=False)
    if section is None:
        return None
    _unknown_keys(problems, section, "upstreams", KEYS)
    nodes = _nodes(problems, section)
    values: dict[str, Any] = {}
    for key, (field, check) in _CHECKS.items():
        if key in section:
            values[field] = check(problems, section[key], f"upstreams.{key}")
    key_file = section.get("api_key_file")
    if key_file is not None:
        if not isinstance(key_file, str) or not key_file.strip():
            values["api_key_file"] = problems.add("upstreams.api_key_file",
                                                  f"must be a file's path, got "
                                                  f"{_describe(key_file)}")
        else:
            values["api_key_file"] = key_file
    interval = values.get("probe_interval_s", UpstreamsSpec.probe_interval_s)
    timeout = values.get("probe_timeout_s", UpstreamsSpec.probe_timeout_s)
    if not _any_bad(interval, timeout) and timeout <= interval:
        problems.add("upstreams.probe_timeout", f"must exceed probe_interval ({interval:g}s): "
                                                f"a node is down after probes it missed")
    if nodes is None or _any_bad(*values.values()):
        return None
    return UpstreamsSpec(nodes=nodes, **values)


def _nodes(problems: _Problems, section: Mapping[str, Any]) -> tuple[tuple[str, int], ...] | None:
    raw = section.get("nodes")
    if not isinstance(raw, list) or not raw:
        got = "it is missing" if "nodes" not in section else f"got {_describe(raw)}"
        problems.add("upstreams.nodes", f"must be a non-empty list of node gateways "
                                        f"('HOST:PORT', a name resolving to every node); {got}")
        return None
    out: list[tuple[str, int]] = []
    for i, item in enumerate(raw):
        path = f"upstreams.nodes[{i}]"
        if not isinstance(item, str):
            problems.add(path, f"must be 'HOST:PORT', got {_describe(item)}")
            continue
        try:
            address = _parse_host_port(item.strip())
        except ValueError as exc:
            problems.add(path, f"invalid address {item!r}: {exc}")
            continue
        if address in out:
            problems.add(path, f"{item!r} is listed twice")
            continue
        out.append(address)
    return tuple(out) if len(out) == len(raw) else None


__all__ = ["KEYS", "upstreams"]
