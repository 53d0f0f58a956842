"""The fleet spec reference page, generated from the key table so that it cannot drift:

    python -m engined.supervisor.spec.reference > docs/reference/spec.md

Every fact on the page comes from the code: each key's section, check, default, meaning, type and
example from spec/keys.py; which engines a key applies to from --check's rows (spec/format.py),
and where those do not say, from whether the loader accepts the key on a command engine; what a
reload does with a change from reload.py (its LIVE_SUPERVISOR_KEYS, and for an engine key the
plan it makes for the change the example shows). tests/unit/test_spec_reference.py fails when
the committed page differs from what this prints, and validates every example with the loader.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import yaml

from engined.supervisor.spec import FleetSpec, SpecError, parse_fleet
from engined.supervisor.spec.checks import _fmt_duration
from engined.supervisor.spec.format import ENGINE_ROW_KINDS
from engined.supervisor.spec.keys import KEYS, REQUIRED, Key, Scope, _fmt_bytes
from engined.supervisor.spec.model import UpstreamsSpec
from engined.supervisor.spec.reload import LIVE_SUPERVISOR_KEYS, ReloadPlan, plan_reload
from engined.supervisor.spec.upstreams import _CHECKS as UPSTREAM_CHECKS
from engined.supervisor.spec.upstreams import KEYS as UPSTREAM_KEYS

COMMAND = "python -m engined.supervisor.spec.reference > docs/reference/spec.md"
# the engine an engine key's example is written in: one of engined's own, or a command engine
CHILD_CONTEXT: Mapping[str, Any] = {"name": "tiny", "model": "builtin:tiny-llama"}
COMMAND_CONTEXT: Mapping[str, Any] = {
    "name": "ext", "command": ["vllm", "serve", "/models/llama", "--port", "{port}"],
    "port": "auto"}
APPLIES = {"any": "every engine", "child": "engined's own engines (`model:`) only",
           "command": "command engines (`command:`) only"}

# Which engines a key applies to --------------------------------------------------------------


def applies_to(key: Key) -> str:
    """"any", "child" (engined's own engines) or "command" (command engines): the key table's
    word where it has one, else the row --check shows the key in, else whether the loader takes
    the key's example on a command engine."""
    if key.scope is Scope.COMMAND:
        return "command"
    if key.child_only:
        return "child"
    row = ENGINE_ROW_KINDS.get(key.shown.row) if key.shown is not None else None
    if row in ("child", "command"):
        return row
    return "any" if loads(engine_spec(key, COMMAND_CONTEXT)) else "child"


def where(key: Key) -> str:
    if key.scope is Scope.SUPERVISOR:
        return "`supervisor:`"
    sections = "`defaults:` or an engine" if key.scope is Scope.SETTING else "an engine"
    kind = applies_to(key)
    return sections if kind == "any" else f"{sections}; {APPLIES[kind]}"


# Examples ------------------------------------------------------------------------------------


def _value(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1000)
    return text.removesuffix("\n...\n").strip()


def _line(name: str, value: Any) -> str:
    """`name: value` as a spec writes it (a nested section's key in its flow mapping)."""
    top, dot, sub = name.partition(".")
    if dot:
        return f"{top}: {_value({sub: value})}"
    if isinstance(value, (dict, list)):
        return f"{top}: {_value(value)}"
    return yaml.safe_dump({top: value}, default_flow_style=False, width=1000).strip()


def _written(key: Key) -> dict[str, Any]:
    """The key and the keys that go with it, as {name: value}."""
    return {key.name: key.example, **key.example_with}


def _engine_context(key: Key) -> Mapping[str, Any]:
    return COMMAND_CONTEXT if applies_to(key) == "command" else CHILD_CONTEXT


def _engine_item(entries: Mapping[str, Any], indent: str = "  ") -> str:
    lines = [_line(name, value) for name, value in entries.items()]
    return f"{indent}- " + f"\n{indent}  ".join(lines)


def example(key: Key) -> str:
    """The key's example as the page shows it: in its section, with what must go beside it."""
    if key.scope is Scope.SUPERVISOR or key.scope is Scope.SETTING:
        section = "supervisor" if key.scope is Scope.SUPERVISOR else "defaults"
        return f"{section}:\n" + "\n".join(f"  {_line(n, v)}" for n, v in _written(key).items())
    context = COMMAND_CONTEXT if key.scope is Scope.COMMAND else CHILD_CONTEXT
    return "engines:\n" + _engine_item({**context, **_written(key)})


def example_spec(key: Key) -> str:
    """A whole spec around the example: `version: 1`, and an engine where it shows none (one of
    engined's own, or a command engine for a key only those take)."""
    text = f"version: 1\n{example(key)}\n"
    if key.scope in (Scope.SUPERVISOR, Scope.SETTING):
        text += "engines:\n" + _engine_item(_engine_context(key)) + "\n"
    return text


def engine_spec(key: Key, context: Mapping[str, Any], with_key: bool = True,
                extra: Mapping[str, Any] | None = None) -> str:
    """A spec of one engine: `context`, the key's companions, the key itself (`with_key`)."""
    entries = {**context, **(extra or {}), **key.example_with}
    if with_key:
        entries[key.name] = key.example
    return "version: 1\nengines:\n" + _engine_item(entries) + "\n"


def loads(text: str) -> FleetSpec | None:
    """The spec resolved by the real loader, without the checks that need files on this host
    (an interpreter, a token file, a command's program); None when it is not valid."""
    try:
        return parse_fleet(text, "example.yaml")
    except SpecError:
        return None


# What a reload does with a change ------------------------------------------------------------


def reload_effect(key: Key) -> tuple[str, str]:
    """(short, sentence): what a reload does when this key changes."""
    if key.scope is Scope.SUPERVISOR:
        if key.top in LIVE_SUPERVISOR_KEYS:
            return "live", "applied by a reload"
        return ("engined restart", "not applied by a reload, which reports it in "
                "`restart_required`: restart engined for it")
    context = _engine_context(key)
    plain = _plan_effect(key, context, {})
    dp = _plan_effect(key, context, {"data_parallel": True}) if key.name != "data_parallel" \
        and applies_to(key) != "command" else None
    short, sentence = plain or ("?", "?")
    if dp is not None and dp != plain:
        sentence += ("; a `data_parallel` group restarts as a gang" if dp[0] == "rolling restart"
                     else f"; in a `data_parallel` group: {dp[1]}")
    return short, sentence


def _plan_effect(key: Key, context: Mapping[str, Any],
                 extra: Mapping[str, Any]) -> tuple[str, str] | None:
    new = loads(engine_spec(key, context, extra=extra))
    old = loads(engine_spec(key, context, with_key=False, extra=extra)) or loads(
        engine_spec(Key(key.name, key.scope, key.check, key.field, key.doc, default=key.default),
                    context, with_key=False, extra=extra))
    if new is None or old is None or new.engines == old.engines:
        return None  # nothing to tell from: the test suite fails on a "?" on the page
    return _effect(plan_reload(old, new))


def _effect(plan: ReloadPlan) -> tuple[str, str]:
    if plan.changed:
        return ("rolling restart", "restarts the engine's replicas, `rollout` at a time (a "
                "data-parallel group as a gang)")
    if plan.added and plan.removed:
        return "replaced", "a new engine: the old one's replicas stop, the new one's start"
    if plan.added or plan.removed:
        return ("adds/removes replicas", "adds or removes replicas; the others keep running "
                "untouched")
    return ("next spawn", "applies from each replica's next start; running replicas are left "
            "alone")


# Types and defaults --------------------------------------------------------------------------


def constraint(check: Callable[..., Any]) -> str:
    """The bounds a check was made with (`_int_in(1, 1024)`, `_size(...)`, `_duration(...)`)."""
    try:
        found = inspect.getclosurevars(check).nonlocals
    except TypeError:
        return ""
    if "inner" in found:
        return constraint(found["inner"])
    low, high = found.get("low"), found.get("high")
    if isinstance(low, int) and isinstance(high, int):
        if check.__qualname__.startswith("_size"):
            return f"{_bytes(low)} to {_bytes(high)}"
        return f"{low} to {high}"
    if "positive" in found:
        return "more than 0" if found["positive"] else "0 allowed"
    return ""


def _bytes(n: int) -> str:
    for unit, size in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20),
                       ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n} B"


def type_text(key: Key) -> str:
    bounds = constraint(key.check)
    return f"{key.type} ({bounds})" if bounds else key.type


def default_text(value: Any, kind: str) -> str:
    """A default as a spec would write it, and as `engined --check` shows durations and sizes."""
    if value is REQUIRED:
        return "required"
    if value is None or value == "":
        return "off" if "HOST:PORT" in kind else "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if kind.startswith("duration"):
        return _fmt_duration(value)
    if kind.startswith("size"):
        return _fmt_bytes(value)
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], int):
        return f"{value[0]}:{value[1]}"
    if value == ():
        return "{}" if kind.startswith("mapping") else "[]"
    return f"{value:g}" if isinstance(value, float) else str(value)


# The page ------------------------------------------------------------------------------------

INTRO = f"""# Fleet spec reference

<!-- Generated from supervisor/spec/keys.py by `{COMMAND}`: do not edit by hand.
     tests/unit/test_spec_reference.py fails when this page differs from what it prints. -->

Every key of the fleet spec, generated from the key table engined itself validates with
(`supervisor/spec/keys.py`). `etc/fleet.yaml` is the commented example; `engined -c FILE
--check` prints a spec's resolved values (the **--check row** below names where).

A spec's top level: `version: 1` (required), `supervisor:` (engined's own settings),
`defaults:` (settings every engine takes unless it sets its own), `engines:` (a list, each
with a `name`), or `upstreams:` in place of `engines:` and `defaults:` for a
[cluster gateway](#upstreams).

- **Durations**: `500ms`, `30s`, `10m`, `1h`, or a number of seconds.
- **Sizes**: bytes, or a number with a binary unit: `512K`, `10MiB`, `1G` (`KB`, `KiB`, `MB`,
  `MiB`, `GB`, `GiB` alike).
- **Relative paths** (a model directory, `python`, `runtime_dir`, `log_dir`, `control_socket`,
  the token, certificate and key files, a command's program and `cwd`) resolve against the spec
  file's directory.
- **Where**: the section a key may be written in; an engine's own value wins over `defaults:`.
  Some keys apply only to engined's own engines (`model:`) or only to command engines
  (`command:`, servers engined did not write).
- **Reload** (`enginectl reload`, SIGHUP, `systemctl reload engined`): what applying a changed
  value does. A supervisor key that is not applied live is reported in the reload's
  `restart_required` until engined is restarted.
- **Example**: checked by the test suite with the real spec loader (those under `defaults:`
  with one engine added); paths in them need not exist here.
"""


def _md(text: str) -> str:
    """Plain text for Markdown: `<runtime_dir>` is no HTML tag, `ENGINED_*` no emphasis."""
    return text.replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def anchor(key: Key) -> str:
    name = key.name.replace(".", "-")
    return f"supervisor-{name}" if key.scope is Scope.SUPERVISOR else name


def summary(keys: Iterable[Key]) -> list[str]:
    out = ["| key | type | default | where | reload |", "| --- | --- | --- | --- | --- |"]
    for key in keys:
        out.append(f"| [`{key.name}`](#{anchor(key)}) | {_cell(type_text(key))} | "
                   f"`{default_text(key.default, key.type)}` | {_cell(where(key))} | "
                   f"{reload_effect(key)[0]} |")
    return out


def entry(key: Key) -> list[str]:
    prefix = "supervisor." if key.scope is Scope.SUPERVISOR else ""
    facts = [f"- **Type:** {type_text(key)}",
             f"- **Default:** `{default_text(key.default, key.type)}`",
             f"- **Where:** {where(key)}",
             f"- **Reload:** {reload_effect(key)[1]}"]
    if key.shown is not None:
        facts.append(f"- **--check row:** `{key.shown.row}`")
    doc = _md(key.doc)
    return [f"### `{prefix}{key.name}` {{#{anchor(key)}}}", "", f"{doc}.", "", *facts, "",
            "```yaml", example(key), "```", ""]


SECTIONS = (
    ("supervisor:", "engined's own settings.", (Scope.SUPERVISOR,)),
    ("Engines", "In an engine, and (except `name` and `replicas`) in `defaults:`.",
     (Scope.ENGINE, Scope.SETTING)),
    ("Command engines", "Only in an engine with `command:` (a server engined did not write).",
     (Scope.COMMAND,)),
)

UPSTREAMS = {  # key: (type, meaning); defaults from UpstreamsSpec, bounds from the checks
    "nodes": ("list of `HOST:PORT`", "the node gateways; every address a name resolves to is a "
              "node (a headless Service's records, a host list)"),
    "api_key_file": ("path or `null`", "the bearer token the node gateways ask (their "
                     "`supervisor.api_key_file`'s), when they ask one"),
    "resolve_interval": ("duration", "each name is resolved again this often"),
    "probe_interval": ("duration", "each node's `GET /metrics` (the model server protocol, "
                       "no token) this often"),
    "probe_timeout": ("duration", "no probe answered this long: the node is down and its "
                      "streams move; more than probe_interval"),
    "queue_limit": ("integer", "requests per model here, in flight or waiting; more -> 429"),
    "request_timeout": ("duration", "a request's whole life, moves included; past it -> 503"),
    "migration_limit": ("integer", "times a request may move to another node"),
}
UPSTREAMS_EXAMPLE = """version: 1
supervisor:
  gateway: 0.0.0.0:8000
upstreams:
  nodes: ["engined-nodes.inference.svc.cluster.local:8000", "10.0.0.7:8000"]
  probe_timeout: 5s
  api_key_file: /etc/engined/node-api-key"""


def upstreams_section() -> list[str]:
    out = ["## upstreams: {#upstreams}", "",
           "A cluster gateway: `upstreams:` in place of `engines:` (no `defaults:`), with "
           "`supervisor.gateway` set. A reload re-reads this section.", "",
           "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name in UPSTREAM_KEYS:
        kind, meaning = UPSTREAMS[name]
        field, check = UPSTREAM_CHECKS.get(name, (name, None))
        bounds = constraint(check) if check is not None else ""
        default = REQUIRED if name == "nodes" else getattr(UpstreamsSpec, field)
        out.append(f"| `{name}` | {_cell(kind)}{f' ({bounds})' if bounds else ''} | "
                   f"`{default_text(default, kind)}` | {_cell(_md(meaning))} |")
    return out + ["", "```yaml", UPSTREAMS_EXAMPLE, "```", ""]


def render() -> str:
    out = [INTRO, "## Every key", "", *summary(KEYS), ""]
    for title, text, scopes in SECTIONS:
        out += [f"## {title}", "", text, ""]
        for key in (k for k in KEYS if k.scope in scopes):
            out += entry(key)
    out += upstreams_section()
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
