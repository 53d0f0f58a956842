"""The spec keys for running in a pod. `gpus: auto` (spec.resolve, with the host's GPUs from
host.gpus.visible_gpus, as the daemon passes them: resolving a spec never reads the host itself):
each `auto` engine, in spec order, takes the GPUs visible to engined that no engine lists and
no earlier `auto` engine took; what cannot be met is a spec error naming the engine, the count
and where the GPUs were read. `supervisor.replica_ports`: one port per serving replica on the
gateway's host, none of them the gateway's or the HTTP endpoint's."""

from __future__ import annotations

import textwrap

import pytest

from engined.supervisor.host.gpus import visible_gpus
from engined.supervisor.spec import SpecError, parse_fleet

FLEET = textwrap.dedent("""\
    version: 1
    engines:
      - name: a
        model: builtin:echo
        replicas: 2
        gpus: auto
        gpus_per_replica: 1
      - name: b
        model: builtin:echo
        gpus: auto
      - name: c
        model: builtin:echo
        gpus: [1]
        gpus_per_replica: 1
    """)


def _gpus(text: str) -> dict[str, tuple[int, ...]]:
    return {e.name: e.gpus for e in parse_fleet(text, "fleet.yaml", gpus=visible_gpus).engines}


def test_auto_engines_share_the_visible_gpus_around_the_listed_ones(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4")
    # b has gpus_per_replica 0: an equal share of what a left (2, 4 after c's 1 and a's 0, 2)
    assert _gpus(FLEET) == {"a-0": (0,), "a-1": (2,), "b-0": (3, 4), "c-0": (1,)}


def test_cuda_visible_devices_stops_at_its_first_entry_that_is_not_an_index(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2,-1,3")  # CUDA's rule: 3 is not visible
    with pytest.raises(SpecError) as info:
        parse_fleet(FLEET, "fleet.yaml", gpus=visible_gpus)
    message = str(info.value)
    assert "engines[1].gpus" in message and "found 0 free GPU(s) of 2 visible" in message
    assert "CUDA_VISIBLE_DEVICES" in message


def test_too_few_visible_gpus_is_a_spec_error(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(SpecError) as info:
        parse_fleet(FLEET, "fleet.yaml", gpus=visible_gpus)
    assert "engines[0].gpus: gpus: auto found 1 free GPU(s) of 2 visible (from " \
           "CUDA_VISIBLE_DEVICES), but 2 replica(s) x gpus_per_replica (1) need 2" in \
           str(info.value)


def test_auto_without_any_gpu_runs_on_the_cpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    fleet = FLEET.replace("    gpus_per_replica: 1\n  - name: b", "  - name: b")
    assert _gpus(fleet.split("  - name: c")[0]) == {"a-0": (), "a-1": (), "b-0": ()}


def test_without_the_hosts_gpus_auto_is_the_cpu_and_the_host_is_not_read(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4")
    assert set(_gpus_of(parse_fleet(FLEET, "fleet.yaml"), "a-0", "b-0")) == {()}
    asked = []
    parse_fleet(FLEET, "fleet.yaml", gpus=lambda: asked.append(1) or ((0, 1, 2, 3), "a test"))
    assert asked == [1]  # read once, however many engines are auto


def _gpus_of(fleet, *names):
    return [e.gpus for e in fleet.engines if e.name in names]


def test_gpus_must_be_a_list_or_auto():
    with pytest.raises(SpecError) as info:
        parse_fleet(FLEET.replace("gpus: auto\n    gpus_per_replica: 1", "gpus: all"),
                    "fleet.yaml")
    assert "must be a list of GPU indices or 'auto'" in str(info.value)


@pytest.mark.parametrize("supervisor, fragment", [
    ("replica_ports: 9000\n", "replica_ports needs supervisor.gateway"),
    ("gateway: 127.0.0.1:9001\nreplica_ports: 9000\n",
     "replica ports 9000..9003 include supervisor.gateway's port 9001"),
    ("gateway: 127.0.0.1:8000\nhttp: 0.0.0.0:9002\nreplica_ports: 9000\n",
     "replica ports 9000..9003 include supervisor.http's port 9002"),
    ("gateway: 127.0.0.1:8000\nreplica_ports: 65534\n",
     "4 replicas need ports 65534..65537: past 65535"),
])
def test_replica_ports_are_checked_against_the_fleet(monkeypatch, supervisor, fragment):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4")
    text = FLEET.replace("engines:\n", "supervisor:\n" + textwrap.indent(supervisor, "  ")
                         + "engines:\n")
    with pytest.raises(SpecError) as info:
        parse_fleet(text, "fleet.yaml")
    assert "supervisor.replica_ports: " + fragment in str(info.value)
    ok = text.replace("replica_ports", "# replica_ports")
    if "gateway" in ok:
        assert parse_fleet(ok, "fleet.yaml").supervisor.replica_ports is None
