"""Stage 3: plain values -> FleetSpec (types, ranges, defaults merged, replicas expanded, cross
checks across engines)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engined.supervisor.spec.checks import (
    _BAD,
    _NAME_RE,
    BACKENDS,
    LAUNCHERS,
    MAX_GPU_INDEX,
    RESERVED_NAMES,
    RESTART_POLICIES,
    _any_bad,
    _bool,
    _Check,
    _command,
    _duration,
    _engine_args,
    _enum,
    _env,
    _factor,
    _fmt_duration,
    _gpus,
    _http,
    _int_in,
    _jitter,
    _Located,
    _mapping,
    _model,
    _openai,
    _optional_text,
    _port,
    _probe,
    _Problems,
    _progress,
    _size,
    _unknown_keys,
)
from engined.supervisor.spec.model import (
    DEFAULT_HTTP,
    VLLM_PROGRESS,
    BackoffSpec,
    EngineSpec,
    FleetSpec,
    ModelSpec,
    ProbeSpec,
    ProgressSpec,
    RolloutSpec,
    StartLimitSpec,
    SupervisorSpec,
)
from engined.supervisor.spec.source import _describe, _join

# Sections ------------------------------------------------------------------------------------

_BACKOFF_CHECKS: dict[str, _Check] = {
    "initial": _duration(positive=False),
    "max": _duration(positive=False),
    "factor": _factor,
    "jitter": _jitter,
    "reset_after": _duration(positive=False),
}
_ROLLOUT_CHECKS: dict[str, _Check] = {
    "max_unavailable": _int_in(1, 1024),
    "max_surge": _int_in(0, 1024),
}
_START_LIMIT_CHECKS: dict[str, _Check] = {
    "burst": _int_in(1, 1_000_000),
    "interval": _duration(positive=True),
}
_NESTED: dict[str, dict[str, _Check]] = {
    "backoff": _BACKOFF_CHECKS,
    "start_limit": _START_LIMIT_CHECKS,
    "rollout": _ROLLOUT_CHECKS,
}
_SETTING_CHECKS: dict[str, _Check] = {
    "restart": _enum(RESTART_POLICIES),
    "startup_timeout": _duration(positive=True),
    "stall_timeout": _duration(positive=True),
    "stop_timeout": _duration(positive=True),
    "model": _model,
    "gpus": _gpus,
    "gpus_per_replica": _int_in(0, MAX_GPU_INDEX + 1),
    "data_parallel": _bool,
    "max_batch_size": _int_in(1, 4096),
    "threads": _int_in(1, 1024),
    "env": _env,
    "python": _optional_text,
    "backend": _enum(BACKENDS),
    "engine_args": _engine_args,
    "served_model_name": _optional_text,
    "queue_limit": _int_in(1, 1_000_000),
    "request_timeout": _duration(positive=True),
    "migration_limit": _int_in(0, 100),
    "probe": _probe,
    "launcher": _enum(LAUNCHERS),
    "standby": _int_in(0, 64),
}
_SETTING_KEYS = (*_SETTING_CHECKS, *_NESTED)
# A command engine (a server engined did not write) is one engine's own business: these keys
# are set per engine, never in defaults.
_COMMAND_CHECKS: dict[str, _Check] = {
    "command": _command,
    "port": _port,
    "cwd": _optional_text,
    "progress": _progress,
    "openai": _openai,
}
_ENGINE_ONLY = ("name", "replicas", *_COMMAND_CHECKS)
# what only engined's own engine child uses: not for a command engine
_CHILD_ONLY = ("model", "backend", "engine_args", "python")
_BUILTIN_SETTINGS: dict[str, _Located] = {
    key: (value, None)
    for key, value in {
        "restart": "always",
        "startup_timeout": 600.0,
        "stall_timeout": 60.0,
        "stop_timeout": 30.0,
        "gpus": (),
        "gpus_per_replica": 0,
        "data_parallel": False,
        "max_batch_size": 8,
        "threads": 1,
        "env": (),
        "python": None,
        "backend": "transformers",
        "engine_args": (),
        "served_model_name": None,
        "queue_limit": 256,
        "request_timeout": 600.0,
        "migration_limit": 3,
        "probe": None,  # a command engine with a port gets ProbeSpec()
        "launcher": None,  # the supervisor's
        "standby": 0,
        "rollout.max_unavailable": 1,
        "rollout.max_surge": 0,
        "backoff.initial": 1.0,
        "backoff.max": 30.0,
        "backoff.factor": 2.0,
        "backoff.jitter": 0.1,
        "backoff.reset_after": 60.0,
        "start_limit.burst": 5,
        "start_limit.interval": 120.0,
    }.items()
}
_SUPERVISOR_CHECKS: dict[str, _Check] = {
    "http": _http,
    "gateway": _http,
    "api_key_file": _optional_text,
    "control_socket": _optional_text,
    "runtime_dir": _optional_text,
    "log_dir": _optional_text,
    "heartbeat_interval": _duration(positive=True),
    "heartbeat_timeout": _duration(positive=True),
    "launcher": _enum(LAUNCHERS),
    "log_max_bytes": _size(4096, 1 << 40),
    "log_backups": _int_in(0, 100),
}
_SUPERVISOR_DEFAULTS: dict[str, Any] = {
    "http": DEFAULT_HTTP,
    "gateway": None,  # off unless asked for: two daemons never fight over a port
    "api_key_file": None,
    "control_socket": None,
    "runtime_dir": None,
    "log_dir": None,
    "heartbeat_interval": 1.0,
    "heartbeat_timeout": 10.0,
    "launcher": "forkserver",
    "log_max_bytes": 10 * 1024 * 1024,
    "log_backups": 3,
}


def _resolve(root: Any, lines: Mapping[str, int], source: str) -> FleetSpec:
    problems = _Problems()
    if not isinstance(root, dict):
        problems.add(
            "",
            "top level must be a mapping (version, supervisor, defaults, engines); "
            f"got {_describe(root)}",
        )
        problems.raise_if_any(source, lines)
    top: dict[str, Any] = root
    _unknown_keys(problems, top, "", ("version", "supervisor", "defaults", "engines"))
    _check_version(problems, top)
    supervisor = _supervisor(problems, top.get("supervisor"))
    defaults = _defaults(problems, top.get("defaults"))
    engines = _engines(problems, top, defaults)
    problems.raise_if_any(source, lines)
    if supervisor.launcher is not _BAD:
        engines = tuple(e if e.is_command or e.launcher else
                        dataclasses.replace(e, launcher=supervisor.launcher) for e in engines)
    return FleetSpec(source=source, supervisor=supervisor, engines=engines)


def _check_version(problems: _Problems, top: Mapping[str, Any]) -> None:
    if "version" not in top:
        problems.add("version", "required: add 'version: 1' at the top")
    elif type(top["version"]) is not int or top["version"] != 1:
        problems.add("version", f"must be 1, got {_describe(top['version'])}")


def _supervisor(problems: _Problems, raw: Any) -> SupervisorSpec:
    section = _mapping(problems, raw, "supervisor", null_ok=True) or {}
    _unknown_keys(problems, section, "supervisor", _SUPERVISOR_CHECKS, _elsewhere("supervisor"))
    values = dict(_SUPERVISOR_DEFAULTS)
    for key, check in _SUPERVISOR_CHECKS.items():
        if key in section:
            values[key] = check(problems, section[key], f"supervisor.{key}")
    interval, timeout = values["heartbeat_interval"], values["heartbeat_timeout"]
    if not _any_bad(interval, timeout) and timeout <= interval:
        path = (
            "supervisor.heartbeat_timeout"
            if "heartbeat_timeout" in section
            else "supervisor.heartbeat_interval"
        )
        problems.add(
            path,
            f"heartbeat_timeout ({_fmt_duration(timeout)}) must exceed "
            f"heartbeat_interval ({_fmt_duration(interval)})",
        )
    gateway, http = values["gateway"], values["http"]
    if not _any_bad(gateway, http) and gateway is not None and gateway == http:
        problems.add("supervisor.gateway", f"gateway and http cannot share {gateway[0]}:"
                                           f"{gateway[1]}")
    return SupervisorSpec(
        http=values["http"],
        gateway=values["gateway"],
        api_key_file=values["api_key_file"],
        control_socket=values["control_socket"],
        runtime_dir=values["runtime_dir"],
        log_dir=values["log_dir"],
        heartbeat_interval_s=interval,
        heartbeat_timeout_s=timeout,
        launcher=values["launcher"],
        log_max_bytes=values["log_max_bytes"],
        log_backups=values["log_backups"],
    )


def _elsewhere(section: str) -> dict[str, str]:
    """A key that exists in another section: say where it belongs (not "did you mean ...")."""
    out: dict[str, str] = {}
    if section != "supervisor":
        out.update({key: f"{key!r} belongs under supervisor: (it is engined's own setting)"
                    for key in _SUPERVISOR_CHECKS if key not in _SETTING_CHECKS})
    if section == "supervisor":
        out.update({key: f"{key!r} is an engine setting: put it under defaults: (every engine) "
                         f"or in an engine"
                    for key in _SETTING_KEYS if key not in _SUPERVISOR_CHECKS})
        out.update({key: f"{key!r} is set per engine, under engines:" for key in _ENGINE_ONLY})
    return out


def _defaults(problems: _Problems, raw: Any) -> dict[str, _Located]:
    section = _mapping(problems, raw, "defaults", null_ok=True) or {}
    hints = {key: f"{key!r} can only be set per engine, not in defaults" for key in _ENGINE_ONLY}
    _unknown_keys(problems, section, "defaults", _SETTING_KEYS,
                  {**_elsewhere("defaults"), **hints})
    return _settings(problems, section, "defaults")


def _settings(problems: _Problems, section: Mapping[str, Any], path: str) -> dict[str, _Located]:
    """The engine-level settings present in `section`, flattened ("backoff.initial") and located."""
    out: dict[str, _Located] = {}
    for key, check in _SETTING_CHECKS.items():
        if key in section:
            out[key] = (check(problems, section[key], _join(path, key)), _join(path, key))
    for key, checks in _NESTED.items():
        if key not in section:
            continue
        nested = _mapping(problems, section[key], _join(path, key), null_ok=True)
        if nested is None:
            continue
        _unknown_keys(problems, nested, _join(path, key), checks)
        for sub, check in checks.items():
            if sub in nested:
                sub_path = f"{_join(path, key)}.{sub}"
                out[f"{key}.{sub}"] = (check(problems, nested[sub], sub_path), sub_path)
    return out


# Engines -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Group:
    """One validated `engines[i]` entry, before cross-engine checks."""

    index: int
    name: str
    replicas: int
    settings: dict[str, _Located]


def _engines(
    problems: _Problems, top: Mapping[str, Any], defaults: dict[str, _Located]
) -> tuple[EngineSpec, ...]:
    raw = top.get("engines")
    if "engines" not in top or not isinstance(raw, list) or not raw:
        got = "it is missing" if "engines" not in top else f"got {_describe(raw)}"
        problems.add("engines", f"must be a non-empty list of engines; {got}")
        return ()
    groups = [_group(problems, item, i, defaults) for i, item in enumerate(raw)]
    valid = [g for g in groups if g is not None]
    _check_names(problems, valid)
    _check_model_names(problems, valid)
    _check_gpu_overlap(problems, valid)
    if len(valid) != len(groups) or any(
        _any_bad(*(v for v, _ in g.settings.values())) for g in valid
    ):
        return ()
    return tuple(replica for g in valid for replica in _expand(g))


def _group(
    problems: _Problems, raw: Any, index: int, defaults: dict[str, _Located]
) -> _Group | None:
    path = f"engines[{index}]"
    section = _mapping(problems, raw, path)
    if section is None:
        return None
    _unknown_keys(problems, section, path, (*_SETTING_KEYS, *_ENGINE_ONLY), _elsewhere("engine"))
    name = _engine_name(problems, section.get("name"), f"{path}.name", "name" in section)
    replicas = _int_in(1, 1024)(problems, section.get("replicas", 1), f"{path}.replicas")
    settings = {**_BUILTIN_SETTINGS, **defaults, **_settings(problems, section, path)}
    for key, check in _COMMAND_CHECKS.items():
        if key in section:
            settings[key] = (check(problems, section[key], f"{path}.{key}"), f"{path}.{key}")
    if "command" in section:
        _check_command(problems, settings, section, path)
    elif "model" not in settings:
        problems.add(
            f"{path}.model", "required: 'builtin:echo', 'builtin:tiny-llama' or {path: DIR}"
        )
        settings["model"] = (_BAD, None)
    _check_backoff(problems, settings, path)
    if "command" not in section:
        _check_backend(problems, settings, path)
        for key in ("port", "cwd", "progress", "openai"):
            if key in section:
                problems.add(f"{path}.{key}", f"{key} applies to command engines only (this "
                                              f"engine runs a model; add command: [...])")
        probe, probe_at = settings["probe"]
        if probe not in (None, _BAD) and probe_at and probe_at.startswith(path + "."):
            problems.add(probe_at, "probe applies to command engines only (engined's own "
                                   "engines heartbeat)")
    standby, standby_at = settings["standby"]
    dp = settings["data_parallel"][0]
    if standby not in (0, _BAD) and dp is True:
        problems.add(standby_at or f"{path}.standby",
                     f"standby is not supported with data_parallel: true (a spare rank could "
                     f"not join a running torch.distributed group){_for(standby_at or path, path)}")
    if replicas is not _BAD:
        _check_gpu_split(problems, settings, replicas, path)
        port = settings.get("port", (None, None))[0]
        if port not in (None, 0, _BAD) and port + replicas - 1 > 65535:
            problems.add(f"{path}.port", f"replicas use ports {port}..{port + replicas - 1}: "
                                         f"past 65535")
    if _any_bad(name, replicas):
        return None
    return _Group(index=index, name=name, replicas=replicas, settings=settings)


def _check_command(problems: _Problems, s: dict[str, _Located], section: Mapping[str, Any],
                   path: str) -> None:
    """A command engine: what only engined's engine child uses is an error when set on it (a
    value inherited from defaults is ignored), and what needs a port has one."""
    if "launcher" in section:
        problems.add(f"{path}.launcher", "launcher applies to engined's own engines (a command "
                                         "engine's server is always started by exec)")
    standby, standby_at = s["standby"]
    if standby not in (0, _BAD):
        problems.add(standby_at or f"{path}.standby",
                     f"standby is not supported for a command engine yet (its server's port "
                     f"and probes are its own){_for(standby_at or path, path)}")
    for key in _CHILD_ONLY:
        if key in section:
            problems.add(f"{path}.{key}", f"{key} and command are exclusive: a command engine "
                                          f"runs its own server (put {key} in its arguments)")
    dp, dp_at = s["data_parallel"]
    if dp is True:
        problems.add(dp_at or f"{path}.data_parallel",
                     f"data_parallel: true is not supported for a command engine (engined "
                     f"cannot form its torch.distributed group){_for(dp_at or path, path)}")
    argv = s["command"][0]
    port = s.get("port", (None, None))[0]
    needs_port = [key for key in ("progress", "openai") if key in section]
    probe, probe_at = s["probe"]
    if probe not in (None, False, _BAD):
        needs_port.append("probe")
    if port is None:
        if argv is not _BAD and any("{port}" in arg for arg in argv):
            problems.add(f"{path}.command", "uses {port} but the engine has no port: add "
                                            "port: auto (or a number)")
        for key in needs_port:
            at = probe_at if key == "probe" and probe_at else f"{path}.{key}"
            problems.add(at, f"{key} needs the engine's port: add port: auto (or a number)"
                             f"{_for(at, path)}")
    env, env_at = s["env"]
    if port is not None and env is not _BAD and any(k == "PORT" for k, _ in env):
        problems.add(f"{env_at or path + '.env'}.PORT", "PORT is set by engined for a command "
                                                        "engine with a port")


def _engine_name(problems: _Problems, value: Any, path: str, present: bool) -> Any:
    if not present:
        return problems.add(path, "required: each engine needs a name")
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        return problems.add(path, f"must match [a-z0-9][a-z0-9_.-]{{0,62}}, got {_describe(value)}")
    if value in RESERVED_NAMES:
        return problems.add(path, f"{value!r} is reserved (enginectl uses it for every engine)")
    return value


def _blame(engine_path: str, *located: _Located) -> str | None:
    """Where to report a cross-field problem: a value this engine set, else the first one set
    at all."""
    paths = [path for _, path in located if path is not None]
    return next((p for p in paths if p.startswith(engine_path + ".")), paths[0] if paths else None)


# engine_args that have one source of truth elsewhere in the spec, or start processes engined
# would not supervise (tensor/pipeline/data parallel workers, a second torch.distributed user).
_OWNED_ARGS = {
    "model": "the model comes from `model:`",
    "dtype": "set the dtype once, in `model: {path: DIR, dtype: ...}`",
    "max_num_seqs": "`max_batch_size` is vLLM's max_num_seqs: set that instead",
}
_PARALLEL_ARGS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


def _check_backend(problems: _Problems, s: dict[str, _Located], path: str) -> None:
    (backend, backend_at), (args, args_at) = s["backend"], s["engine_args"]
    if _any_bad(backend, args):
        return
    args_at = args_at or f"{path}.engine_args"
    if args and backend != "vllm":
        problems.add(args_at, f"engine_args are passed to vLLM: they need backend: vllm "
                              f"(this engine's backend is {backend}){_for(args_at, path)}")
        return
    for key, value in args:
        if key in _OWNED_ARGS:
            problems.add(f"{args_at}.{key}", _OWNED_ARGS[key])
        elif key in _PARALLEL_ARGS and json.loads(value) not in (1, None):
            problems.add(f"{args_at}.{key}", f"{key} > 1 starts vLLM worker processes engined "
                                             f"would not supervise: not supported in this "
                                             f"version (run one engine per GPU instead)")
    dp, dp_at = s["data_parallel"]
    if backend == "vllm" and dp is True:
        problems.add(dp_at or backend_at or f"{path}.data_parallel",
                     f"data_parallel: true is not supported with backend: vllm (a second "
                     f"torch.distributed user){_for(dp_at or backend_at or path, path)}")


def _for(at: str, path: str) -> str:
    return "" if at.startswith(path + ".") else f" (for {path})"


def _check_backoff(problems: _Problems, s: dict[str, _Located], path: str) -> None:
    initial, maximum = s["backoff.initial"], s["backoff.max"]
    if _any_bad(initial[0], maximum[0]) or maximum[0] >= initial[0]:
        return
    # blame is never None here: the built-in defaults are consistent, so someone set one of them
    problems.add(
        _blame(path, maximum, initial) or path,
        f"backoff.max ({_fmt_duration(maximum[0])}) must be "
        f">= backoff.initial ({_fmt_duration(initial[0])})",
    )


def _check_gpu_split(problems: _Problems, s: dict[str, _Located], replicas: int, path: str) -> None:
    (gpus, gpus_at), (per, per_at) = s["gpus"], s["gpus_per_replica"]
    standby = s["standby"][0]
    if _any_bad(gpus, per, standby):
        return
    # these depend on this engine's replicas: name the engine when the value came from defaults
    per_at = per_at or f"{path}.gpus_per_replica"
    gpus_at = gpus_at or f"{path}.gpus"
    suffix = lambda at: "" if at.startswith(path + ".") else f" (for {path})"  # noqa: E731
    if gpus and per == 0:
        problems.add(
            per_at,
            f"gpus_per_replica must be >= 1 when gpus are listed ({len(gpus)} given)"
            f"{suffix(per_at)}",
        )
    elif not gpus and per > 0:
        problems.add(per_at, f"gpus_per_replica is {per} but no gpus are listed{suffix(per_at)}")
    elif gpus and len(gpus) != (replicas + standby) * per:
        count = f"(replicas ({replicas}) + standby ({standby}))" if standby else \
            f"replicas ({replicas})"
        problems.add(
            gpus_at,
            f"{len(gpus)} gpus listed, but {count} x gpus_per_replica ({per}) "
            f"= {(replicas + standby) * per}{suffix(gpus_at)}",
        )


def _check_names(problems: _Problems, groups: list[_Group]) -> None:
    """Engine names must be unique, and so must every NAME enginectl accepts (group or replica)."""
    first: dict[str, int] = {}
    taken: dict[str, tuple[int, str]] = {}  # name -> (engine index, what it names)
    for g in groups:
        path = f"engines[{g.index}].name"
        if g.name in first:
            problems.add(path, f"duplicate engine name {g.name!r} (also engines[{first[g.name]}])")
            continue
        first[g.name] = g.index
        names = [(g.name, f"engine {g.name!r}")]
        names += [(f"{g.name}-{r}", f"replica {g.name}-{r}") for r in range(g.replicas)]
        standby = g.settings["standby"][0]
        if standby is not _BAD:
            names += [(standby_name(g.name, k), f"standby {standby_name(g.name, k)}")
                      for k in range(standby)]
        for name, what in names:
            if name in taken and taken[name][0] != g.index:
                other_index, other = taken[name]
                problems.add(path, f"{what} collides with {other} of engines[{other_index}]")
            taken.setdefault(name, (g.index, what))


def _check_model_names(problems: _Problems, groups: list[_Group]) -> None:
    """The gateway's model names (served_model_name, else the group's name) are unique."""
    served: dict[str, _Group] = {}
    for g in groups:
        name, at = g.settings["served_model_name"]
        if name is _BAD:
            continue
        name = name or g.name
        other = served.setdefault(name, g)
        if other is not g:
            problems.add(at or f"engines[{g.index}].name",
                         f"model name {name!r} is served by engine {other.name!r} "
                         f"(engines[{other.index}]) too: the gateway could not tell them apart")
    for g in groups:
        (surge, surge_at), (gpus, _) = g.settings["rollout.max_surge"], g.settings["gpus"]
        if not _any_bad(surge, gpus) and surge and gpus:
            problems.add(surge_at or f"engines[{g.index}].rollout.max_surge",
                         "max_surge > 0 needs an engine without GPUs (a surge replica would "
                         "need GPUs of its own)")


def _check_gpu_overlap(problems: _Problems, groups: list[_Group]) -> None:
    owner: dict[int, _Group] = {}
    for g in groups:
        gpus, gpus_path = g.settings["gpus"]
        if gpus is _BAD:
            continue
        for i, gpu in enumerate(gpus):
            other = owner.setdefault(gpu, g)
            if other is not g:
                problems.add(
                    f"{gpus_path or f'engines[{g.index}].gpus'}[{i}]",
                    f"GPU {gpu} is used by both engine {other.name!r} (engines[{other.index}]) "
                    f"and engine {g.name!r} (engines[{g.index}])",
                )


def _expand(g: _Group) -> list[EngineSpec]:
    s = {key: value for key, (value, _) in g.settings.items()}
    backoff = BackoffSpec(
        initial_s=s["backoff.initial"],
        max_s=s["backoff.max"],
        factor=s["backoff.factor"],
        jitter=s["backoff.jitter"],
        reset_after_s=s["backoff.reset_after"],
    )
    start_limit = StartLimitSpec(burst=s["start_limit.burst"], interval_s=s["start_limit.interval"])
    per = s["gpus_per_replica"]
    command, port = s.get("command", ()), s.get("port")
    probe, progress = s["probe"], s.get("progress")
    if command:
        model = ModelSpec(source=f"command:{command[0]}", builtin=None, path=None, dtype=None)
        if probe is None:
            probe = ProbeSpec() if port is not None else False
    else:
        model, probe = s["model"], False
    # progress: vllm means the server is vLLM's: its API (and extensions) come with it
    openai = s.get("openai", "vllm" if progress == VLLM_PROGRESS else "")
    serving = [_replica(g, s, rank, per, model, backoff, start_limit, command, port, probe,
                        progress, openai) for rank in range(g.replicas)]
    # warm spares: built like a replica on GPUs of their own (after the replicas' in `gpus`)
    spares = [dataclasses.replace(_replica(g, s, g.replicas + k, per, model, backoff,
                                           start_limit, command, port, probe, progress, openai),
                                  name=standby_name(g.name, k), standby=True, rank=k)
              for k in range(s["standby"])]
    return serving + spares


def standby_name(group: str, k: int) -> str:
    return f"{group}-standby-{k}"


def _replica(g: _Group, s: dict[str, Any], rank: int, per: int, model: ModelSpec,
         backoff: BackoffSpec, start_limit: StartLimitSpec, command: tuple[str, ...],
         port: int | None, probe: Any, progress: ProgressSpec | None,
         openai: str) -> EngineSpec:
    return EngineSpec(
        name=f"{g.name}-{rank}",
        group=g.name,
        rank=rank,
        replicas=g.replicas,
        model=model,
        gpus=tuple(s["gpus"][rank * per : (rank + 1) * per]),
        data_parallel=s["data_parallel"],
        max_batch_size=s["max_batch_size"],
        threads=s["threads"],
        env=s["env"],
        restart=s["restart"],
        backoff=backoff,
        start_limit=start_limit,
        startup_timeout_s=s["startup_timeout"],
        stall_timeout_s=s["stall_timeout"],
        stop_timeout_s=s["stop_timeout"],
        served_model_name=s["served_model_name"] or g.name,
        queue_limit=s["queue_limit"],
        request_timeout_s=s["request_timeout"],
        migration_limit=s["migration_limit"],
        rollout=RolloutSpec(s["rollout.max_unavailable"], s["rollout.max_surge"]),
        command=command,
        port=None if port is None else (port + rank if port else 0),
        cwd=s.get("cwd"),
        probe=probe or None,
        progress=progress,
        openai=openai,
        python=None if command else s["python"],
        backend="command" if command else s["backend"],
        engine_args=() if command else s["engine_args"],
        launcher="exec" if command else s["launcher"] or "",
    )
