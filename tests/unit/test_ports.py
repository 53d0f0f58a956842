"""`port: auto` and fixed ports of command engines (supervisor.host.launcher.PortPicker): an auto
port is free and outside the kernel's ephemeral range (a port inside it is often taken as some
outgoing connection's source port before a slow server binds it), and is not handed out twice
while its server starts; a fixed port that is taken is refused, naming it."""

from __future__ import annotations

import random
import socket

import pytest

from engined.supervisor.host.launcher import PortPicker, ephemeral_range
from engined.supervisor.spec import parse_fleet


def _spec(port: object):
    doc = f"""
version: 1
engines:
  - name: srv
    command: [server, --port, "{{port}}"]
    port: {port}
"""
    return parse_fleet(doc).engines[0]


def test_auto_ports_are_free_outside_the_ephemeral_range_and_never_handed_out_twice(rng_seed):
    low, high = ephemeral_range()
    picker = PortPicker(random.Random(rng_seed))
    ports = [picker.pick(_spec("auto")) for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(p is not None and not low <= p <= high and p >= 10000 for p in ports), ports
    for port in ports[:5]:  # free: a server can bind each
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))


def test_a_taken_fixed_port_is_refused_naming_it():
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"port {port} is in use"):
            PortPicker().pick(_spec(port))


def test_the_ephemeral_range_is_read_from_the_kernel_or_defaults(tmp_path):
    path = tmp_path / "range"
    path.write_text("40000\t50000\n")
    assert ephemeral_range(str(path)) == (40000, 50000)
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
