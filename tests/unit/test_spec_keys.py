"""The spec key table (supervisor/spec/keys.py) against what is derived from it or must agree with
it: etc/fleet.yaml documents every key, each key fills a real field, and --check has a row for
every key it shows."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from engined.supervisor.spec import EngineSpec, SupervisorSpec, parse_fleet
from engined.supervisor.spec.format import _ENGINE_ROWS, _SUPERVISOR_ROWS
from engined.supervisor.spec.keys import ALLOWED, HINTS, KEYS, REQUIRED, Key, Scope, fill

REPO = Path(__file__).resolve().parents[2]
FLEET = REPO / "etc" / "fleet.yaml"
# a key's line, commented out or not: `  name: value  # what it means`
_KEY_LINE = re.compile(r"^\s*(?:#\s*)?(?:-\s+)?([a-z_]+):(.*)$")
_SECTIONS = {"supervisor": "supervisor", "defaults": "defaults", "engines": "engine"}
# EngineSpec fields resolution fills, not a key: the replica's own name, rank and standby role
_RESOLVED_ONLY = {"name", "rank", "standby"}


def documented(text: str) -> dict[str, dict[str, str]]:
    """{section: {key: the rest of its line}} for each key line in etc/fleet.yaml's supervisor:,
    defaults: and engines: sections, commented-out example lines included."""
    found: dict[str, dict[str, str]] = {section: {} for section in _SECTIONS.values()}
    section, above = None, ""
    for line in text.splitlines():
        match = _KEY_LINE.match(line)
        if line and not line[0].isspace() and not line.startswith("#"):
            section = _SECTIONS.get(line.split(":")[0])
        elif section is not None and match:
            # a comment on the line right above counts as the key's documentation too
            found[section].setdefault(match.group(1), match.group(2) + above)
        above = "  # (above)" if line.lstrip().startswith("#") and not match else ""
    return found


def _is_documented(key: Key, docs: dict[str, dict[str, str]]) -> bool:
    for section in key.scope.sections:
        rest = docs[section].get(key.top)
        if rest is None or "#" not in rest:
            continue  # not there, or there without a word on what it means
        if key.name == key.top:
            return True
        value = rest.split("#")[0]  # a nested key is written in its section's flow mapping
        if re.search(rf"[{{,]\s*{re.escape(key.name[len(key.top) + 1:])}:", value):
            return True
    return False


@pytest.mark.parametrize("key", KEYS, ids=[f"{k.scope.value}:{k.name}" for k in KEYS])
def test_every_key_is_documented_in_the_shipped_fleet_file(key: Key) -> None:
    docs = documented(FLEET.read_text())
    assert _is_documented(key, docs), (
        f"etc/fleet.yaml does not document {key.name!r} (a line `{key.top}: ...  # meaning` "
        f"under {' or '.join(key.scope.sections)}; commented out if it is only an example)")


def test_the_fleet_file_documents_no_unknown_key() -> None:
    for section, keys in documented(FLEET.read_text()).items():
        unknown = sorted(set(keys) - set(ALLOWED[section]))
        assert not unknown, f"etc/fleet.yaml's {section} section documents unknown keys {unknown}"


def test_the_fleet_file_still_loads_with_its_examples_uncommented() -> None:
    """The commented-out lines are keys as they would be written: uncommented, the spec holds."""
    text = re.sub(r"(?m)^(\s*)# (- name: |  [a-z_]+: |[a-z_]+: )", r"\1\2", FLEET.read_text())
    fleet = parse_fleet(text, "fleet.yaml")
    assert {e.group for e in fleet.engines} == {"tiny", "ext"}
    assert fleet.engine("tiny-0").launcher == "exec"


def _field_owner(owner: type, path: str) -> type:
    """The dataclass holding the last field of `path`, after checking every step exists."""
    *heads, last = path.split(".")
    for head in heads:
        owner = type(next(f for f in dataclasses.fields(owner) if f.name == head).default)
    assert last in {f.name for f in dataclasses.fields(owner)}, f"{owner.__name__} has no {last}"
    return owner


def test_each_key_fills_a_field_of_its_dataclass_and_each_field_has_a_key() -> None:
    filled: dict[type, set[str]] = {SupervisorSpec: set(), EngineSpec: set()}
    for key in KEYS:
        if key.field is None:
            assert key.default is not REQUIRED, key.name
            continue
        _field_owner(key.owner, key.field)
        filled[key.owner].add(key.field.split(".")[0])
    assert filled[SupervisorSpec] == {f.name for f in dataclasses.fields(SupervisorSpec)}
    assert filled[EngineSpec] | _RESOLVED_ONLY == {f.name for f in dataclasses.fields(EngineSpec)}


def test_defaults_are_the_fields_defaults() -> None:
    by_name = {(k.scope, k.name): k for k in KEYS}
    assert by_name[Scope.SETTING, "queue_limit"].default == EngineSpec.queue_limit == 256
    assert by_name[Scope.SETTING, "backoff.initial"].default == 1.0
    assert by_name[Scope.SUPERVISOR, "http"].default == ("127.0.0.1", 9400)
    assert by_name[Scope.SETTING, "launcher"].default is None  # the supervisor's
    assert fill(SupervisorSpec, {}) == SupervisorSpec()
    backoff = fill(EngineSpec, {"name": "a-0", "group": "a", "rank": 0, "replicas": 1,
                                "model": None, "backoff.max_s": 5.0}).backoff
    assert (backoff.initial_s, backoff.max_s) == (1.0, 5.0)


def test_key_names_are_unique_where_they_may_be_written() -> None:
    for section in ALLOWED:
        names = [k.name for k in KEYS if section in k.scope.sections]
        assert len(names) == len(set(names)), section


def test_check_has_a_row_for_every_key_it_shows() -> None:
    rows = {Scope.SUPERVISOR: {r.label for r in _SUPERVISOR_ROWS}}
    engine_rows = {r.label for r in _ENGINE_ROWS}
    for key in KEYS:
        if key.shown is not None:  # it shows the value of the field it fills
            assert key.field is not None and key.shown.row in rows.get(key.scope, engine_rows), \
                key.name


def test_a_misplaced_key_is_told_where_it_belongs() -> None:
    assert HINTS["defaults"]["http"].endswith("belongs under supervisor: (it is engined's own "
                                              "setting)")
    assert HINTS["defaults"]["port"] == "'port' can only be set per engine, not in defaults"
    assert HINTS["supervisor"]["backoff"].startswith("'backoff' is an engine setting")
    assert HINTS["supervisor"]["name"] == "'name' is set per engine, under engines:"
    assert "launcher" not in HINTS["defaults"] and "launcher" not in HINTS["supervisor"]
    assert set(HINTS["engine"]) == set(ALLOWED["supervisor"]) - {"launcher"}
