"""`engined --check`'s listing of the resolved fleet: one row per line, each row made of the parts
the keys in it show (spec/keys.py says how and in which row)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engined.supervisor.spec.keys import ENGINE_KEYS, SUPERVISOR_KEYS, Key
from engined.supervisor.spec.model import EngineSpec, FleetSpec, UpstreamsSpec


@dataclass(frozen=True)
class _Row:
    label: str
    engines: str = "any"  # "child": engined's own engines only; "command": command engines only
    when_set: bool = False  # shown only when one of its keys is not at its default


_SUPERVISOR_ROWS = tuple(_Row(label) for label in (
    "http", "gateway", "control_tcp", "control_socket", "runtime_dir", "log_dir",
    "log_rotation", "launcher", "heartbeat", "orphan_timeout", "clients", "kubernetes"
)) + (_Row("memory_budget", when_set=True),)
_ENGINE_ROWS = (
    _Row("command", "command"), _Row("cwd", "command"), _Row("checks", "command"),
    _Row("model", "child"), _Row("backend", "child", when_set=True),
    _Row("python", "child", when_set=True), _Row("gpus"), _Row("restart"), _Row("timeouts"),
    _Row("backoff"), _Row("batch", "child"), _Row("serving"), _Row("on_demand", when_set=True),
    _Row("adapters"), _Row("env"),
)
# which engines each engine row is shown for ("any", "child", "command"): the spec reference
# says from it which engines a key applies to
ENGINE_ROW_KINDS = {row.label: row.engines for row in _ENGINE_ROWS}


def format_fleet(fleet: FleetSpec) -> str:
    """The resolved fleet as `engined --check` prints it."""
    groups = fleet.groups()
    spares = sum(1 for e in fleet.engines if e.standby)
    out = [f"fleet {fleet.source}: {len(groups)} group(s), {len(fleet.engines) - spares} "
           f"replica(s)" + (f" + {spares} standby" if spares else "")]
    out.append("supervisor:")
    out += [f"  {label:<16}{text}"
            for label, text in _rows(fleet.supervisor, SUPERVISOR_KEYS, _SUPERVISOR_ROWS)]
    if fleet.upstreams is not None:
        out[0] = f"fleet {fleet.source}: a cluster gateway, no engines of its own"
        out += _format_upstreams(fleet.upstreams)
        return "\n".join(out) + "\n"
    out.append("engines:")
    for engine in fleet.engines:
        out += _format_engine(engine)
    return "\n".join(out) + "\n"


def _format_upstreams(up: UpstreamsSpec) -> list[str]:
    return ["upstreams:",
            f"  {'nodes':<16}{', '.join(f'{h}:{p}' for h, p in up.nodes)} (every address each "
            f"name resolves to, again every {up.resolve_interval_s:g}s)",
            f"  {'probes':<16}GET /metrics every {up.probe_interval_s:g}s; down after "
            f"{up.probe_timeout_s:g}s without an answer",
            f"  {'api_key_file':<16}{up.api_key_file or 'none (the nodes ask no token)'}",
            f"  {'serving':<16}queue_limit {up.queue_limit}, request_timeout "
            f"{up.request_timeout_s:g}s, migration_limit {up.migration_limit}"]


def _format_engine(e: EngineSpec) -> list[str]:
    kind = "command" if e.is_command else "child"
    rows = [row for row in _ENGINE_ROWS if row.engines in ("any", kind)]
    head = f"  {e.name}  (group {e.group}, rank {e.rank} of {e.replicas})"
    if e.standby:
        head = (f"  {e.name}  (group {e.group}, warm standby {e.rank}: built and heartbeating, "
                f"not routed; takes over a replica that dies)")
    return [head] + [f"    {label:<10}{text}"
                     for label, text in _rows(e, ENGINE_KEYS.values(), rows)]


def _rows(resolved: Any, keys: Iterable[Key], rows: Sequence[_Row]) -> list[tuple[str, str]]:
    """(label, text) of each of `rows` that has something to show, from the keys' values in
    `resolved` (a SupervisorSpec or EngineSpec)."""
    parts: dict[str, list[tuple[str, str]]] = {row.label: [] for row in rows}
    changed: set[str] = set()
    for key in keys:
        shown = key.shown
        if shown is None or shown.row not in parts:
            continue
        value = key.value_in(resolved)
        if value != key.default:
            changed.add(shown.row)
        text = shown.render(value)
        if text is not None:
            parts[shown.row].append((shown.sep, text))
    out = []
    for row in rows:
        found = parts[row.label]
        if found and (not row.when_set or row.label in changed):
            out.append((row.label, found[0][1] + "".join(sep + text for sep, text in found[1:])))
    return out
