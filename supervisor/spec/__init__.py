"""Fleet spec: read the YAML fleet file, validate it, resolve it into frozen dataclasses.

Three stages, each raising one SpecError that lists every problem as "FILE:LINE: key.path: message":
1. bytes -> text (size bound, strict UTF-8);                        (source)
2. text -> plain values plus a key-path -> line map, by composing YAML nodes with a bounded
   SafeLoader (depth and node-count limits, duplicate-key detection, basic scalar tags only);
3. plain values -> FleetSpec (types, ranges, defaults merged, replicas expanded, cross checks).
                                                                     (checks, keys, resolve)
Each spec key is defined once, in keys.KEYS: where it may be written, its check, its default, its
meaning and its part of the `engined --check` listing (format).
Pure: no processes, no clock, no torch. Input is untrusted: nothing but SpecError escapes for any
bytes (fuzzed).
"""

from __future__ import annotations

import dataclasses
import os
import shutil

from engined.supervisor.spec.autogpus import GpuLookup, no_gpus
from engined.supervisor.spec.checks import (
    BUILTIN_MODELS,
    ENGINE_ENV,
    ENGINE_ENV_PREFIX,
    MAX_DURATION_S,
    MAX_GPU_INDEX,
    RESERVED_ENV,
    RESERVED_NAMES,
    RESTART_POLICIES,
    parse_duration,
)
from engined.supervisor.spec.format import format_fleet
from engined.supervisor.spec.model import (
    DEFAULT_HTTP,
    MAX_PROBLEMS,
    BackoffSpec,
    EngineSpec,
    FleetSpec,
    ModelSpec,
    SpecError,
    SpecProblem,
    StartLimitSpec,
    SupervisorSpec,
)
from engined.supervisor.spec.resolve import _resolve
from engined.supervisor.spec.source import MAX_DEPTH, MAX_NODES, MAX_SPEC_BYTES, _compose, _decode


def load_fleet(path: str | os.PathLike[str], gpus: GpuLookup | None = None) -> FleetSpec:
    """Read and resolve a fleet file; raises SpecError for anything wrong (an unreadable file
    included). `gpus`: the GPUs `gpus: auto` may take (the daemon passes its host's; without
    it, none: the CPU)."""
    source = os.fsdecode(os.fspath(path))
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)  # bounded: a spec path may name /dev/zero
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SpecError(
            [SpecProblem(source, "", None, f"cannot read fleet spec: {reason}")]
        ) from None
    fleet = parse_fleet(data, source, base_dir=os.path.dirname(os.path.abspath(source)),
                        gpus=gpus)
    check_host(fleet)
    return fleet


# torch's dtype names (torch.<name> is a torch.dtype): the daemon never imports torch, so what it
# can say before the child runs is "torch would not know this one", as a warning
TORCH_DTYPES = frozenset({
    "float32", "float", "float64", "double", "float16", "half", "bfloat16", "complex64",
    "complex128", "cfloat", "cdouble", "uint8", "int8", "int16", "short", "int32", "int",
    "int64", "long", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "uint16", "uint32", "uint64"})


def host_warnings(fleet: FleetSpec) -> list[str]:
    """What `--check` warns about without refusing the spec (exit 0): model directories that
    do not exist on this machine (they may on the GPU host the spec is for) and dtypes torch
    does not name (the child exits 78 for those)."""
    found = []
    for index, (group, members) in enumerate(fleet.groups().items()):
        model = members[0].model
        if model.path is not None and not members[0].is_command:
            if not os.path.isdir(model.path):
                why = "does not exist" if not os.path.exists(model.path) else "is not a directory"
                found.append(f"{fleet.source}: engines[{index}].model.path: {model.path} {why} "
                             f"here (engine {group!r}: it would exit 78 on this machine)")
        if model.dtype is not None and model.dtype not in TORCH_DTYPES:
            found.append(f"{fleet.source}: engines[{index}].model.dtype: {model.dtype!r} is not "
                         f"a torch dtype name (float32, float16, bfloat16, ...): engine "
                         f"{group!r} would exit 78")
    return found


def check_host(fleet: FleetSpec) -> None:
    """What the spec names on this machine and cannot do without: every `python:` interpreter
    must be an executable file (a missing one is a configuration error, not a crash loop), and
    the gateway's api_key_file must be readable and hold a token. Raises SpecError naming each."""
    problems = []
    key_file = fleet.supervisor.api_key_file
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as f:
                if not f.read(4096).strip():
                    problems.append(SpecProblem(fleet.source, "supervisor.api_key_file", None,
                                                f"{key_file} is empty (it holds the bearer "
                                                f"token clients must send)"))
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(SpecProblem(fleet.source, "supervisor.api_key_file", None,
                                        f"cannot read {key_file}: "
                                        f"{getattr(exc, 'strerror', None) or exc}"))
    for index, (group, members) in enumerate(fleet.groups().items()):
        problems += _check_command_host(fleet.source, index, members[0])
        python = members[0].python
        if python is None:
            continue
        if not os.path.isfile(python):
            why = "does not exist" if not os.path.exists(python) else "is not a file"
        elif not os.access(python, os.X_OK):
            why = "is not executable"
        else:
            continue
        problems.append(SpecProblem(fleet.source, f"engines[{index}].python", None,
                                    f"interpreter {python} {why} (engine {group!r}; a venv's "
                                    f"interpreter is <venv>/bin/python)"))
    if problems:
        raise SpecError(problems)


def _check_command_host(source: str, index: int, engine: EngineSpec) -> list[SpecProblem]:
    """A command engine's program and cwd exist here (a missing one would only crash-loop)."""
    if not engine.is_command:
        return []
    found = []
    if engine.cwd is not None and not os.path.isdir(engine.cwd):
        found.append(SpecProblem(source, f"engines[{index}].cwd", None,
                                 f"{engine.cwd} is not a directory (engine {engine.group!r})"))
    program = engine.command[0]
    path = dict(engine.env).get("PATH", os.environ.get("PATH", os.defpath))
    if "/" in program:
        usable = os.path.isfile(program) and os.access(program, os.X_OK)
    else:
        usable = shutil.which(program, path=path) is not None
    if not usable:
        where = "" if "/" in program else " on PATH"
        found.append(SpecProblem(source, f"engines[{index}].command[0]", None,
                                 f"program {program} not found{where} or not executable "
                                 f"(engine {engine.group!r})"))
    return found


def parse_fleet(
    text: str | bytes, source: str = "<string>", base_dir: str | None = None,
    gpus: GpuLookup | None = None
) -> FleetSpec:
    """Validate and resolve fleet-spec text; raises SpecError listing every problem.

    Relative paths in the spec resolve against `base_dir` (the spec file's directory for
    `load_fleet`), never against the daemon's working directory (`/` under systemd); without a
    base they stay as written.
    """
    decoded = _decode(text, source)
    root, lines = _compose(decoded, source)
    fleet = _resolve(root, lines, source, gpus)
    return fleet if base_dir is None else anchor_paths(fleet, base_dir)


def anchor_paths(fleet: FleetSpec, base_dir: str) -> FleetSpec:
    """The fleet with every relative path in it made absolute against `base_dir`."""

    def anchor(path: str | None) -> str | None:
        return path if path is None else _anchor(base_dir, path)

    sup = fleet.supervisor
    supervisor = dataclasses.replace(
        sup,
        control_socket=anchor(sup.control_socket),
        runtime_dir=anchor(sup.runtime_dir),
        log_dir=anchor(sup.log_dir),
        api_key_file=anchor(sup.api_key_file),
        control_token_file=anchor(sup.control_token_file),
        control_tls_cert=anchor(sup.control_tls_cert),
        control_tls_key=anchor(sup.control_tls_key),
    )
    upstreams = fleet.upstreams
    if upstreams is not None:
        upstreams = dataclasses.replace(upstreams, api_key_file=anchor(upstreams.api_key_file))
    engines = []
    for engine in fleet.engines:
        model = engine.model
        if model.path is not None:
            path = _anchor(base_dir, model.path)
            model = dataclasses.replace(model, path=path, source=path)
        command = engine.command
        if command and "/" in command[0]:  # a program named by path (a bare name uses PATH)
            command = (_anchor(base_dir, command[0]), *command[1:])
        adapters = tuple((name, _anchor(base_dir, path)) for name, path in engine.adapters)
        engines.append(dataclasses.replace(engine, model=model, python=anchor(engine.python),
                                           command=command, cwd=anchor(engine.cwd),
                                           adapters=adapters))
    return dataclasses.replace(fleet, supervisor=supervisor, engines=tuple(engines),
                               upstreams=upstreams)


def _anchor(base_dir: str, path: str) -> str:
    return os.path.normpath(os.path.join(base_dir, path))


__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_HTTP",
    "ENGINE_ENV",
    "ENGINE_ENV_PREFIX",
    "GpuLookup",
    "MAX_DEPTH",
    "MAX_DURATION_S",
    "MAX_GPU_INDEX",
    "MAX_NODES",
    "MAX_PROBLEMS",
    "MAX_SPEC_BYTES",
    "RESERVED_ENV",
    "RESERVED_NAMES",
    "RESTART_POLICIES",
    "BackoffSpec",
    "EngineSpec",
    "FleetSpec",
    "ModelSpec",
    "SpecError",
    "SpecProblem",
    "StartLimitSpec",
    "SupervisorSpec",
    "anchor_paths",
    "check_host",
    "format_fleet",
    "host_warnings",
    "load_fleet",
    "no_gpus",
    "parse_duration",
    "parse_fleet",
]
