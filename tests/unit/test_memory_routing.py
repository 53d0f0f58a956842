"""The router's memory preference (engine.memory): a replica whose heartbeat says it is short
of memory goes after its siblings, whatever their load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engined.engine import protocol as proto
from engined.supervisor.routing.replicas import memory_pressed


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


# A large block freed raises glibc's dynamic mmap threshold to its size: blocks under it then
# come from the heap, whose top is trimmed only past twice that threshold, so what they took
# stays in the address space once freed
_FREED_BLOCKS = """
import ctypes
from engined.engine.memory import apply_memory_limit, rss_bytes
MiB = 1 << 20
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def address_space():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
apply_memory_limit(rss_bytes() + 256 * MiB, "cpu")
libc.free(libc.malloc(31 * MiB))
before = address_space()
for size in (20, 10, 25, 5):
    libc.free(libc.malloc(size * MiB))
print((address_space() - before) // MiB)
"""


def test_under_a_memory_limit_freed_large_blocks_leave_the_address_space():
    """apply_memory_limit bounds address space (RLIMIT_AS): freed large blocks must leave it,
    or an engine under its limit runs out of memory on memory nobody holds."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FREED_BLOCKS], capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "0"), (done.stdout, done.stderr[-2000:])
