"""The router's memory preference (engine.memory): a replica whose heartbeat says it is short
of memory goes after its siblings, whatever their load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engined.engine import protocol as proto
from engined.supervisor.routing import memory_pressed


def _inc(**beat: object) -> SimpleNamespace:
    hb = proto.Heartbeat("e-0", 1, 10, 0.0, 0, 0, 0, 0, [], **beat) if beat else None
    return SimpleNamespace(vitals=SimpleNamespace(heartbeat=hb))


@pytest.mark.parametrize("beat, pressed", [
    ({}, False),  # no heartbeat yet
    ({"batch_limit": 8, "memory_headroom": 1 << 20}, False),
    ({"batch_limit": 4, "memory_headroom": 1 << 20}, True),  # an OOM lowered it
    ({"batch_limit": 8, "memory_headroom": 0}, True),  # all of memory_limit held
    ({"batch_limit": 8, "memory_headroom": -5}, True),  # over it (restarted for `memory`)
    ({"batch_limit": None, "memory_headroom": None}, False),  # a backend without either
])
def test_a_replica_short_of_memory_is_pressed(beat, pressed):
    assert memory_pressed(_inc(**beat), 8) is pressed  # type: ignore[arg-type]


def test_no_vitals_is_not_pressed():
    assert memory_pressed(SimpleNamespace(vitals=None), 8) is False  # type: ignore[arg-type]
