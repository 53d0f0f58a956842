"""Fleet-spec tables: parsing, defaults, resolution, and one error per validation rule (key path + line)."""

from __future__ import annotations

import math
import pickle
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engined.supervisor.spec import (
    BackoffSpec,
    EngineSpec,
    ModelSpec,
    SpecError,
    SpecProblem,
    StartLimitSpec,
    format_fleet,
    load_fleet,
    parse_duration,
    parse_fleet,
)

REPO = Path(__file__).resolve().parents[2]


def spec(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def problems_of(text: str | bytes) -> list[SpecProblem]:
    with pytest.raises(SpecError) as info:
        parse_fleet(text, "fleet.yaml")
    assert info.value.problems, "a SpecError must carry at least one problem"
    return info.value.problems


def assert_problem(text: str | bytes, path: str, line: int | None, fragment: str) -> None:
    found = problems_of(text)
    if any(p.path == path and p.line == line and fragment in p.message for p in found):
        return
    listing = "\n".join(str(p) for p in found)
    pytest.fail(f"no problem at {path!r} line {line} containing {fragment!r}; got:\n{listing}")


# Builders that put the text under test on a known line --------------------------------------------


def engine_with(extra: str) -> str:
    """`extra` (engine keys, 4-space indented) starts on line 5."""
    head = "version: 1\nengines:\n  - name: a\n    model: builtin:echo\n"
    return head + textwrap.indent(spec(extra), "    ")


def model_as(extra: str) -> str:
    """`extra` (the engine's model key) starts on line 4."""
    return "version: 1\nengines:\n  - name: a\n" + textwrap.indent(spec(extra), "    ")


def supervisor_with(extra: str) -> str:
    """`extra` (supervisor keys) starts on line 3."""
    return ("version: 1\nsupervisor:\n" + textwrap.indent(spec(extra), "  ")
            + "engines:\n  - {name: a, model: builtin:echo}\n")


def defaults_with(extra: str) -> str:
    """`extra` (defaults keys) starts on line 3."""
    return ("version: 1\ndefaults:\n" + textwrap.indent(spec(extra), "  ")
            + "engines:\n  - {name: a, model: builtin:echo}\n")


# Durations ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, seconds", [
    ("500ms", 0.5), ("100ms", 0.1), ("30s", 30.0), ("1.5s", 1.5), ("10m", 600.0), ("1h", 3600.0),
    ("0s", 0.0), ("2.5m", 150.0), (".5s", 0.5), ("30", 30.0), (" 30s ", 30.0), (7, 7.0), (0.25, 0.25), (0, 0.0),
])
def test_parse_duration_accepts(value: object, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value, fragment", [
    (True, "boolean"), (False, "boolean"), (None, "null"), ([1], "list"), ({"s": 1}, "mapping"),
    ("-1s", "negative"), (-1, "negative"), (-0.5, "negative"), (math.nan, "nan"), (math.inf, "too large"),
    (-math.inf, "negative"), (10**400, "too large"), (-(10**400), "negative"), ("9" * 400 + "s", "too large"),
    ("", "invalid duration"), ("s", "invalid duration"), ("10x", "invalid duration"), ("1d", "invalid duration"),
    ("1e3s", "invalid duration"), ("1 2s", "invalid duration"), ("nan", "invalid duration"),
    ("inf", "invalid duration"), ("1s1m", "invalid duration"), ("400d", "invalid duration"),
    (366 * 86400, "too large"),
])
def test_parse_duration_rejects(value: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_duration(value)


# A full valid spec ----------------------------------------------------------------------------------

FULL = spec("""
    version: 1
    supervisor:
      http: 0.0.0.0:9500
      control_socket: /run/engined/ctl.sock
      runtime_dir: /run/engined
      log_dir: /var/log/engined
      heartbeat_interval: 500ms
      heartbeat_timeout: 5s
    defaults:
      restart: on-failure
      backoff: {initial: 2s, max: 1m, factor: 3, jitter: 0.2, reset_after: 5m}
      start_limit: {burst: 3, interval: 60s}
      startup_timeout: 20m
      stall_timeout: 90s
      stop_timeout: 10s
      threads: 2
      env: {SHARED: "1"}
    engines:
      - name: tiny
        replicas: 2
        model: {path: /models/llama, dtype: bfloat16}
        gpus: [3, 1, 0, 2]
        gpus_per_replica: 2
        data_parallel: true
        max_batch_size: 16
        backoff: {initial: 500ms}
        start_limit: {burst: 10}
        env: {HF_HOME: /cache, LEVEL: 3, RATIO: 0.5}
      - name: echo
        model: builtin:echo
        restart: never
        threads: 1
""")


def test_full_spec_resolves() -> None:
    fleet = parse_fleet(FULL, "full.yaml")
    assert fleet.source == "full.yaml"
    sup = fleet.supervisor
    assert sup.http == ("0.0.0.0", 9500)
    assert (sup.control_socket, sup.runtime_dir, sup.log_dir) == ("/run/engined/ctl.sock", "/run/engined", "/var/log/engined")
    assert (sup.heartbeat_interval_s, sup.heartbeat_timeout_s) == (0.5, 5.0)
    assert [e.name for e in fleet.engines] == ["tiny-0", "tiny-1", "echo-0"]
    tiny0, tiny1, echo = fleet.engines
    assert tiny0 == EngineSpec(
        name="tiny-0", group="tiny", rank=0, replicas=2,
        model=ModelSpec(source="/models/llama", builtin=None, path="/models/llama", dtype="bfloat16"),
        gpus=(3, 1), data_parallel=True, max_batch_size=16, threads=2,
        env=(("HF_HOME", "/cache"), ("LEVEL", "3"), ("RATIO", "0.5")),  # engine env replaces defaults' env
        restart="on-failure",
        backoff=BackoffSpec(initial_s=0.5, max_s=60.0, factor=3.0, jitter=0.2, reset_after_s=300.0),
        start_limit=StartLimitSpec(burst=10, interval_s=60.0),
        startup_timeout_s=1200.0, stall_timeout_s=90.0, stop_timeout_s=10.0,
        served_model_name="tiny",
    )
    assert (tiny1.rank, tiny1.gpus) == (1, (0, 2))
    assert echo.model == ModelSpec(source="builtin:echo", builtin="echo", path=None, dtype=None)
    assert (echo.group, echo.replicas, echo.gpus, echo.restart, echo.threads) == ("echo", 1, (), "never", 1)
    assert echo.env == (("SHARED", "1"),)
    assert echo.backoff == BackoffSpec(initial_s=2.0, max_s=60.0, factor=3.0, jitter=0.2, reset_after_s=300.0)
    assert echo.start_limit == StartLimitSpec(burst=3, interval_s=60.0)


def test_minimal_spec_gets_every_default() -> None:
    fleet = parse_fleet("version: 1\nengines:\n  - name: a\n    model: builtin:tiny-llama\n")
    sup = fleet.supervisor
    assert (sup.http, sup.control_socket, sup.runtime_dir, sup.log_dir) == (("127.0.0.1", 9400), None, None, None)
    assert (sup.heartbeat_interval_s, sup.heartbeat_timeout_s) == (1.0, 10.0)
    assert fleet.engines == (EngineSpec(
        name="a-0", group="a", rank=0, replicas=1,
        model=ModelSpec(source="builtin:tiny-llama", builtin="tiny-llama", path=None, dtype=None),
        gpus=(), data_parallel=False, max_batch_size=8, threads=1, env=(), restart="always",
        backoff=BackoffSpec(initial_s=1.0, max_s=30.0, factor=2.0, jitter=0.1, reset_after_s=60.0),
        start_limit=StartLimitSpec(burst=5, interval_s=120.0),
        startup_timeout_s=600.0, stall_timeout_s=60.0, stop_timeout_s=30.0,
        served_model_name="a",
    ),)
    assert (sup.gateway, sup.api_key_file) == (None, None)  # the gateway is off unless asked


def test_model_dtype_auto_is_none_and_model_may_come_from_defaults() -> None:
    fleet = parse_fleet(spec("""
        version: 1
        defaults: {model: {path: /m, dtype: auto}}
        engines: [{name: a}, {name: b, model: builtin:echo}]
    """))
    assert fleet.engine("a-0").model == ModelSpec(source="/m", builtin=None, path="/m", dtype=None)
    assert fleet.engine("b-0").model.builtin == "echo"


def test_empty_sections_are_allowed() -> None:
    fleet = parse_fleet("version: 1\nsupervisor:\ndefaults:\nengines:\n  - {name: a, model: builtin:echo, env: }\n")
    assert fleet.engines[0].env == ()


def test_groups_and_engine_lookup() -> None:
    fleet = parse_fleet(FULL)
    groups = fleet.groups()
    assert list(groups) == ["tiny", "echo"]
    assert [e.name for e in groups["tiny"]] == ["tiny-0", "tiny-1"]
    assert fleet.engine("echo-0") is fleet.engines[2]
    assert fleet.engine("tiny") is None and fleet.engine("nope") is None


def test_format_fleet_shows_supervisor_then_each_replica() -> None:
    text = format_fleet(parse_fleet(FULL, "full.yaml"))
    assert text.index("supervisor:") < text.index("tiny-0") < text.index("tiny-1") < text.index("echo-0")
    for fragment in ("0.0.0.0:9500", "every 500ms, timeout 5s", "/models/llama (dtype bfloat16)", "3,1", "0,2",
                     "builtin:echo", "on-failure", "startup 20m, stall 90s, stop 10s",
                     "initial 500ms, max 1m, factor 3, jitter 0.2", "start_limit 10 in 1m", "HF_HOME=/cache"):
        assert fragment in text, fragment


def test_format_fleet_http_off_and_ipv6() -> None:
    off = parse_fleet(supervisor_with("http: off\n"))
    assert "http            off" in format_fleet(off)
    v6 = parse_fleet(supervisor_with('http: "[::1]:9400"\n'))
    assert "[::1]:9400" in format_fleet(v6)


def test_default_fleet_file_loads() -> None:
    fleet = load_fleet(REPO / "etc" / "fleet.yaml")
    assert fleet.supervisor.http == ("127.0.0.1", 9400)
    assert [e.name for e in fleet.engines] == ["tiny-0", "tiny-1"]
    assert {e.model.source for e in fleet.engines} == {"builtin:tiny-llama"}
    assert all(e.gpus == () and e.threads == 1 for e in fleet.engines)  # CPU, bounded threads
    assert "tiny-1" in format_fleet(fleet)


# supervisor.http -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    ("127.0.0.1:9400", ("127.0.0.1", 9400)),
    ("localhost:80", ("localhost", 80)),
    ("0.0.0.0:65535", ("0.0.0.0", 65535)),
    ('"[::1]:9400"', ("::1", 9400)),
    ('"[::]:1"', ("::", 1)),
    ("off", None), ("false", None), ('"off"', None), ("OFF", None),
])
def test_http_forms(value: str, expected: tuple[str, int] | None) -> None:
    assert parse_fleet(supervisor_with(f"http: {value}\n")).supervisor.http == expected


@pytest.mark.parametrize("value, fragment", [
    ('":9400"', "missing host"), ("127.0.0.1", "missing port"), ("127.0.0.1:0", "port"), ("127.0.0.1:65536", "port"),
    ("127.0.0.1:http", "port"), ("::1:9400", "brackets"), ('"[::1]9400"', "[IPV6]:PORT"),
    ('"[nothost]:1"', "not an IPv6"), ('"bad host:1"', "invalid host"), ("9400", "got an integer"),
    ("true", "got a boolean"), ("", "got null"), ('["::1", 9400]', "quote IPv6"), ("{a: 1}", "got a mapping"),
])
def test_http_rejects(value: str, fragment: str) -> None:
    assert_problem(supervisor_with(f"http: {value}\n"), "supervisor.http", 3, fragment)


# One row per validation rule: (spec text, key path, line, message fragment) ----------------------------

RULES = [
    # top level
    ("engines: [{name: a, model: builtin:echo}]\n", "version", 1, "required"),
    ("version: 2\nengines: [{name: a, model: builtin:echo}]\n", "version", 1, "must be 1"),
    ("version: '1'\nengines: [{name: a, model: builtin:echo}]\n", "version", 1, "must be 1"),
    ("version: true\nengines: [{name: a, model: builtin:echo}]\n", "version", 1, "must be 1"),
    ("version: 1\nengines: [{name: a, model: builtin:echo}]\nbogus: 1\n", "bogus", 3, "unknown key 'bogus'"),
    ("version: 1\nengine: []\n", "engine", 2, "did you mean 'engines'"),
    ("version: 1\n", "engines", 1, "it is missing"),
    ("version: 1\nengines: []\n", "engines", 2, "non-empty list"),
    ("version: 1\nengines: {name: a}\n", "engines", 2, "non-empty list"),
    ("version: 1\nengines:\n  - builtin:echo\n", "engines[0]", 3, "must be a mapping"),
    ("version: 1\nsupervisor: [1]\nengines: [{name: a, model: builtin:echo}]\n", "supervisor", 2, "must be a mapping"),
    ("version: 1\ndefaults: 3\nengines: [{name: a, model: builtin:echo}]\n", "defaults", 2, "must be a mapping"),
    ("- 1\n- 2\n", "", 1, "top level must be a mapping"),
    ("just text\n", "", 1, "top level must be a mapping"),
    # unknown keys everywhere, naming the allowed ones
    (supervisor_with("htp: off\n"), "supervisor.htp", 3, "allowed: api_key_file, clients, control_socket, control_tcp, control_tls_cert"),
    (engine_with("replica: 2\n"), "engines[0].replica", 5, "did you mean 'replicas'"),
    (engine_with("backoff:\n  initial: 1s\n  maximum: 5s\n"), "engines[0].backoff.maximum", 7,
     "allowed: factor, initial, jitter, max, reset_after"),
    (defaults_with("start_limit: {burst: 1, window: 5s}\n"), "defaults.start_limit.window", 3, "allowed: burst, interval"),
    (model_as("model: {path: /m, dtyp: bfloat16}\n"), "engines[0].model.dtyp", 4, "allowed: dtype, path"),
    (defaults_with("name: x\n"), "defaults.name", 3, "only be set per engine"),
    (defaults_with("replicas: 2\n"), "defaults.replicas", 3, "only be set per engine"),
    # ints: types and ranges
    (engine_with("replicas: '2'\n"), "engines[0].replicas", 5, "must be an integer, got a string '2'"),
    (engine_with("replicas: true\n"), "engines[0].replicas", 5, "must be an integer, got a boolean"),
    (engine_with("replicas: 0\n"), "engines[0].replicas", 5, "between 1 and 1024"),
    (engine_with("replicas: 1025\n"), "engines[0].replicas", 5, "between 1 and 1024"),
    (engine_with("max_batch_size: 0\n"), "engines[0].max_batch_size", 5, "between 1 and 4096"),
    (engine_with("max_batch_size: 4097\n"), "engines[0].max_batch_size", 5, "between 1 and 4096"),
    (engine_with("max_batch_size: 8.0\n"), "engines[0].max_batch_size", 5, "must be an integer"),
    (engine_with("threads: 0\n"), "engines[0].threads", 5, "between 1 and 1024"),
    (defaults_with("threads: 1025\n"), "defaults.threads", 3, "between 1 and 1024"),
    (engine_with("data_parallel: 'yes'\n"), "engines[0].data_parallel", 5, "true or false"),
    (engine_with("data_parallel: 1\n"), "engines[0].data_parallel", 5, "true or false"),
    # durations and timeouts
    (engine_with("stop_timeout: 10x\n"), "engines[0].stop_timeout", 5, "invalid duration '10x'"),
    (engine_with("stop_timeout: 0s\n"), "engines[0].stop_timeout", 5, "greater than 0"),
    (engine_with("startup_timeout: -1\n"), "engines[0].startup_timeout", 5, "negative"),
    (defaults_with("stall_timeout: true\n"), "defaults.stall_timeout", 3, "boolean"),
    (defaults_with("stall_timeout: .inf\n"), "defaults.stall_timeout", 3, "too large"),
    (supervisor_with("heartbeat_interval: 0\n"), "supervisor.heartbeat_interval", 3, "greater than 0"),
    (supervisor_with("heartbeat_interval: 2s\nheartbeat_timeout: 2s\n"), "supervisor.heartbeat_timeout", 4,
     "must exceed heartbeat_interval (2s)"),
    (supervisor_with("heartbeat_interval: 1m\n"), "supervisor.heartbeat_interval", 3, "must exceed"),
    (supervisor_with("runtime_dir: ''\n"), "supervisor.runtime_dir", 3, "non-empty string"),
    (supervisor_with("log_dir: 5\n"), "supervisor.log_dir", 3, "non-empty string"),
    (supervisor_with('control_socket: "a\\0b"\n'), "supervisor.control_socket", 3, "NUL"),
    # backoff and start_limit
    (engine_with("backoff: {initial: -1s}\n"), "engines[0].backoff.initial", 5, "negative"),
    (engine_with("backoff: {initial: 1m}\n"), "engines[0].backoff.initial", 5, "backoff.max (30s) must be >= backoff.initial (1m)"),
    (defaults_with("backoff:\n  max: 500ms\n"), "defaults.backoff.max", 4, "must be >= backoff.initial"),
    (defaults_with("backoff: {factor: 0.5}\n"), "defaults.backoff.factor", 3, "must be >= 1"),
    (defaults_with("backoff: {factor: '2'}\n"), "defaults.backoff.factor", 3, "must be a number"),
    (defaults_with("backoff: {factor: .nan}\n"), "defaults.backoff.factor", 3, "finite"),
    (engine_with("backoff: {jitter: 1}\n"), "engines[0].backoff.jitter", 5, ">= 0 and < 1"),
    (engine_with("backoff: {jitter: -0.1}\n"), "engines[0].backoff.jitter", 5, ">= 0 and < 1"),
    (engine_with("backoff: 5s\n"), "engines[0].backoff", 5, "must be a mapping"),
    (engine_with("start_limit: {burst: 0}\n"), "engines[0].start_limit.burst", 5, "between 1 and"),
    (engine_with("start_limit: {interval: 0s}\n"), "engines[0].start_limit.interval", 5, "greater than 0"),
    (engine_with("restart: sometimes\n"), "engines[0].restart", 5, "one of always, on-failure, never"),
    (defaults_with("restart: true\n"), "defaults.restart", 3, "one of always, on-failure, never"),
    # names
    ("version: 1\nengines:\n  - model: builtin:echo\n", "engines[0].name", 3, "required"),
    ("version: 1\nengines:\n  - name: Tiny\n    model: builtin:echo\n", "engines[0].name", 3, "must match"),
    ("version: 1\nengines:\n  - name: -a\n    model: builtin:echo\n", "engines[0].name", 3, "must match"),
    ("version: 1\nengines:\n  - name: " + "a" * 64 + "\n    model: builtin:echo\n", "engines[0].name", 3, "must match"),
    ("version: 1\nengines:\n  - name: 7\n    model: builtin:echo\n", "engines[0].name", 3, "must match"),
    ("version: 1\nengines:\n  - name: all\n    model: builtin:echo\n", "engines[0].name", 3, "reserved"),
    (spec("""
        version: 1
        engines:
          - name: a
            model: builtin:echo
          - name: a
            model: builtin:echo
     """), "engines[1].name", 5, "duplicate engine name 'a' (also engines[0])"),
    (spec("""
        version: 1
        engines:
          - name: a
            model: builtin:echo
            replicas: 3
          - name: a-2
            model: builtin:echo
     """), "engines[1].name", 6, "engine 'a-2' collides with replica a-2 of engines[0]"),
    (spec("""
        version: 1
        engines:
          - {name: b-0, model: builtin:echo}
          - {name: b, model: builtin:echo}
     """), "engines[1].name", 4, "replica b-0 collides with engine 'b-0' of engines[0]"),
    # model
    ("version: 1\nengines:\n  - name: a\n", "engines[0].model", 3, "required"),
    (model_as("model: builtin:gpt\n"), "engines[0].model", 4, "known: builtin:echo, builtin:tiny-llama"),
    (model_as("model: 'builtin:'\n"), "engines[0].model", 4, "unknown builtin model"),
    (model_as("model: /models/x\n"), "engines[0].model", 4, "{path: ...}"),
    (model_as("model: 5\n"), "engines[0].model", 4, "got an integer 5"),
    (model_as("model: {path: ''}\n"), "engines[0].model.path", 4, "non-empty string"),
    (model_as("model:\n  dtype: bfloat16\n"), "engines[0].model.path", 4, "required"),
    (model_as("model:\n  path: /m\n  dtype: float 8\n"), "engines[0].model.dtype", 6, "a torch dtype name"),
    (model_as("model:\n  path: /m\n  dtype: 16\n"), "engines[0].model.dtype", 6, "a torch dtype name"),
    # gpus
    (engine_with("gpus: [-1]\ngpus_per_replica: 1\n"), "engines[0].gpus[0]", 5, "between 0 and"),
    (engine_with("gpus: ['0']\ngpus_per_replica: 1\n"), "engines[0].gpus[0]", 5, "must be an integer"),
    (engine_with("gpus: [true]\ngpus_per_replica: 1\n"), "engines[0].gpus[0]", 5, "must be an integer"),
    (engine_with("gpus:\n  - 0\n  - 0\ngpus_per_replica: 2\n"), "engines[0].gpus[1]", 7, "GPU 0 is listed twice"),
    (engine_with("gpus: 0\n"), "engines[0].gpus", 5, "must be a list"),
    (engine_with("gpus: [0, 1]\n"), "engines[0].gpus_per_replica", 3, "must be >= 1 when gpus are listed"),
    (engine_with("gpus: [0, 1]\ngpus_per_replica: 0\n"), "engines[0].gpus_per_replica", 6, "must be >= 1"),
    (engine_with("replicas: 2\ngpus: [0, 1, 2]\ngpus_per_replica: 2\n"), "engines[0].gpus", 6,
     "3 gpus listed, but replicas (2) x gpus_per_replica (2) = 4"),
    (engine_with("gpus_per_replica: 1\n"), "engines[0].gpus_per_replica", 5, "no gpus are listed"),
    (engine_with("gpus_per_replica: -1\n"), "engines[0].gpus_per_replica", 5, "between 0 and"),
    (defaults_with("gpus_per_replica: 1\n"), "defaults.gpus_per_replica", 3, "no gpus are listed (for engines[0])"),
    (spec("""
        version: 1
        engines:
          - {name: a, model: builtin:echo, gpus: [0, 1], gpus_per_replica: 1, replicas: 2}
          - name: b
            model: builtin:echo
            gpus: [2, 1]
            gpus_per_replica: 2
     """), "engines[1].gpus[1]", 6, "GPU 1 is used by both engine 'a' (engines[0]) and engine 'b' (engines[1])"),
    # env
    (engine_with("env: {1X: a}\n"), "engines[0].env.1X", 5, "invalid environment variable name"),
    (engine_with("env:\n  A-B: a\n"), "engines[0].env.A-B", 6, "invalid environment variable name"),
    (engine_with("env:\n  A: true\n"), "engines[0].env.A", 6, "got a boolean"),
    (engine_with("env:\n  A: null\n"), "engines[0].env.A", 6, "got null"),
    (engine_with("env:\n  A: [1]\n"), "engines[0].env.A", 6, "got a list"),
    (engine_with("env:\n  CUDA_VISIBLE_DEVICES: '0'\n"), "engines[0].env.CUDA_VISIBLE_DEVICES", 6, "set by engined"),
    (defaults_with("env: {NOTIFY_SOCKET: /x}\n"), "defaults.env.NOTIFY_SOCKET", 3, "set by engined"),
    (engine_with("env:\n  ENGINED_SOCKET: x\n"), "engines[0].env.ENGINED_SOCKET", 6, "set by engined"),
    (engine_with("env: [A=1]\n"), "engines[0].env", 5, "must be a mapping"),
    # YAML-level problems
    ("version: 1\nversion: 1\nengines: [{name: a, model: builtin:echo}]\n", "version", 2, "duplicate key 'version' (first on line 1)"),
    (engine_with("replicas: 1\nreplicas: 2\n"), "engines[0].replicas", 6, "duplicate key"),
    ("version: 1\n<<: {engines: []}\n", "", 2, "merge keys"),
    ("version: 1\n1: x\n", "", 2, "keys must be strings"),
    ("version: !!python/object:os.system 1\n", "version", 1, "unsupported YAML tag"),
    ("version: 1\nengines:\n  - !!python/object/apply:os.system [ls]\n", "engines[0]", 3, "unsupported YAML tag"),
    ("version: !!set {a}\n", "version", 1, "unsupported YAML tag"),
    ("version: !!int x\n", "version", 1, "invalid int value"),
    ("version: 1\nengines: [\n", "", 3, "YAML error"),
    ("version: 1\n  bad: indent\n", "", 2, "YAML error"),
    ("version: 1\n---\nversion: 1\n", "", 2, "single document"),
    ("version: 1\nengines: *nothing\n", "", 2, "undefined alias"),
    ("version: 1\nx: \"\x07\"\n", "", 2, "unacceptable character"),
    ('version: "\\ud800"\n', "version", 1, "surrogate"),
    ("a: &a [*a]\n", "a[0]", 1, "recursive YAML alias"),
    ("", "", None, "empty"),
    ("# only a comment\n", "", None, "empty"),
    # a key in the wrong section says where it belongs
    ("version: 1\ndefaults: {heartbeat_timeout: 5s}\nengines: [{name: a, model: builtin:echo}]\n",
     "defaults.heartbeat_timeout", 2, "belongs under supervisor:"),
    ("version: 1\nsupervisor: {restart: never}\nengines: [{name: a, model: builtin:echo}]\n",
     "supervisor.restart", 2, "is an engine setting: put it under defaults:"),
    ("version: 1\nsupervisor: {replicas: 2}\nengines: [{name: a, model: builtin:echo}]\n",
     "supervisor.replicas", 2, "is set per engine, under engines:"),
    ("version: 1\nengines: [{name: a, model: builtin:echo, gateway: '127.0.0.1:1'}]\n",
     "engines[0].gateway", 2, "belongs under supervisor:"),
    # launcher and standby
    ("version: 1\nsupervisor: {launcher: fork}\nengines: [{name: a, model: builtin:echo}]\n",
     "supervisor.launcher", 2, "forkserver"),
    ("version: 1\nengines: [{name: a, model: builtin:echo, launcher: spawn}]\n",
     "engines[0].launcher", 2, "forkserver"),
    ("version: 1\nengines: [{name: a, command: [/bin/true], launcher: exec}]\n",
     "engines[0].launcher", 2, "always started by exec"),
    ("version: 1\nengines: [{name: a, model: builtin:echo, standby: -1}]\n",
     "engines[0].standby", 2, ""),
    ("version: 1\nengines: [{name: a, model: builtin:echo, standby: 1, data_parallel: true, "
     "replicas: 2}]\n", "engines[0].standby", 2, "data_parallel"),
    ("version: 1\nengines: [{name: a, command: [/bin/true], standby: 1}]\n",
     "engines[0].standby", 2, "command engine"),
    ("version: 1\nengines: [{name: a, model: builtin:echo, standby: 1, gpus: [0], "
     "gpus_per_replica: 1}]\n", "engines[0].gpus", 2, "(replicas (1) + standby (1)) x"),
    ("version: 1\nengines: [{name: a, model: builtin:echo, standby: 1}, "
     "{name: a-standby, model: builtin:echo}]\n", "engines[1].name", 2, "standby a-standby-0"),
    ("version: 1\nengines: [{name: a, model: builtin:tiny-llama, memory_limit: 1KiB}]\n",
     "engines[0].memory_limit", 2, "between 1048576"),
    ("version: 1\nengines: [{name: a, model: builtin:tiny-llama, memory_limit: lots}]\n",
     "engines[0].memory_limit", 2, "size in bytes"),
    ("version: 1\nengines: [{name: a, model: builtin:tiny-llama, backend: vllm, "
     "memory_limit: 2GiB, engine_args: {gpu_memory_utilization: 0.5}}]\n",
     "engines[0].engine_args.gpu_memory_utilization", 2, "and so does memory_limit"),
    ("version: 1\nengines: [{name: a, model: builtin:tiny-llama, backend: vllm, "
     "memory_limit: 2GiB, env: {VLLM_CPU_KVCACHE_SPACE: '1'}}]\n",
     "engines[0].env.VLLM_CPU_KVCACHE_SPACE", 2, "set one of them"),
    ("version: 1\nengines: [{name: a, command: [/bin/true], memory_limit: 2GiB}]\n",
     "engines[0].memory_limit", 2, "exclusive"),
]


def test_launcher_resolves_supervisor_then_engine_and_standbys_expand() -> None:
    fleet = parse_fleet(textwrap.dedent("""\
        version: 1
        supervisor: {launcher: exec}
        engines:
          - {name: a, model: builtin:echo, replicas: 2, standby: 2, gpus: [0, 1, 2, 3],
             gpus_per_replica: 1}
          - {name: b, model: builtin:echo, launcher: forkserver}
          - {name: c, command: [/bin/true]}
        """), "<test>")
    engines = {e.name: e for e in fleet.engines}
    assert list(engines) == ["a-0", "a-1", "a-standby-0", "a-standby-1", "b-0", "c-0"]
    assert [engines[n].launcher for n in engines] == ["exec"] * 4 + ["forkserver", "exec"]
    assert [(e.standby, e.rank, e.gpus) for e in fleet.engines if e.group == "a"] == [
        (False, 0, (0,)), (False, 1, (1,)), (True, 0, (2,)), (True, 1, (3,))]
    assert format_fleet(fleet).splitlines()[0].endswith(": 3 group(s), 4 replica(s) + 2 standby")
    assert parse_fleet("version: 1\nengines: [{name: a, model: builtin:echo}]\n",
                       "<t>").engines[0].launcher == "forkserver"  # the default


@pytest.mark.parametrize("text, path, line, fragment", RULES, ids=[f"{i}-{r[1] or 'file'}" for i, r in enumerate(RULES)])
def test_validation_rule(text: str, path: str, line: int | None, fragment: str) -> None:
    assert_problem(text, path, line, fragment)


def test_problem_text_format() -> None:
    with pytest.raises(SpecError) as info:
        parse_fleet(engine_with("replicas: 0\n"), "etc/f.yaml")
    assert str(info.value) == "etc/f.yaml:5: engines[0].replicas: must be between 1 and 1024, got 0"
    assert str(SpecProblem("f", "", None, "gone")) == "f: gone"
    copy = pickle.loads(pickle.dumps(info.value))  # crosses process boundaries intact
    assert copy.problems == info.value.problems and str(copy) == str(info.value)


def test_several_problems_reported_at_once_in_file_order() -> None:
    text = spec("""
        version: 1
        supervisor:
          http: nowhere
        defaults:
          backoff: {factor: 0}
        engines:
          - name: Bad
            model: builtin:nope
            replicas: 0
          - name: ok
            model: builtin:echo
            threads: 0
            env: {ENGINED_X: "1"}
    """)
    found = problems_of(text)
    assert [(p.path, p.line) for p in found] == [
        ("supervisor.http", 3), ("defaults.backoff.factor", 5), ("engines[0].name", 7), ("engines[0].model", 8),
        ("engines[0].replicas", 9), ("engines[1].threads", 12), ("engines[1].env.ENGINED_X", 13),
    ]
    assert all(p.file == "fleet.yaml" for p in found)


def test_a_bad_default_is_reported_once_not_per_engine() -> None:
    text = spec("""
        version: 1
        defaults:
          backoff: {initial: 1m, max: 10s}
        engines: [{name: a, model: builtin:echo}, {name: b, model: builtin:echo}]
    """)
    assert [p.path for p in problems_of(text)] == ["defaults.backoff.max"]


def test_problem_list_is_bounded() -> None:
    text = "version: 1\nengines: [{name: a, model: builtin:echo}]\n" + "".join(f"k{i}: 1\n" for i in range(500))
    found = problems_of(text)
    assert len(found) == 51 and "450 more problems" in found[-1].message


# Hostile input --------------------------------------------------------------------------------------


def test_non_utf8_bytes() -> None:
    assert_problem(b"version: 1\nname: \xff\xfe\n", "", 2, "not valid UTF-8: byte 0xff at offset 17")


def test_bytes_input_is_accepted() -> None:
    assert parse_fleet(FULL.encode()).engines[0].name == "tiny-0"


def test_alias_bomb_is_refused() -> None:
    rows = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        rows.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    found = problems_of("\n".join(rows) + "\n")
    assert "more than 100000 YAML nodes" in found[0].message


@pytest.mark.parametrize("text", [
    "[" * 10_000 + "]" * 10_000,
    "{a: " * 10_000 + "1" + "}" * 10_000,
    "".join("  " * i + "- \n" for i in range(200)),
])
def test_deep_nesting_is_a_spec_error(text: str) -> None:
    found = problems_of(text)
    assert "nesting deeper than" in found[0].message


def test_too_many_nodes() -> None:
    assert "more than 100000 YAML nodes" in problems_of("[" + "0," * 100_001 + "]")[0].message


def test_huge_numbers() -> None:
    text = engine_with(f"replicas: {10**400}\nstop_timeout: 1.0e+999\nbackoff: {{factor: 1.0e+999}}\n")
    paths = {p.path for p in problems_of(text)}
    assert paths == {"engines[0].replicas", "engines[0].stop_timeout", "engines[0].backoff.factor"}
    assert "invalid int value" in problems_of("version: " + "9" * 5000 + "\n")[0].message


def test_oversized_input_is_refused_before_parsing() -> None:
    big = "version: 1\n" + "#" * (1 << 20)
    assert "too large" in problems_of(big)[0].message
    assert "too large" in problems_of(big.encode())[0].message


# load_fleet ------------------------------------------------------------------------------------------


def test_load_fleet_errors(tmp_path: Path) -> None:
    cases = {"missing.yaml": None, "empty.yaml": b"", "big.yaml": b"#" * ((1 << 20) + 1), "bin.yaml": b"\xff"}
    for name, data in cases.items():
        if data is not None:
            (tmp_path / name).write_bytes(data)
    expectations = {"missing.yaml": "cannot read", "empty.yaml": "empty", "big.yaml": "too large", "bin.yaml": "UTF-8"}
    for name, fragment in expectations.items():
        with pytest.raises(SpecError, match=fragment) as info:
            load_fleet(tmp_path / name)
        assert info.value.problems[0].file == str(tmp_path / name)
    with pytest.raises(SpecError, match="cannot read"):
        load_fleet(tmp_path)  # a directory


def test_load_fleet_names_the_file_in_every_problem(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(engine_with("threads: 0\n"))
    with pytest.raises(SpecError) as info:
        load_fleet(path)
    assert str(info.value) == f"{path}:5: engines[0].threads: must be between 1 and 1024, got 0"


# Fuzz: any input is either a fleet or a SpecError ----------------------------------------------------

_FRAGMENTS = ["version: 1\n", "engines:\n", "  - name: a\n", "    model: builtin:echo\n", "&a ", "*a", "[", "]", "{", "}",
              ": ", "- ", "\n", "  ", "!!python/object ", "---\n", "1.0e+999", "9" * 400, "'", '"', "<<: ", "? "]


def _accepts_or_spec_error(data: str | bytes) -> None:
    try:
        fleet = parse_fleet(data)
    except SpecError as exc:
        assert exc.problems and str(exc)
    else:
        assert format_fleet(fleet)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300) | st.text(max_size=300)
       | st.lists(st.sampled_from(_FRAGMENTS) | st.text(max_size=4), max_size=30).map("".join))
def test_fuzz_only_spec_error_escapes(data: str | bytes) -> None:
    _accepts_or_spec_error(data)


def test_relative_paths_resolve_against_the_spec_files_directory(tmp_path: Path) -> None:
    """Not against the daemon's working directory: that is `/` under systemd."""
    spec = tmp_path / "conf" / "fleet.yaml"
    spec.parent.mkdir()
    spec.write_text("version: 1\nsupervisor: {runtime_dir: run, log_dir: ../logs, http: off,\n"
                    "  control_tcp: 127.0.0.1:9500, control_token_file: token,\n"
                    "  control_tls_cert: tls/cert.pem, control_tls_key: tls/key.pem}\n"
                    "engines:\n  - {name: a, model: {path: models/x}}\n"
                    "  - {name: b, model: {path: /abs/y}}\n  - {name: c, model: builtin:echo}\n")
    fleet = load_fleet(spec)
    a, b, c = fleet.engines
    assert a.model.path == a.model.source == str(tmp_path / "conf" / "models" / "x")
    assert b.model.path == "/abs/y" and c.model.path is None and c.model.source == "builtin:echo"
    assert fleet.supervisor.runtime_dir == str(tmp_path / "conf" / "run")
    assert fleet.supervisor.log_dir == str(tmp_path / "logs")
    assert fleet.supervisor.control_socket is None
    assert (fleet.supervisor.control_token_file, fleet.supervisor.control_tls_cert,
            fleet.supervisor.control_tls_key) == tuple(
        str(tmp_path / "conf" / p) for p in ("token", "tls/cert.pem", "tls/key.pem"))
    cluster = tmp_path / "conf" / "cluster.yaml"
    cluster.write_text("version: 1\nsupervisor: {gateway: 127.0.0.1:8000, http: off}\n"
                       "upstreams: {nodes: ['node-a:8000'], api_key_file: node-key}\n")
    assert load_fleet(cluster).upstreams.api_key_file == str(tmp_path / "conf" / "node-key")
    # text without a file keeps what was written
    assert parse_fleet(spec.read_text()).engines[0].model.path == "models/x"


def test_check_warns_about_missing_model_dirs_and_unknown_dtypes(tmp_path: Path) -> None:
    import subprocess
    import sys

    from engined.supervisor.spec import host_warnings

    present = tmp_path / "model"
    present.mkdir()
    path = tmp_path / "fleet.yaml"
    path.write_text(f"version: 1\nengines:\n"
                    f"  - {{name: a, model: {{path: {tmp_path}/gone, dtype: bf16}}}}\n"
                    f"  - {{name: b, model: {{path: {present}, dtype: bfloat16}}}}\n")
    warnings = host_warnings(load_fleet(path))
    assert len(warnings) == 2, warnings
    assert "engines[0].model.path" in warnings[0] and "does not exist here" in warnings[0]
    assert "engines[0].model.dtype: 'bf16' is not a torch dtype name" in warnings[1]
    done = subprocess.run([sys.executable, "-m", "engined.supervisor.daemon", "--check", "-c",
                           str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done  # warnings, not errors: the model may exist on the GPU host
    assert done.stderr.count("engined: warning: ") == 2, done.stderr
    assert done.stdout.startswith(f"fleet {path}: 2 group(s)"), done.stdout
