"""Every spec key, defined once: where it may be written, its check, its default, what it means and
how `engined --check` shows it.

The rest of the package derives from KEYS: the keys each section allows and the "belongs under
..." hints, validation and the built-in defaults (resolve), the fields of the resolved
dataclasses (resolve, through `fill`), and the --check listing (format). A new key is one entry
here, plus the SupervisorSpec/EngineSpec field it fills.

A key's default is written once. Most keys take the default of the field they fill
(`queue_limit: int = 256` in model.py); a key with no field of that meaning (gpus_per_replica,
standby) or whose field means something else before resolution (an engine's launcher: unset means
the supervisor's) states its own.

KEYS's order counts twice: a --check row shows its parts in this order, and problems found on one
YAML line are listed in this order (the order the keys are checked in).
"""

from __future__ import annotations

import builtins
import dataclasses
import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, TypeVar

from engined.supervisor.spec.checks import (
    BACKENDS,
    ENGINE_LOGS,
    LAUNCHERS,
    MAX_GPU_INDEX,
    RESTART_POLICIES,
    _bool,
    _Check,
    _duration,
    _engine_args,
    _engine_name,
    _enum,
    _env,
    _factor,
    _fmt_duration,
    _frontend_args,
    _gpus,
    _http,
    _int_in,
    _jitter,
    _model,
    _optional_port,
    _optional_size,
    _optional_text,
    _size,
)
from engined.supervisor.spec.command_checks import (
    _canary,
    _command,
    _openai,
    _port,
    _probe,
    _progress,
)
from engined.supervisor.spec.model import EngineSpec, SupervisorSpec
from engined.supervisor.spec.ondemand import (
    SLEEP_MODES,
    _adapters,
    _optional_duration,
)
from engined.supervisor.spec.texts import (
    _address,
    _fmt_bytes,
    _http_address,
    _model_text,
    _or_default,
    _port_text,
    _printable,
    _printable_if_set,
    _probe_text,
    _progress_text,
)

# The resolved dataclasses ------------------------------------------------------------------

T = TypeVar("T")


def field_default(owner: type, path: str) -> Any:
    """The default of the field at `path` ("backoff.initial_s") of the dataclass `owner`."""
    head, _, rest = path.partition(".")
    field = next(f for f in dataclasses.fields(owner) if f.name == head)
    if field.default is dataclasses.MISSING:
        raise TypeError(f"{owner.__name__}.{head} has no default: give its key one")
    return attrgetter(rest)(field.default) if rest else field.default


def fill(owner: type[T], values: Mapping[str, Any]) -> T:
    """`owner` built from {field path: value}: "backoff.initial_s" sets one field of the nested
    BackoffSpec, whose other fields keep their defaults."""
    flat: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        head, dot, rest = path.partition(".")
        if dot:
            nested.setdefault(head, {})[rest] = value
        else:
            flat[head] = value
    for head, fields in nested.items():
        flat[head] = dataclasses.replace(field_default(owner, head), **fields)
    return owner(**flat)


class Scope(enum.Enum):
    """Where a key may be written."""

    SUPERVISOR = "supervisor"  # under supervisor: (engined's own settings)
    SETTING = "setting"  # under defaults: (every engine) or in an engine, which wins
    ENGINE = "engine"  # in an engine only, never in defaults
    COMMAND = "command"  # in a command engine only (a server engined did not write)

    @property
    def sections(self) -> tuple[str, ...]:
        """The sections ("supervisor", "defaults", "engine") a key of this scope may be in."""
        if self is Scope.SUPERVISOR:
            return ("supervisor",)
        return ("defaults", "engine") if self is Scope.SETTING else ("engine",)


SECTIONS = ("supervisor", "defaults", "engine")
FROM_FIELD: Any = object()  # a Key's default: the one the field it fills declares
REQUIRED: Any = object()  # a Key's default: none, the key must be written


@dataclass(frozen=True)
class Shown:
    """How `engined --check` shows a key: one part of a row (format.py lists the rows), after
    the parts of the keys before it in KEYS."""

    row: str
    text: str = "{}"  # filled with the resolved value, after `fmt`
    fmt: Callable[[Any], Any] | None = None  # returns None: the part is left out
    sep: str = ", "  # between this part and the one before it

    def render(self, value: Any) -> str | None:
        shown = self.fmt(value) if self.fmt is not None else value
        return None if shown is None else self.text.format(shown)


@dataclass(frozen=True)
class Key:
    """One spec key. `name` is dotted in a nested section ("backoff.initial")."""

    name: str
    scope: Scope
    check: _Check  # (problems, value, key path) -> the validated value, or _BAD
    field: str | None  # the SupervisorSpec/EngineSpec attribute it fills ("backoff.initial_s")
    doc: str
    shown: Shown | None = None  # None: not in --check's rows (the header says it, or nothing)
    default: Any = FROM_FIELD  # in the field's terms: seconds, bytes, ...
    child_only: bool = False  # only engined's own engine child uses it (an error with command:)
    # for the spec reference (python -m engined.supervisor.spec.reference): the value's kind as
    # a reader writes it, a value as written in YAML, and the keys of the same section that must
    # be written beside it for the example to hold
    type: str = ""
    example: Any = None
    example_with: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.default is FROM_FIELD:
            if self.field is None:
                raise TypeError(f"key {self.name!r} fills no field: give it a default")
            object.__setattr__(self, "default", field_default(self.owner, self.field))

    @property
    def owner(self) -> builtins.type:  # `type` is a field of this class
        """The resolved dataclass whose field it fills."""
        return SupervisorSpec if self.scope is Scope.SUPERVISOR else EngineSpec

    @property
    def top(self) -> str:
        """The key as written in its section: "backoff" for "backoff.initial"."""
        return self.name.partition(".")[0]

    def value_in(self, resolved: Any) -> Any:
        """Its value in a resolved SupervisorSpec or EngineSpec."""
        assert self.field is not None, self.name
        return attrgetter(self.field)(resolved)


_DURATION = _duration(positive=True)
_SECONDS = _duration(positive=False)  # 0 allowed

# The keys ------------------------------------------------------------------------------------

_SUP, _SET, _ENG, _CMD = Scope.SUPERVISOR, Scope.SETTING, Scope.ENGINE, Scope.COMMAND
KEYS: tuple[Key, ...] = (
    # supervisor:
    Key("http", _SUP, _http, "http",
        "/metrics /health /livez /readyz: HOST:PORT, or off", Shown("http", fmt=_http_address),
        type="`HOST:PORT` or `off`", example="0.0.0.0:9400"),
    Key("gateway", _SUP, _http, "gateway",
        "the OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models): "
        "HOST:PORT; off when absent", Shown("gateway", fmt=_address),
        type="`HOST:PORT` or `off`", example="0.0.0.0:8000"),
    Key("api_key_file", _SUP, _optional_text, "api_key_file",
        "a file holding the bearer token the gateway requires (re-read on reload)",
        Shown("gateway", "(bearer token from {})", _printable_if_set, sep=" "),
        type="path or `null`", example="/etc/engined/api-key"),
    Key("control_tcp", _SUP, _http, "control_tcp",
        "enginectl's API on TCP as well (enginectl --host): HOST:PORT, only with "
        "control_token_file; off when absent", Shown("control_tcp", fmt=_address),
        type="`HOST:PORT` or `off`", example="0.0.0.0:9500",
        example_with={"control_token_file": "/etc/engined/control.token"}),
    Key("control_token_file", _SUP, _optional_text, "control_token_file",
        "a file holding the bearer token control_tcp requires (re-read on reload)",
        Shown("control_tcp", "(bearer token from {})", _printable_if_set, sep=" "),
        type="path or `null`", example="/etc/engined/control.token",
        example_with={"control_tcp": "0.0.0.0:9500"}),
    Key("control_tls_cert", _SUP, _optional_text, "control_tls_cert",
        "PEM certificate (chain) for control_tcp: TLS; with control_tls_key",
        Shown("control_tcp", "TLS {}", _printable_if_set),
        type="path or `null`", example="/etc/engined/tls.crt",
        example_with={"control_tls_key": "/etc/engined/tls.key", "control_tcp": "0.0.0.0:9500",
                      "control_token_file": "/etc/engined/control.token"}),
    Key("control_tls_key", _SUP, _optional_text, "control_tls_key",
        "PEM private key of control_tls_cert",
        type="path or `null`", example="/etc/engined/tls.key",
        example_with={"control_tls_cert": "/etc/engined/tls.crt", "control_tcp": "0.0.0.0:9500",
                      "control_token_file": "/etc/engined/control.token"}),
    Key("control_socket", _SUP, _optional_text, "control_socket",
        "enginectl's unix socket; null: <runtime_dir>/control.sock",
        Shown("control_socket", fmt=_or_default("<runtime_dir>/control.sock")),
        type="path or `null`", example="/run/engined/control.sock"),
    Key("runtime_dir", _SUP, _optional_text, "runtime_dir",
        "null: $RUNTIME_DIRECTORY, else $XDG_RUNTIME_DIR/engined, else /tmp/engined-<uid>",
        Shown("runtime_dir", fmt=_or_default(
            "$RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/engined or /tmp/engined-<uid>")),
        type="path or `null`", example="/run/engined"),
    Key("log_dir", _SUP, _optional_text, "log_dir",
        "per-engine log files; null: $LOGS_DIRECTORY, else <runtime_dir>/logs",
        Shown("log_dir", fmt=_or_default("$LOGS_DIRECTORY or <runtime_dir>/logs")),
        type="path or `null`", example="/var/log/engined"),
    Key("heartbeat_interval", _SUP, _DURATION, "heartbeat_interval_s",
        "how often a READY engine reports progress",
        Shown("heartbeat", "every {}", _fmt_duration),
        type="duration", example="500ms"),
    Key("heartbeat_timeout", _SUP, _DURATION, "heartbeat_timeout_s",
        "no heartbeat for this long: hung, killed and restarted (more than heartbeat_interval)",
        Shown("heartbeat", "timeout {}", _fmt_duration),
        type="duration", example="30s"),
    Key("launcher", _SUP, _enum(LAUNCHERS), "launcher",
        "how engine children start: forkserver (forked from a preloaded server) or exec",
        Shown("launcher"),
        type="`forkserver` or `exec`", example="exec"),
    Key("log_max_bytes", _SUP, _size(4096, 1 << 40), "log_max_bytes",
        "each engine's log file is rotated past this size (bytes; KiB, MiB, GiB accepted)",
        Shown("log_rotation", "at {}", _fmt_bytes),
        type="size", example="100MiB"),
    Key("log_backups", _SUP, _int_in(0, 100), "log_backups",
        "rotated files kept per engine (NAME.log.1 ... .N); 0: start the file again",
        Shown("log_rotation", "{} backup(s) per engine"),
        type="integer", example=5),
    Key("orphan_timeout", _SUP, _SECONDS, "orphan_timeout_s",
        "after engined dies unplanned (SIGKILL, crash, OOM kill), its engines keep running this "
        "long for the next engined on the same runtime_dir to adopt, then exit; 0: they die "
        "with engined", Shown("orphan_timeout", fmt=_fmt_duration),
        type="duration", example="5m"),
    Key("clients.header_timeout", _SUP, _DURATION, "clients.header_timeout_s",
        "a connection whose request headers are not complete this long after it was accepted "
        "or last answered is closed (slow headers and idle keep-alive alike)",
        Shown("clients", "headers {}", _fmt_duration),
        type="duration", example="5s"),
    Key("clients.body_timeout", _SUP, _DURATION, "clients.body_timeout_s",
        "a request body must arrive within this (plus its length at body_min_rate): 408",
        Shown("clients", "body {}", _fmt_duration),
        type="duration", example="1m"),
    Key("clients.body_min_rate", _SUP, _size(1, 1 << 40), "clients.body_min_rate",
        "bytes a second a large body is given on top of body_timeout",
        Shown("clients", "+ length at {}/s", _fmt_bytes, sep=" "),
        type="size", example="256KiB"),
    Key("clients.write_timeout", _SUP, _DURATION, "clients.write_timeout_s",
        "a client that reads nothing of its answer (a stream) this long is cut off and its "
        "request aborted in its engine", Shown("clients", "write {}", _fmt_duration),
        type="duration", example="1m"),
    Key("clients.max_connections", _SUP, _int_in(1, 1 << 20), "clients.max_connections",
        "open gateway connections; past it (or the fd reserve) the oldest idle or slowest "
        "connection is shed for a new one", Shown("clients", "at most {} connections"),
        type="integer", example=4096),
    Key("clients.max_per_address", _SUP, _int_in(0, 1 << 20), "clients.max_per_address",
        "open connections from one client address (gateway and metrics); 0: no cap",
        Shown("clients", "{} per address", lambda n: n or None),
        type="integer", example=64),
    Key("replica_ports", _SUP, _optional_port, "replica_ports",
        "BASE: each serving replica, in spec order, also on the gateway's host at BASE + i, "
        "its own OpenAI API and /metrics (an inference pool's endpoint per engine); null: off",
        Shown("gateway", "replicas on {} + i", sep=", "),
        type="port or `null`", example=8100,
        example_with={"gateway": "0.0.0.0:8000"}),
    Key("exit_on_failed", _SUP, _bool, "exit_on_failed",
        "an engine parked FAILED stops every engine and engined exits 1 (a container's "
        "orchestrator restarts the pod instead of leaving it degraded)",
        Shown("kubernetes", "exit_on_failed", lambda on: True if on else None),
        type="bool", example=True),
    Key("memory_budget.host", _SUP, _optional_size(1 << 20, 1 << 50), "memory_budget.host",
        "what engines without GPUs may hold together (their memory_limit, else what they "
        "measured); past it, on-demand engines are put to sleep, least recently used first",
        Shown("memory_budget", "host {}", lambda n: n and _fmt_bytes(n)),
        type="size or `null`", example="48GiB"),
    Key("memory_budget.gpu", _SUP, _optional_size(1 << 20, 1 << 50), "memory_budget.gpu",
        "the same for each GPU, against what engines on it hold",
        Shown("memory_budget", "gpu {}", lambda n: n and _fmt_bytes(n)),
        type="size or `null`", example="70GiB"),
    Key("engine_logs", _SUP, _enum(ENGINE_LOGS), "engine_logs",
        "files: each engine's output in log_dir; stdout: on engined's stdout instead, each "
        "line prefixed with its engine (what a container's log collector reads)",
        Shown("kubernetes", "engine logs on stdout",
              lambda where: True if where == "stdout" else None),
        type="`files` or `stdout`", example="stdout"),
    # an engine's own (the header of its --check rows shows them)
    Key("name", _ENG, _engine_name, "group",
        "the engine's name; its replicas are NAME-0, NAME-1, ...", default=REQUIRED,
        type="text: `[a-z0-9][a-z0-9_.-]{0,62}`, not `all`", example="chat"),
    Key("replicas", _ENG, _int_in(1, 1024), "replicas", "how many copies of the engine run",
        default=1,
        type="integer", example=2),
    # defaults: or an engine
    Key("restart", _SET, _enum(RESTART_POLICIES), "restart", "always | on-failure | never",
        Shown("restart"),
        type="`always`, `on-failure` or `never`", example="on-failure"),
    Key("startup_timeout", _SET, _DURATION, "startup_timeout_s",
        "spawn -> READY (model load and warm-up)", Shown("timeouts", "startup {}", _fmt_duration),
        type="duration", example="30m"),
    Key("stall_timeout", _SET, _DURATION, "stall_timeout_s",
        "no busy-loop progress this long while work is queued: stalled, restarted",
        Shown("timeouts", "stall {}", _fmt_duration),
        type="duration", example="2m"),
    Key("stop_timeout", _SET, _DURATION, "stop_timeout_s", "SIGTERM -> SIGKILL grace period",
        Shown("timeouts", "stop {}", _fmt_duration),
        type="duration", example="1m"),
    Key("model", _SET, _model, "model",
        "builtin:echo, builtin:tiny-llama or {path: DIR, dtype: ...} (a Hugging Face directory)",
        Shown("model", fmt=_model_text), default=REQUIRED, child_only=True,
        type="`builtin:echo`, `builtin:tiny-llama` or `{path: DIR, dtype: DTYPE}`",
        example={"path": "/models/llama", "dtype": "bfloat16"}),
    Key("gpus", _SET, _gpus, "gpus", "physical GPU indices, split across the replicas in order; "
        "auto: the GPUs visible to engined (CUDA_VISIBLE_DEVICES, else NVML) that no other "
        "engine takes",
        Shown("gpus", fmt=lambda gpus: ",".join(map(str, gpus)) or "none (CPU)"),
        type="list of GPU indices, or `auto`", example=[0],
        example_with={"gpus_per_replica": 1}),
    Key("gpus_per_replica", _SET, _int_in(0, MAX_GPU_INDEX + 1), None,
        "each replica's share of gpus: len(gpus) = (replicas + standby) x gpus_per_replica",
        default=0,
        type="integer", example=1,
        example_with={"gpus": [0]}),
    Key("max_batch_size", _SET, _int_in(1, 4096), "max_batch_size",
        "requests batched per busy-loop iteration", Shown("batch", "max_batch_size {}"),
        type="integer", example=32),
    Key("memory_limit", _SET, _optional_size(1 << 20, 1 << 50), "memory_limit",
        "the most memory the engine may hold, its model included (resident memory on a CPU, "
        "device memory on a GPU); a step past it shrinks the batch instead of killing the "
        "engine; null: none", child_only=True,
        type="size or `null`", example="6GiB"),
    Key("threads", _SET, _int_in(1, 1024), "threads",
        "torch / OpenMP threads per child, so replicas don't oversubscribe the CPU",
        Shown("batch", "threads {}"),
        type="integer", example=4),
    Key("data_parallel", _SET, _bool, "data_parallel",
        "true: the replicas form one data-parallel group (gang restart)",
        Shown("batch", "data_parallel {}", lambda dp: "yes" if dp else "no"),
        type="bool", example=True),
    Key("env", _SET, _env, "env",
        "extra environment for the children (not CUDA_VISIBLE_DEVICES, NOTIFY_SOCKET, ENGINED_*)",
        Shown("env", fmt=lambda env: " ".join(_printable(f"{k}={v}") for k, v in env) or "-"),
        type="mapping: NAME to a string or number", example={"HF_HOME": "/var/cache/hf"}),
    Key("python", _SET, _optional_text, "python",
        "the children's interpreter (another venv's bin/python); null: engined's own",
        Shown("python", fmt=_printable_if_set), child_only=True,
        type="path or `null`", example="/opt/vllm/bin/python"),
    Key("backend", _SET, _enum(BACKENDS), "backend",
        "transformers | vllm (builtin:echo uses neither)", Shown("backend"), child_only=True,
        type="`transformers` or `vllm`", example="vllm"),
    Key("engine_args", _SET, _engine_args, "engine_args",
        "vLLM's EngineArgs (backend: vllm), e.g. {max_model_len: 4096}",
        Shown("backend", "engine_args {}",
              lambda args: ", ".join(f"{k}={v}" for k, v in args) or "-", sep="; "),
        child_only=True,
        type="mapping: keyword to a plain value",
        example={"max_model_len": 4096, "enforce_eager": True},
        example_with={"backend": "vllm"}),
    Key("frontend_args", _SET, _frontend_args, "frontend_args",
        "vLLM's chat frontend options (backend: vllm): enable_auto_tool_choice, "
        "tool_call_parser, reasoning_parser, chat_template",
        Shown("backend", "frontend_args {}",
              lambda args: ", ".join(f"{k}={v}" for k, v in args) or "-", sep="; "),
        child_only=True,
        type="mapping: option to a bool or text",
        example={"enable_auto_tool_choice": True, "tool_call_parser": "hermes"},
        example_with={"backend": "vllm"}),
    Key("served_model_name", _SET, _optional_text, "served_model_name",
        "the gateway's model name; null: the engine's name", Shown("serving", "as {}", _printable),
        type="text or `null`", example="llama-3-8b"),
    Key("queue_limit", _SET, _int_in(1, 1_000_000), "queue_limit",
        "gateway requests per group, running or waiting; more -> 429",
        Shown("serving", "queue_limit {}"),
        type="integer", example=1024),
    Key("request_timeout", _SET, _DURATION, "request_timeout_s",
        "a gateway request's whole life, moves included; past it -> 503",
        Shown("serving", "request_timeout {}", _fmt_duration),
        type="duration", example="30m"),
    Key("migration_limit", _SET, _int_in(0, 100), "migration_limit",
        "times a request may move to another replica when its engine dies",
        Shown("serving", "migration_limit {}"),
        type="integer", example=5),
    # a command engine: a server engined did not write (`vllm serve`); its checks row shows
    # port, probe, progress and openai in this order
    Key("command", _CMD, _command, "command",
        "the server's argv (no shell); replaces model: {port} is the replica's port",
        Shown("command", fmt=lambda argv: _printable(" ".join(argv))),
        type="list of arguments (argv, no shell)",
        example=["llama-server", "-m", "/models/llama.gguf", "--port", "{port}"],
        example_with={"port": "auto"}),
    Key("port", _CMD, _port, "port",
        "auto (a free loopback port at each spawn) or N (replica i on N + i); also $PORT",
        Shown("checks", "port {}", _port_text),
        type="`auto` or a port number (1-65535)", example=8100),
    Key("cwd", _CMD, _optional_text, "cwd", "the server's working directory; null: engined's",
        Shown("cwd", fmt=lambda cwd: _printable(cwd or "-")),
        type="path or `null`", example="/srv/ext"),
    Key("probe", _SET, _probe, "probe",
        "{path, interval, timeout, failures}: READY at the first 2xx, hung after failures in a "
        "row (command engines with a port; off: none)", Shown("checks", fmt=_probe_text, sep="; "),
        type="`{path, interval, timeout, failures}` or `off`",
        example={"path": "/health", "interval": "5s", "timeout": "2s", "failures": 5}),
    Key("progress", _CMD, _progress, "progress",
        "vllm, or {metrics: PATH, busy: GAUGE, counter: COUNTER}: the server's progress",
        Shown("checks", fmt=_progress_text, sep="; "),
        type="`vllm` or `{metrics: PATH, busy: GAUGE, counter: COUNTER}`", example="vllm"),
    Key("openai", _CMD, _openai, "openai",
        "true: the gateway routes to its OpenAI API (vllm: with vLLM's extensions); unset: vllm "
        "with progress: vllm, else false",
        Shown("checks", "openai {}", lambda api: api or "no", sep="; "), default=None,
        type="`true`, `false` or `vllm`", example=True),
    Key("canary", _CMD, _canary, "canary",
        "{idle, timeout}: after idle with no request, a one-token completion; none within "
        "timeout: hung, restarted (reason canary); default on (10s, 20s) with openai; off: none",
        Shown("checks", fmt=lambda c: c and f"canary after {_fmt_duration(c.idle_s)} idle, "
              f"timeout {_fmt_duration(c.timeout_s)}", sep="; "), default=None,
        type="`{idle, timeout}` or `off`", example={"idle": "30s", "timeout": "1m"},
        example_with={"openai": True}),
    # engined's own engines
    Key("launcher", _SET, _enum(LAUNCHERS), "launcher",
        "this engine's launcher: overrides supervisor.launcher (command engines: always exec)",
        Shown("batch", "launcher {}"), default=None,
        type="`forkserver` or `exec`", example="exec"),
    Key("standby", _SET, _int_in(0, 64), None,
        "warm spares (NAME-standby-K): built, not routed; one takes over a replica that dies",
        default=0,
        type="integer", example=1),
    # on demand (docs/on-demand.md)
    Key("idle_timeout", _SET, _optional_duration, "idle_timeout_s",
        "on demand: this long with no request in flight or waiting, the replicas beyond "
        "min_replicas go to sleep; the next request wakes them; null: always awake",
        Shown("on_demand", "asleep after {} idle", lambda s: s and _fmt_duration(s)),
        type="duration or `null`", example="10m"),
    Key("min_replicas", _SET, _int_in(0, 1024), "min_replicas",
        "replicas an on-demand engine keeps awake (0: all sleep; with idle_timeout)",
        Shown("on_demand", "min_replicas {}"),
        type="integer", example=1, example_with={"idle_timeout": "10m"}),
    Key("wake_timeout", _SET, _DURATION, "wake_timeout_s",
        "how long a request waits for its model to wake; past it -> 503 with Retry-After",
        Shown("on_demand", "wake_timeout {}", _fmt_duration),
        type="duration", example="2m"),
    Key("sleep_mode", _SET, _enum(SLEEP_MODES), "sleep_mode",
        "stop (the process ends; a wake starts it) | level1 | level2 (vLLM's sleep mode, GPUs "
        "only, the process kept: weights to host memory / dropped, the KV cache dropped; a "
        "command needs --enable-sleep-mode)",
        Shown("on_demand", "sleep_mode {}"),
        type="`stop`, `level1` or `level2`", example="level1",
        example_with={"backend": "vllm", "gpus": [0], "gpus_per_replica": 1}),
    Key("adapters", _SET, _adapters, "adapters",
        "LoRA adapters, name -> directory: loaded at every start before the replica takes "
        "their requests (backend: vllm; builtin:echo mimics them)",
        Shown("adapters", fmt=lambda pairs: ", ".join(f"{n}={_printable(p)}"
                                                      for n, p in pairs) or None),
        type="mapping: adapter name to its directory", example={"sql": "/models/sql-lora"},
        example_with={"backend": "vllm"}),
    # nested sections (checked after the plain keys)
    Key("backoff.initial", _SET, _SECONDS, "backoff.initial_s",
        "the wait after the 2nd consecutive failure (the 1st after a stable run restarts at once)",
        Shown("backoff", "initial {}", _fmt_duration),
        type="duration", example="2s"),
    Key("backoff.max", _SET, _SECONDS, "backoff.max_s", "the longest wait",
        Shown("backoff", "max {}", _fmt_duration),
        type="duration", example="5m"),
    Key("backoff.factor", _SET, _factor, "backoff.factor",
        "each further failure waits this x longer", Shown("backoff", "factor {:g}"),
        type="number, at least 1", example=1.5),
    Key("backoff.jitter", _SET, _jitter, "backoff.jitter",
        "+/- this fraction of the wait, at random", Shown("backoff", "jitter {:g}"),
        type="number, at least 0 and under 1", example=0.2),
    Key("backoff.reset_after", _SET, _SECONDS, "backoff.reset_after_s",
        "READY this long resets the failure count", Shown("backoff", "reset after {}",
                                                          _fmt_duration),
        type="duration", example="5m"),
    Key("start_limit.burst", _SET, _int_in(1, 1_000_000), "start_limit.burst",
        "more failures than this within interval: FAILED until enginectl start",
        Shown("restart", "start_limit {}", sep="; "),
        type="integer", example=10),
    Key("start_limit.interval", _SET, _DURATION, "start_limit.interval_s",
        "the window start_limit.burst counts failures in",
        Shown("restart", "in {}", _fmt_duration, sep=" "),
        type="duration", example="10m"),
    Key("rollout.max_unavailable", _SET, _int_in(1, 1024), "rollout.max_unavailable",
        "replicas out of routing at once while a restart or reload replaces them",
        Shown("serving", "rollout max_unavailable {}"),
        type="integer", example=2),
    Key("rollout.max_surge", _SET, _int_in(0, 1024), "rollout.max_surge",
        "extra replicas started first (engines without GPUs only)",
        Shown("serving", "max_surge {}", sep=" "),
        type="integer", example=1),
)

# Derived views -------------------------------------------------------------------------------


def _of(*scopes: Scope) -> tuple[Key, ...]:
    return tuple(key for key in KEYS if key.scope in scopes)


SUPERVISOR_KEYS = _of(Scope.SUPERVISOR)
SETTING_KEYS = _of(Scope.SETTING)
ENGINE_ONLY_KEYS = _of(Scope.ENGINE)
COMMAND_KEYS = _of(Scope.COMMAND)
ENGINE_KEYS = {key.name: key for key in _of(Scope.SETTING, Scope.ENGINE, Scope.COMMAND)}
CHILD_ONLY = tuple(key.name for key in KEYS if key.child_only)
# what only a command engine may set (command itself marks one)
COMMAND_ONLY = tuple(key.name for key in COMMAND_KEYS if key.name != "command")

# the keys each section allows, as written there (a nested section is one key)
ALLOWED: Mapping[str, tuple[str, ...]] = {
    section: tuple(dict.fromkeys(key.top for key in KEYS if section in key.scope.sections))
    for section in SECTIONS
}


def _belongs(key: Key, section: str) -> str:
    """Where a key written in the wrong section belongs (said instead of "did you mean ...")."""
    if key.scope is Scope.SUPERVISOR:
        return f"{key.top!r} belongs under supervisor: (it is engined's own setting)"
    if key.scope is Scope.SETTING:
        return (f"{key.top!r} is an engine setting: put it under defaults: (every engine) or in "
                f"an engine")
    if section == "defaults":
        return f"{key.top!r} can only be set per engine, not in defaults"
    return f"{key.top!r} is set per engine, under engines:"


HINTS: Mapping[str, Mapping[str, str]] = {
    section: {key.top: _belongs(key, section) for key in KEYS
              if key.top not in ALLOWED[section]}
    for section in SECTIONS
}


def by_section(keys: Iterable[Key]) -> list[tuple[str, tuple[Key, ...]]]:
    """`keys` grouped as written in a section: a plain key alone, a nested section's keys
    together (its name, its keys), in KEYS order."""
    out: dict[str, list[Key]] = {}
    for key in keys:
        out.setdefault(key.top, []).append(key)
    return [(top, tuple(group)) for top, group in out.items()]
