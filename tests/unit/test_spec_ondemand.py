"""Spec tables for engines on demand (docs/on-demand.md): idle_timeout, min_replicas,
wake_timeout, sleep_mode, supervisor.memory_budget (and adapters, checked in the same place):
what resolves, one problem per rule (key path + line), what --check lists, what a reload
applies at once."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engined.supervisor.spec import SpecError, format_fleet, parse_fleet
from engined.supervisor.spec.reload import plan_reload

GIB = 1 << 30


def fleet_of(engines: str, supervisor: str = "", defaults: str = "") -> str:
    """A spec whose `engines` text (list items, 2-space indented) starts on line 5, after
    one line of `supervisor:` and one of `defaults:` (each `{}` when not given)."""
    return (f"version: 1\nsupervisor: {supervisor or '{}'}\ndefaults: {defaults or '{}'}\n"
            f"engines:\n" + textwrap.indent(textwrap.dedent(engines).lstrip("\n"), "  "))


def problems(text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_fleet(text, "fleet.yaml")
    return [str(p) for p in info.value.problems]


# --- what resolves ----------------------------------------------------------------------------

def test_the_on_demand_keys_resolve_and_the_replicas_past_min_replicas_start_asleep() -> None:
    fleet = parse_fleet(fleet_of("""
        - {name: a, model: builtin:echo, replicas: 3, idle_timeout: 10m, min_replicas: 1,
           wake_timeout: 2m, memory_limit: 1GiB}
        - {name: b, model: builtin:echo, idle_timeout: null}
        - {name: dp, model: builtin:echo, replicas: 2, data_parallel: true, min_replicas: 2}
        - {name: g, model: builtin:echo, backend: vllm, gpus: [0], gpus_per_replica: 1,
           sleep_mode: level1}
        """, supervisor="{memory_budget: {host: 4GiB, gpu: 70GiB}}",
        defaults="{idle_timeout: 30s}"))
    by = {e.name: e for e in fleet.engines}
    a0, a1, a2 = by["a-0"], by["a-1"], by["a-2"]
    assert (a0.idle_timeout_s, a0.min_replicas, a0.wake_timeout_s, a0.sleep_mode) == (
        600.0, 1, 120.0, "stop")
    assert [e.starts_asleep for e in (a0, a1, a2)] == [False, True, True]
    assert not by["b-0"].on_demand and not by["b-0"].starts_asleep  # null: always awake
    assert [by[n].starts_asleep for n in ("dp-0", "dp-1")] == [False, False]  # kept whole
    assert by["g-0"].sleep_mode == "level1" and by["g-0"].idle_timeout_s == 30.0  # default
    budget = fleet.supervisor.memory_budget
    assert (budget.host, budget.gpu) == (4 * GIB, 70 * GIB)


def test_the_defaults_are_always_awake_and_no_budget() -> None:
    (engine,) = parse_fleet(fleet_of("- {name: a, model: builtin:echo}\n")).engines
    assert (engine.idle_timeout_s, engine.min_replicas, engine.wake_timeout_s,
            engine.sleep_mode) == (None, 0, 300.0, "stop")
    assert not engine.on_demand and not engine.starts_asleep
    budget = parse_fleet(fleet_of("- {name: a, model: builtin:echo}\n")).supervisor.memory_budget
    assert (budget.host, budget.gpu) == (None, None)


@pytest.mark.parametrize("engines, supervisor", [
    # a budget equal to a memory_limit fits
    ("- {name: a, model: builtin:echo, memory_limit: 2GiB, idle_timeout: 1m}\n",
     "{memory_budget: {host: 2GiB}}"),
    # the gpu budget is not the host's: a CPU engine above it is fine
    ("- {name: a, model: builtin:echo, memory_limit: 2GiB}\n", "{memory_budget: {gpu: 1GiB}}"),
    # two replicas above the budget together, each within it (they swap)
    ("- {name: a, model: builtin:echo, replicas: 2, memory_limit: 1GiB, idle_timeout: 1m}\n",
     "{memory_budget: {host: 1GiB}}"),
    ("- {name: d, model: builtin:echo, replicas: 3, data_parallel: true, idle_timeout: 1m, "
     "min_replicas: 0}\n", ""),
    ("- {name: d, model: builtin:echo, replicas: 3, data_parallel: true, idle_timeout: 1m, "
     "min_replicas: 3}\n", ""),
    ("- {name: s, model: builtin:echo, standby: 1, idle_timeout: null}\n", ""),
    ("- {name: c, command: [vllm, serve, m, --enable-sleep-mode], gpus: [0], "
     "gpus_per_replica: 1, sleep_mode: level2, idle_timeout: 1m}\n", ""),
    # builtin:echo mimics vLLM's sleep mode (engine.echo), for the supervisor's tests
    ("- {name: e, model: builtin:echo, sleep_mode: level1, idle_timeout: 1m}\n", ""),
    ("- {name: e, model: builtin:echo, adapters: {sql: /loras/sql}}\n", ""),
    ("- {name: v, model: builtin:tiny-llama, backend: vllm, adapters: {sql: /loras/sql}}\n", ""),
])
def test_good_specs(engines: str, supervisor: str) -> None:
    parse_fleet(fleet_of(engines, supervisor=supervisor), "fleet.yaml")


# --- one problem per rule ---------------------------------------------------------------------

RULES = [
    (fleet_of("- {name: a, model: builtin:echo, replicas: 2, idle_timeout: 1m, "
              "min_replicas: 3}\n"),
     "fleet.yaml:5: engines[0].min_replicas: min_replicas 3 is more than the engine's 2 "
     "replicas"),
    (fleet_of("- {name: a, model: builtin:echo}\n", defaults="{idle_timeout: 1m, min_replicas: 2}"),
     "fleet.yaml:3: defaults.min_replicas: min_replicas 2 is more than the engine's 1 replicas"),
    (fleet_of("- {name: d, model: builtin:echo, replicas: 3, data_parallel: true, "
              "idle_timeout: 1m, min_replicas: 1}\n"),
     "fleet.yaml:5: engines[0].min_replicas: a data-parallel group sleeps and wakes as a whole: "
     "min_replicas must be 0 or 3"),
    (fleet_of("- {name: s, model: builtin:echo, standby: 1, idle_timeout: 1m}\n"),
     "fleet.yaml:5: engines[0].standby: standby keeps spares awake and idle_timeout puts the "
     "group to sleep: choose one"),
    (fleet_of("- {name: s, model: builtin:echo, standby: 1}\n", defaults="{idle_timeout: 1m}"),
     "engines[0].standby: standby keeps spares awake"),
    (fleet_of("- {name: v, model: builtin:tiny-llama, backend: vllm, sleep_mode: level1}\n"),
     "fleet.yaml:5: engines[0].sleep_mode: sleep_mode level1 is vLLM's sleep mode, which works "
     "on CUDA and ROCm GPUs only, and this engine has no gpus (it runs on the CPU): use "
     "sleep_mode: stop"),
    (fleet_of("- {name: c, command: [vllm, serve, m], sleep_mode: level2}\n"),
     "engines[0].sleep_mode: sleep_mode level2 is vLLM's sleep mode, which works on CUDA"),
    (fleet_of("- {name: c, command: [vllm, serve, m], gpus: [0], gpus_per_replica: 1, "
              "sleep_mode: level1}\n"),
     "fleet.yaml:5: engines[0].sleep_mode: sleep_mode level1 needs the server started with "
     "--enable-sleep-mode: add it to the engine's command"),
    (fleet_of("- {name: d, model: builtin:echo, replicas: 2, data_parallel: true, "
              "sleep_mode: level1}\n"),
     "fleet.yaml:5: engines[0].sleep_mode: sleep_mode level1 keeps each process: a "
     "data-parallel group sleeps and wakes whole by a stop (use sleep_mode: stop)"),
    (fleet_of("- {name: t, model: builtin:tiny-llama, gpus: [0], gpus_per_replica: 1, "
              "sleep_mode: level2}\n"),
     "fleet.yaml:5: engines[0].sleep_mode: sleep_mode level2 is vLLM's sleep mode: it needs "
     "backend: vllm or a `vllm serve` command engine (this engine runs transformers); use "
     "sleep_mode: stop"),
    (fleet_of("- {name: a, model: builtin:echo, memory_limit: 2GiB}\n",
              supervisor="{memory_budget: {host: 1GiB}}"),
     "fleet.yaml:2: supervisor.memory_budget.host: "),
    (fleet_of("- {name: a, model: builtin:echo, memory_limit: 2GiB}\n",
              supervisor="{memory_budget: {host: 1GiB}}"),
     "memory_limit (2147483648 bytes): it could never wake"),
    (fleet_of("- {name: g, model: builtin:echo, gpus: [0], gpus_per_replica: 1, "
              "memory_limit: 2GiB}\n", supervisor="{memory_budget: {gpu: 1GiB}}"),
     "supervisor.memory_budget.gpu: 1073741824 bytes is below engine"),
    (fleet_of("- {name: t, model: builtin:tiny-llama, adapters: {sql: /loras/sql}}\n"),
     "fleet.yaml:5: engines[0].adapters: LoRA adapters need backend: vllm (or a `vllm serve` "
     "command engine started with --enable-lora); this engine runs transformers"),
    (fleet_of("- {name: a, model: builtin:echo, idle_timeout: 0s}\n"),
     "engines[0].idle_timeout: must be greater than 0"),
    (fleet_of("- {name: a, model: builtin:echo, wake_timeout: 0s}\n"),
     "engines[0].wake_timeout: must be greater than 0"),
    (fleet_of("- {name: a, model: builtin:echo, wake_timeout: null}\n"),
     "engines[0].wake_timeout"),
    (fleet_of("- {name: a, model: builtin:echo, min_replicas: -1}\n"),
     "engines[0].min_replicas: must be between 0 and 1024"),
    (fleet_of("- {name: a, model: builtin:echo, sleep_mode: level3}\n"),
     "engines[0].sleep_mode: must be one of stop, level1, level2"),
    (fleet_of("- {name: a, model: builtin:echo}\n", supervisor="{memory_budget: 16GiB}"),
     "supervisor.memory_budget: must be a mapping"),
    (fleet_of("- {name: a, model: builtin:echo}\n", supervisor="{memory_budget: {hots: 1GiB}}"),
     "supervisor.memory_budget.hots: unknown key 'hots' (did you mean 'host'?"),
    (fleet_of("- {name: a, model: builtin:echo}\n", supervisor="{memory_budget: {host: 1KiB}}"),
     "supervisor.memory_budget.host: must be between 1048576"),
    (fleet_of("- {name: a, model: builtin:echo}\n", supervisor="{memory_budget: {gpu: lots}}"),
     "supervisor.memory_budget.gpu"),
    (fleet_of("- {name: a, model: builtin:echo}\n", defaults="{memory_budget: {host: 1GiB}}"),
     "defaults.memory_budget: 'memory_budget' belongs under supervisor:"),
]


@pytest.mark.parametrize("text, expected", RULES, ids=[f"{i}" for i in range(len(RULES))])
def test_bad_specs(text: str, expected: str) -> None:
    found = problems(text)
    assert any(expected in p for p in found), "\n".join(found)


# --- what --check lists -----------------------------------------------------------------------

ON_DEMAND = fleet_of("""
    - {name: a, model: builtin:echo, replicas: 2, idle_timeout: 10m, min_replicas: 1,
       wake_timeout: 2m, memory_limit: 1GiB}
    - {name: b, model: builtin:echo}
    """, supervisor="{memory_budget: {host: 2GiB, gpu: 70GiB}}")


def test_check_lists_on_demand_and_the_budget_only_where_set() -> None:
    text = format_fleet(parse_fleet(ON_DEMAND, "fleet.yaml"))
    lines = [line.strip() for line in text.splitlines()]
    assert "memory_budget   host 2GiB, gpu 70GiB" in lines, text
    rows = [line for line in lines if line.startswith("on_demand")]
    assert rows == ["on_demand asleep after 10m idle, min_replicas 1, wake_timeout 2m, "
                    "sleep_mode stop"] * 2, text  # a-0 and a-1; none for b
    plain = format_fleet(parse_fleet(fleet_of("- {name: a, model: builtin:echo}\n")))
    assert "memory_budget" not in plain and "on_demand" not in plain


def test_engined_check_prints_the_rows(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(ON_DEMAND)
    done = subprocess.run([sys.executable, "-m", "engined.supervisor.daemon", "--check", "-c",
                           str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done
    assert "memory_budget   host 2GiB, gpu 70GiB" in done.stdout, done.stdout
    assert done.stdout.count("on_demand asleep after 10m idle") == 2, done.stdout
    path.write_text(fleet_of("- {name: a, model: builtin:echo, replicas: 2, idle_timeout: 1m, "
                             "min_replicas: 3}\n"))
    done = subprocess.run([sys.executable, "-m", "engined.supervisor.daemon", "--check", "-c",
                           str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "min_replicas 3 is more than" in done.stderr, done


# --- reload ----------------------------------------------------------------------------------

def test_a_reload_applies_idle_timeout_min_replicas_and_wake_timeout_without_a_restart() -> None:
    old = parse_fleet(fleet_of("- {name: a, model: builtin:echo, replicas: 2}\n"))
    new = parse_fleet(fleet_of("- {name: a, model: builtin:echo, replicas: 2, idle_timeout: 5m, "
                               "min_replicas: 1, wake_timeout: 1m}\n"))
    plan = plan_reload(old, new)
    assert plan.changed == () and [e.name for e in plan.unchanged] == ["a-0", "a-1"]
    budget = parse_fleet(fleet_of("- {name: a, model: builtin:echo, replicas: 2}\n",
                                  supervisor="{memory_budget: {host: 8GiB}}"))
    assert plan_reload(old, budget).restart_required == ()  # the budget applies live
