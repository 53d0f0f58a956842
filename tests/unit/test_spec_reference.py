"""The spec reference page (docs/reference/spec.md) is what its generator prints from the key
table now, and every example on it holds under the real spec loader."""

from __future__ import annotations

from pathlib import Path

import pytest

from engined.supervisor.spec import parse_fleet
from engined.supervisor.spec.keys import KEYS, Key
from engined.supervisor.spec.reference import (
    COMMAND,
    UPSTREAMS,
    UPSTREAMS_EXAMPLE,
    anchor,
    example_spec,
    reload_effect,
    render,
    type_text,
)
from engined.supervisor.spec.upstreams import KEYS as UPSTREAM_KEYS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "spec.md"
_IDS = [f"{k.scope.value}:{k.name}" for k in KEYS]


def test_the_committed_page_is_what_the_generator_prints() -> None:
    assert PAGE.read_text() == render(), (
        f"docs/reference/spec.md is stale: regenerate it with `{COMMAND}`")


@pytest.mark.parametrize("key", KEYS, ids=_IDS)
def test_every_key_has_its_type_and_example(key: Key) -> None:
    assert key.type, f"{key.name}: give the key a type= text (what a reader writes)"
    assert key.example is not None, f"{key.name}: give the key an example= value"
    assert f"{{#{anchor(key)}}}" in PAGE.read_text()


@pytest.mark.parametrize("key", KEYS, ids=_IDS)
def test_every_example_holds_under_the_spec_loader(key: Key) -> None:
    """Parsed without the checks that need files here: the example's paths are a host's."""
    fleet = parse_fleet(example_spec(key), "example.yaml")
    assert fleet.engines


@pytest.mark.parametrize("key", KEYS, ids=_IDS)
def test_every_key_says_what_a_reload_does(key: Key) -> None:
    """An engine key's example must change the resolved engine, or the reload planner has
    nothing to say about it."""
    short, sentence = reload_effect(key)
    assert "?" not in (short, sentence), f"{key.name}: its example changes nothing"


@pytest.mark.parametrize("key", [k for k in KEYS if k.type in ("integer", "duration", "size")],
                         ids=lambda k: k.name)
def test_bounds_are_read_from_the_checks(key: Key) -> None:
    assert type_text(key) != key.type, f"{key.name}: its check's bounds were not found"


def test_the_upstreams_section_covers_every_key_and_its_example_holds() -> None:
    assert set(UPSTREAMS) == set(UPSTREAM_KEYS)
    fleet = parse_fleet(UPSTREAMS_EXAMPLE, "example.yaml")
    assert fleet.upstreams is not None


def test_reload_effects_come_from_the_planner() -> None:
    """Spot checks against reload.py's rules: a live supervisor key, one that needs a restart,
    an engine key that restarts, and the two that do not."""
    by_name = {(k.scope.value, k.name): k for k in KEYS}
    assert reload_effect(by_name[("supervisor", "api_key_file")])[0] == "live"
    assert reload_effect(by_name[("supervisor", "http")])[0] == "engined restart"
    assert reload_effect(by_name[("setting", "stall_timeout")])[0] == "rolling restart"
    assert reload_effect(by_name[("engine", "replicas")])[0] == "adds/removes replicas"
    assert "data_parallel" in reload_effect(by_name[("engine", "replicas")])[1]
    assert reload_effect(by_name[("setting", "launcher")])[0] == "next spawn"
