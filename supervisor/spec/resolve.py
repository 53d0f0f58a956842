"""Stage 3: plain values -> FleetSpec (types, ranges, defaults merged, replicas expanded, cross
checks across engines). Which keys each section allows, their checks and defaults come from
spec/keys.py."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from engined.supervisor.spec.autogpus import AutoGpus, GpuLookup, no_gpus
from engined.supervisor.spec.checks import (
    _BAD,
    _any_bad,
    _fmt_duration,
    _Located,
    _mapping,
    _Problems,
    _unknown_keys,
)
from engined.supervisor.spec.keys import (
    ALLOWED,
    CHILD_ONLY,
    COMMAND_KEYS,
    COMMAND_ONLY,
    ENGINE_KEYS,
    HINTS,
    REQUIRED,
    SETTING_KEYS,
    SUPERVISOR_KEYS,
    Key,
    by_section,
    fill,
)
from engined.supervisor.spec.model import (
    VLLM_PROGRESS,
    CanarySpec,
    EngineSpec,
    FleetSpec,
    ModelSpec,
    ProbeSpec,
    SupervisorSpec,
)
from engined.supervisor.spec.ondemand import check_budget, check_group
from engined.supervisor.spec.source import _describe, _join
from engined.supervisor.spec.upstreams import upstreams

# every engine-level key's default: what an engine has before defaults: and its own keys apply
_BUILTIN_SETTINGS: dict[str, _Located] = {
    key.name: (key.default, None) for key in (*SETTING_KEYS, *COMMAND_KEYS)
    if key.default is not REQUIRED
}


def _resolve(root: Any, lines: Mapping[str, int], source: str,
             gpus: GpuLookup | None = None) -> FleetSpec:
    problems = _Problems()
    if not isinstance(root, dict):
        problems.add(
            "",
            "top level must be a mapping (version, supervisor, defaults, engines or "
            "upstreams); "
            f"got {_describe(root)}",
        )
        problems.raise_if_any(source, lines)
    top: dict[str, Any] = root
    _unknown_keys(problems, top, "",
                  ("version", "supervisor", "defaults", "engines", "upstreams"))
    _check_version(problems, top)
    supervisor = _supervisor(problems, top.get("supervisor"))
    if "upstreams" in top:  # a cluster gateway: node gateways instead of engines of its own
        return _cluster(problems, top, supervisor, source, lines)
    defaults = _defaults(problems, top.get("defaults"))
    engines = _engines(problems, top, defaults, gpus)
    _check_replica_ports(problems, supervisor, engines)
    budget = supervisor.memory_budget
    if budget is not _BAD:
        check_budget(problems, (budget.host, budget.gpu), engines)
    problems.raise_if_any(source, lines)
    if supervisor.launcher is not _BAD:
        engines = tuple(e if e.is_command or e.launcher else
                        dataclasses.replace(e, launcher=supervisor.launcher) for e in engines)
    return FleetSpec(source=source, supervisor=supervisor, engines=engines)


def _cluster(problems: _Problems, top: Mapping[str, Any], supervisor: SupervisorSpec,
             source: str, lines: Mapping[str, int]) -> FleetSpec:
    """A spec with `upstreams:`: it has no engines (nor their defaults), and serves a gateway."""
    for key in ("engines", "defaults"):
        if key in top:
            problems.add(key, f"a cluster gateway (upstreams:) has no engines of its own: "
                              f"remove '{key}', or 'upstreams'")
    found = upstreams(problems, top["upstreams"])
    if supervisor is not _BAD and supervisor.gateway is None:
        problems.add("supervisor.gateway", "a cluster gateway (upstreams:) serves the OpenAI "
                                           "API: set supervisor.gateway to HOST:PORT")
    if supervisor is not _BAD and supervisor.replica_ports is not None:
        problems.add("supervisor.replica_ports", "a cluster gateway has no replicas of its own")
    problems.raise_if_any(source, lines)
    return FleetSpec(source=source, supervisor=supervisor, engines=(), upstreams=found)


def _check_control_tcp(problems: _Problems, values: dict[str, Any]) -> None:
    """The control API is never on TCP without a token; TLS takes a certificate and its key."""
    tcp, token = values["control_tcp"], values["control_token_file"]
    if _any_bad(tcp, token):
        return
    if tcp is not None and token is None:
        problems.add("supervisor.control_tcp", "control_tcp needs control_token_file: the "
                                               "control API is never on TCP without a token")
    cert, key = values["control_tls_cert"], values["control_tls_key"]
    if not _any_bad(cert, key) and (cert is None) != (key is None):
        problems.add("supervisor.control_tls_key" if cert else "supervisor.control_tls_cert",
                     "control_tls_cert and control_tls_key go together")
    if not _any_bad(cert) and cert is not None and tcp is None:
        problems.add("supervisor.control_tls_cert", "TLS is for control_tcp, which is off")
    http, gateway = values["http"], values["gateway"]
    for name, other in (("http", http), ("gateway", gateway)):
        if tcp is not None and not _any_bad(other) and other == tcp:
            problems.add("supervisor.control_tcp", f"control_tcp and {name} cannot share "
                                                   f"{tcp[0]}:{tcp[1]}")


def _check_replica_ports(problems: _Problems, sup: SupervisorSpec,
                         engines: tuple[EngineSpec, ...]) -> None:
    """supervisor.replica_ports: on the gateway's host, one port per serving replica, none of
    them the gateway's or the HTTP endpoint's."""
    base = sup.replica_ports
    if base is None or _any_bad(base, sup.gateway, sup.http):
        return
    path = "supervisor.replica_ports"
    if sup.gateway is None:
        problems.add(path, "replica_ports needs supervisor.gateway (its host, and the API the "
                           "replicas' ports serve)")
        return
    count = sum(1 for e in engines if not e.standby)
    ports = range(base, base + count)
    if count and ports[-1] > 65535:
        problems.add(path, f"{count} replicas need ports {base}..{ports[-1]}: past 65535")
    for what, address in (("gateway", sup.gateway), ("http", sup.http)):
        if address is not None and address[1] in ports and (
                address[0] == sup.gateway[0] or "0.0.0.0" in (address[0], sup.gateway[0])):
            problems.add(path, f"replica ports {base}..{base + count - 1} include "
                               f"supervisor.{what}'s port {address[1]}")


def _check_version(problems: _Problems, top: Mapping[str, Any]) -> None:
    if "version" not in top:
        problems.add("version", "required: add 'version: 1' at the top")
    elif type(top["version"]) is not int or top["version"] != 1:
        problems.add("version", f"must be 1, got {_describe(top['version'])}")


def _supervisor(problems: _Problems, raw: Any) -> SupervisorSpec:
    section = _mapping(problems, raw, "supervisor", null_ok=True) or {}
    _unknown_keys(problems, section, "supervisor", ALLOWED["supervisor"], HINTS["supervisor"])
    values = {key.name: key.default for key in SUPERVISOR_KEYS}
    for name, (value, _) in _check_keys(problems, section, "supervisor", SUPERVISOR_KEYS).items():
        values[name] = value
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
    _check_control_tcp(problems, values)
    gateway, http = values["gateway"], values["http"]
    if not _any_bad(gateway, http) and gateway is not None and gateway == http:
        problems.add("supervisor.gateway", f"gateway and http cannot share {gateway[0]}:"
                                           f"{gateway[1]}")
    return fill(SupervisorSpec, {key.field: values[key.name] for key in SUPERVISOR_KEYS
                                 if key.field is not None})


def _defaults(problems: _Problems, raw: Any) -> dict[str, _Located]:
    section = _mapping(problems, raw, "defaults", null_ok=True) or {}
    _unknown_keys(problems, section, "defaults", ALLOWED["defaults"], HINTS["defaults"])
    return _check_keys(problems, section, "defaults", SETTING_KEYS)


def _check_keys(problems: _Problems, section: Mapping[str, Any], path: str,
                keys: Iterable[Key]) -> dict[str, _Located]:
    """Those of `keys` present in `section`, checked and located; a nested section's keys come
    flattened ("backoff.initial")."""
    out: dict[str, _Located] = {}
    for top, group in by_section(keys):
        if top not in section:
            continue
        at = _join(path, top)
        if group[0].name == top:  # a plain key
            out[top] = (group[0].check(problems, section[top], at), at)
            continue
        nested = _mapping(problems, section[top], at, null_ok=True)
        if nested is None:
            continue
        subs = {key.name[len(top) + 1:]: key for key in group}
        _unknown_keys(problems, nested, at, subs)
        for sub, key in subs.items():
            if sub in nested:
                out[key.name] = (key.check(problems, nested[sub], f"{at}.{sub}"), f"{at}.{sub}")
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
    problems: _Problems, top: Mapping[str, Any], defaults: dict[str, _Located],
    gpus: GpuLookup | None = None
) -> tuple[EngineSpec, ...]:
    raw = top.get("engines")
    if "engines" not in top or not isinstance(raw, list) or not raw:
        got = "it is missing" if "engines" not in top else f"got {_describe(raw)}"
        problems.add("engines", f"must be a non-empty list of engines; {got}")
        return ()
    auto = AutoGpus(raw, gpus or no_gpus)
    groups = [_group(problems, item, i, defaults, auto) for i, item in enumerate(raw)]
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
    problems: _Problems, raw: Any, index: int, defaults: dict[str, _Located],
    auto: AutoGpus | None = None
) -> _Group | None:
    path = f"engines[{index}]"
    section = _mapping(problems, raw, path)
    if section is None:
        return None
    _unknown_keys(problems, section, path, ALLOWED["engine"], HINTS["engine"])
    if "name" in section:
        name = ENGINE_KEYS["name"].check(problems, section["name"], f"{path}.name")
    else:
        name = problems.add(f"{path}.name", "required: each engine needs a name")
    replicas_key = ENGINE_KEYS["replicas"]
    replicas = replicas_key.check(problems, section.get("replicas", replicas_key.default),
                                  f"{path}.replicas")
    settings = {**_BUILTIN_SETTINGS, **defaults,
                **_check_keys(problems, section, path, SETTING_KEYS),
                **_check_keys(problems, section, path, COMMAND_KEYS)}
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
        for key in COMMAND_ONLY:
            if key in section:
                problems.add(f"{path}.{key}", f"{key} applies to command engines only (this "
                                              f"engine runs a model; add command: [...])")
        probe, probe_at = settings["probe"]
        if probe not in (None, _BAD) and probe_at and probe_at.startswith(path + "."):
            problems.add(probe_at, "probe applies to command engines only (engined's own "
                                   "engines heartbeat)")
    check_group(problems, settings, replicas, path, section.get("command"))
    standby, standby_at = settings["standby"]
    dp = settings["data_parallel"][0]
    if standby not in (0, _BAD) and dp is True:
        problems.add(standby_at or f"{path}.standby",
                     f"standby is not supported with data_parallel: true (a spare rank could "
                     f"not join a running torch.distributed group){_for(standby_at or path, path)}")
    if replicas is not _BAD:
        if auto is not None:
            auto.allot(problems, settings, replicas, path)
        _check_gpu_split(problems, settings, replicas, path)
        port = settings["port"][0]
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
    for key in CHILD_ONLY:
        if key in section:
            problems.add(f"{path}.{key}", f"{key} and command are exclusive: a command engine "
                                          f"runs its own server (put {key} in its arguments)")
    dp, dp_at = s["data_parallel"]
    if dp is True:
        problems.add(dp_at or f"{path}.data_parallel",
                     f"data_parallel: true is not supported for a command engine (engined "
                     f"cannot form its torch.distributed group){_for(dp_at or path, path)}")
    argv = s["command"][0]
    port = s["port"][0]
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
    frontend, frontend_at = s["frontend_args"]
    if frontend and frontend is not _BAD and backend != "vllm":
        frontend_at = frontend_at or f"{path}.frontend_args"
        problems.add(frontend_at, f"frontend_args are vLLM's: they need backend: vllm (this "
                                  f"engine's backend is {backend}){_for(frontend_at, path)}")
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
    limit, limit_at = s["memory_limit"]
    if backend == "vllm" and limit is not None and limit is not _BAD:
        _check_kv_sizing(problems, s, path, args, args_at, limit_at)
    dp, dp_at = s["data_parallel"]
    if backend == "vllm" and dp is True:
        problems.add(dp_at or backend_at or f"{path}.data_parallel",
                     f"data_parallel: true is not supported with backend: vllm (a second "
                     f"torch.distributed user){_for(dp_at or backend_at or path, path)}")


# what else sizes vLLM's KV cache: memory_limit does, for a vLLM engine that has one
_KV_SIZING_ARGS = ("gpu_memory_utilization", "kv_cache_memory_bytes")


def _check_kv_sizing(problems: _Problems, s: dict[str, _Located], path: str,
                     args: Any, args_at: str, limit_at: str | None) -> None:
    at = limit_at or f"{path}.memory_limit"
    for key, _ in args:
        if key in _KV_SIZING_ARGS:
            problems.add(f"{args_at}.{key}", f"{key} sizes vLLM's KV cache, and so does "
                                             f"memory_limit ({at}): set one of them")
    env, env_at = s["env"]
    if env is not _BAD and any(k == "VLLM_CPU_KVCACHE_SPACE" for k, _ in env):
        problems.add(f"{env_at or path + '.env'}.VLLM_CPU_KVCACHE_SPACE",
                     f"VLLM_CPU_KVCACHE_SPACE sizes vLLM's KV cache, and so does memory_limit "
                     f"({at}): set one of them")


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
    group = _group_fields(g)
    per = g.settings["gpus_per_replica"][0]
    serving = [_replica(group, g, rank, per) for rank in range(g.replicas)]
    # warm spares: built like a replica on GPUs of their own (after the replicas' in `gpus`)
    spares = [dataclasses.replace(_replica(group, g, g.replicas + k, per),
                                  name=standby_name(g.name, k), standby=True, rank=k)
              for k in range(g.settings["standby"][0])]
    return serving + spares


def standby_name(group: str, k: int) -> str:
    return f"{group}-standby-{k}"


def _group_fields(g: _Group) -> dict[str, Any]:
    """The EngineSpec fields every replica of the group shares: each key's value in the field it
    fills, then what depends on the kind of engine."""
    s = {key: value for key, (value, _) in g.settings.items()}
    fields = {key.field: s[key.name] for key in ENGINE_KEYS.values()
              if key.field is not None and key.name in s}
    fields.update(group=g.name, replicas=g.replicas,
                  served_model_name=s["served_model_name"] or g.name)
    command, probe = s["command"], s["probe"]
    if command:
        if probe is None:  # a server with a port is probed unless it says probe: off
            probe = ProbeSpec() if s["port"] is not None else False
        fields.update(model=ModelSpec(source=f"command:{command[0]}", builtin=None, path=None,
                                      dtype=None),
                      python=None, backend="command", engine_args=(), frontend_args=(),
                      launcher="exec")
    else:
        probe = False  # engined's own engines heartbeat
        fields.update(launcher=s["launcher"] or "")  # "": the supervisor's, filled in later
    fields.update(probe=probe or None)
    if s["openai"] is None:  # progress: vllm means the server is vLLM's: its API comes with it
        fields.update(openai="vllm" if s["progress"] == VLLM_PROGRESS else "")
    openai = fields.get("openai", s["openai"])
    canary = s["canary"]
    if canary is None:  # on by default where it can be sent: a server with an OpenAI API
        canary = CanarySpec() if command and openai and s["port"] is not None else False
    fields.update(canary=canary or None)
    return fields


def _replica(group: dict[str, Any], g: _Group, rank: int, per: int) -> EngineSpec:
    port = group["port"]
    return fill(EngineSpec, {
        **group,
        "name": f"{g.name}-{rank}",
        "rank": rank,
        "gpus": tuple(group["gpus"][rank * per : (rank + 1) * per]),
        "port": None if port is None else (port + rank if port else 0),
    })
