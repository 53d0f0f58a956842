"""The resolved fleet: frozen dataclasses, and SpecError listing every problem found.

A field's default is the default of the spec key that fills it (spec/keys.py reads it from here),
so every default is written once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MAX_PROBLEMS = 50  # a generated 40,000-key mapping should not print 40,000 lines
DEFAULT_HTTP = ("127.0.0.1", 9400)


@dataclass(frozen=True)
class SpecProblem:
    file: str
    path: str  # "engines[1].gpus_per_replica"; "" for file-level problems (syntax, size)
    line: int | None  # 1-based
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        text = f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"
        return text.replace("\n", " ")  # one problem, one line: callers grep and count them


class SpecError(Exception):
    """An invalid fleet spec; str() lists every problem, one per line."""

    def __init__(self, problems: Iterable[SpecProblem]) -> None:
        found = list(problems)
        if len(found) > MAX_PROBLEMS:
            more = len(found) - MAX_PROBLEMS
            found = found[:MAX_PROBLEMS] + [
                SpecProblem(found[0].file, "", None, f"... and {more} more problems")
            ]
        self.problems: list[SpecProblem] = found
        super().__init__("\n".join(str(p) for p in self.problems))

    def __reduce__(self) -> tuple[Any, ...]:
        return (SpecError, (self.problems,))  # the default would rebuild from the joined text


@dataclass(frozen=True)
class ClientLimits:
    """What a client of the gateway and the metrics endpoint may hold (supervisor.webserver).
    Defaults no normal client meets."""

    # from accept, or from the last answer, until a request's headers are complete: a client
    # slow with its headers and an idle keep-alive connection alike
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0  # a request's body, once its headers are in ...
    body_min_rate: int = 1 << 20  # ... plus its Content-Length at this many bytes a second
    write_timeout_s: float = 30.0  # a client that reads nothing of its answer this long: closed
    max_connections: int = 1024  # the gateway's (the metrics endpoint keeps 64)
    max_per_address: int = 0  # connections from one client address; 0: no cap


@dataclass(frozen=True)
class BackoffSpec:
    initial_s: float = 1.0
    max_s: float = 30.0
    factor: float = 2.0
    jitter: float = 0.1
    reset_after_s: float = 60.0


@dataclass(frozen=True)
class StartLimitSpec:
    burst: int = 5
    interval_s: float = 120.0


@dataclass(frozen=True)
class ModelSpec:
    source: str  # "builtin:echo", "builtin:tiny-llama" or the model directory
    builtin: str | None  # "echo" / "tiny-llama" / None
    path: str | None
    dtype: str | None  # None = auto


@dataclass(frozen=True)
class RolloutSpec:
    """How a restart of a group (or a reload that changes it) replaces its replicas."""

    max_unavailable: int = 1  # replicas out of routing at once
    max_surge: int = 0  # extra replicas started first (engines without GPUs only)


@dataclass(frozen=True)
class ProbeSpec:
    """An HTTP GET a command engine must answer with 2xx: READY at the first pass, hung after
    `failures` in a row fail (one probe in flight at a time)."""

    path: str = "/health"
    interval_s: float = 2.0
    timeout_s: float = 1.0
    failures: int = 3


@dataclass(frozen=True)
class CanarySpec:
    """A command engine with an OpenAI API that has had no request for `idle_s` is sent a
    one-token completion; no answer within `timeout_s`: it is hung (an engine core frozen while
    idle, which /health does not see). One at a time, only while no request is in flight."""

    idle_s: float = 10.0
    timeout_s: float = 20.0


@dataclass(frozen=True)
class ProgressSpec:
    """Where a command engine's server says it is working and making progress: its Prometheus
    text at `metrics`, a gauge of requests in flight (`busy`), a counter that moves while it
    generates (`counter`)."""

    metrics: str = "/metrics"
    busy: str = "vllm:num_requests_running"
    counter: str = "vllm:generation_tokens_total"


VLLM_PROGRESS = ProgressSpec()


@dataclass(frozen=True)
class EngineSpec:
    """One replica, fully resolved (defaults merged)."""

    name: str  # "tiny-0"
    group: str  # "tiny"
    rank: int
    replicas: int
    model: ModelSpec
    gpus: tuple[int, ...] = ()  # physical indices: this replica's share of the group's gpus
    data_parallel: bool = False
    max_batch_size: int = 8
    memory_limit: int | None = None  # bytes (engine.memory); None: none
    threads: int = 1
    env: tuple[tuple[str, str], ...] = ()  # sorted
    restart: str = "always"
    backoff: BackoffSpec = BackoffSpec()
    start_limit: StartLimitSpec = StartLimitSpec()
    startup_timeout_s: float = 600.0
    stall_timeout_s: float = 60.0
    stop_timeout_s: float = 30.0
    python: str | None = None  # the child's interpreter (its own venv); None: engined's own
    backend: str = "transformers"  # transformers | vllm (builtin:echo: neither)
    engine_args: tuple[tuple[str, str], ...] = ()  # vLLM EngineArgs: (name, JSON value), sorted
    frontend_args: tuple[tuple[str, str], ...] = ()  # vLLM's chat frontend options, likewise
    served_model_name: str = ""  # the gateway's model name (the group's name by default)
    queue_limit: int = 256  # the gateway's requests per group, in flight or waiting (429 past)
    request_timeout_s: float = 600.0  # a request's whole life in the gateway (503 past)
    migration_limit: int = 3  # times a request may move to another replica
    rollout: RolloutSpec = RolloutSpec()
    # A command engine: a server engined did not write (`vllm serve`), not an engine child.
    command: tuple[str, ...] = ()
    port: int | None = None  # this replica's port (N + rank, or picked at each spawn: 0)
    cwd: str | None = None
    probe: ProbeSpec | None = None
    progress: ProgressSpec | None = None
    openai: str = ""  # the gateway proxies to its OpenAI API: "" no, "openai", "vllm" (+ ids)
    canary: CanarySpec | None = None  # one-token requests while idle (command engines, openai)
    launcher: str = "forkserver"  # forkserver | exec (command engines: always exec)
    standby: bool = False  # a warm spare of its group (built, heartbeating, never routed)
    # on demand (routing.ondemand): asleep after this long with no request; None: always awake
    idle_timeout_s: float | None = None
    min_replicas: int = 0  # replicas an on-demand group keeps awake (ranks below it)
    wake_timeout_s: float = 300.0  # a request waits this long for its model to wake (503 past)
    sleep_mode: str = "stop"  # stop (the process) | level1 | level2 (vLLM's, on GPUs)
    adapters: tuple[tuple[str, str], ...] = ()  # LoRA adapters: (name, directory), sorted

    @property
    def is_command(self) -> bool:
        return bool(self.command)

    @property
    def on_demand(self) -> bool:
        return self.idle_timeout_s is not None

    @property
    def sleep_level(self) -> int:
        """vLLM's sleep level it sleeps at in place (1, 2); 0: it sleeps by being stopped."""
        return {"level1": 1, "level2": 2}.get(self.sleep_mode, 0)

    @property
    def starts_asleep(self) -> bool:
        """On demand and not among the min_replicas kept awake: a request wakes it."""
        return self.on_demand and not self.standby and self.rank >= self.min_replicas


@dataclass(frozen=True)
class MemoryBudgetSpec:
    """What the engines may hold together, by their memory_limit or what they measured: the
    host's memory (engines without GPUs) and each GPU's; None: no budget."""

    host: int | None = None
    gpu: int | None = None


@dataclass(frozen=True)
class SupervisorSpec:
    http: tuple[str, int] | None = DEFAULT_HTTP  # None: HTTP endpoint off
    # the OpenAI-compatible API; None: off, the default (two daemons never fight over a port)
    gateway: tuple[str, int] | None = None
    api_key_file: str | None = None  # a bearer token the gateway requires (re-read on reload)
    control_socket: str | None = None  # None: the daemon's default location
    control_tcp: tuple[str, int] | None = None  # the control API on TCP too (token required)
    control_token_file: str | None = None
    control_tls_cert: str | None = None  # TLS for control_tcp: both or neither
    control_tls_key: str | None = None
    runtime_dir: str | None = None
    log_dir: str | None = None
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    launcher: str = "forkserver"  # every engine's, unless it sets its own
    log_max_bytes: int = 10 * 1024 * 1024  # each engine's log file is rotated past this
    log_backups: int = 3  # rotated files kept (NAME.log.1 ... .N); 0: start the file again
    # engines outlive a dead engined this long, for the next one to adopt; 0: they die with it
    orphan_timeout_s: float = 60.0
    clients: ClientLimits = ClientLimits()  # slow, idle and too many clients (webserver)
    replica_ports: int | None = None  # replica i of the fleet also on the gateway's host, BASE+i
    exit_on_failed: bool = False  # an engine FAILED: stop everything and exit 1
    engine_logs: str = "files"  # or "stdout": engine output on engined's stdout, prefixed
    memory_budget: MemoryBudgetSpec = MemoryBudgetSpec()  # on-demand engines swap within it


@dataclass(frozen=True)
class UpstreamsSpec:
    """A cluster gateway's nodes (`upstreams:` instead of `engines:`): engined gateways on other
    hosts, found by name (every address a name resolves to is a node: a Kubernetes headless
    Service, a host list), re-resolved every `resolve_interval_s`, probed every
    `probe_interval_s` on their model server protocol (`GET /metrics`); a node that answers no
    probe for `probe_timeout_s` is down and its streams move (supervisor.cluster)."""

    nodes: tuple[tuple[str, int], ...]  # (host or name, port) of each node gateway
    resolve_interval_s: float = 10.0
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 3.0
    api_key_file: str | None = None  # the bearer token the node gateways ask (theirs)
    queue_limit: int = 1024  # the cluster gateway's requests per model, in flight or waiting
    request_timeout_s: float = 600.0
    migration_limit: int = 3  # times a request may move to another node


@dataclass(frozen=True)
class FleetSpec:
    source: str
    supervisor: SupervisorSpec
    engines: tuple[EngineSpec, ...]  # every replica, in spec order
    upstreams: UpstreamsSpec | None = None  # a cluster gateway: node gateways, no engines

    def groups(self) -> dict[str, tuple[EngineSpec, ...]]:
        out: dict[str, list[EngineSpec]] = {}
        for engine in self.engines:
            out.setdefault(engine.group, []).append(engine)
        return {group: tuple(members) for group, members in out.items()}

    def engine(self, name: str) -> EngineSpec | None:
        return next((e for e in self.engines if e.name == name), None)


# ---------------------------------------------------------------------------------------------
