"""`engined --check`'s listing of the resolved fleet."""

from __future__ import annotations

from engined.supervisor.spec.checks import _fmt_duration
from engined.supervisor.spec.model import EngineSpec, FleetSpec, SupervisorSpec


def format_fleet(fleet: FleetSpec) -> str:
    """The resolved fleet as `engined --check` prints it."""
    groups = fleet.groups()
    spares = sum(1 for e in fleet.engines if e.standby)
    out = [f"fleet {fleet.source}: {len(groups)} group(s), {len(fleet.engines) - spares} "
           f"replica(s)" + (f" + {spares} standby" if spares else "")]
    out += _format_supervisor(fleet.supervisor)
    out.append("engines:")
    for engine in fleet.engines:
        out += _format_engine(engine)
    return "\n".join(out) + "\n"


def _printable(text: str) -> str:
    return text if text.isprintable() else repr(text)  # no terminal escapes from a spec


def _format_supervisor(sup: SupervisorSpec) -> list[str]:
    http = (
        "off"
        if sup.http is None
        else (
            f"[{sup.http[0]}]:{sup.http[1]}"
            if ":" in sup.http[0]
            else f"{sup.http[0]}:{sup.http[1]}"
        )
    )
    gateway = "off" if sup.gateway is None else f"{sup.gateway[0]}:{sup.gateway[1]}"
    if sup.api_key_file:
        gateway += f" (bearer token from {_printable(sup.api_key_file)})"
    rows = [
        ("http", http),
        ("gateway", gateway),
        (
            "control_socket",
            _printable(sup.control_socket)
            if sup.control_socket
            else "default (<runtime_dir>/control.sock)",
        ),
        (
            "runtime_dir",
            _printable(sup.runtime_dir)
            if sup.runtime_dir
            else "default ($RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/engined or /tmp/engined-<uid>)",
        ),
        (
            "log_dir",
            _printable(sup.log_dir)
            if sup.log_dir
            else "default ($LOGS_DIRECTORY or <runtime_dir>/logs)",
        ),
        (
            "log_rotation",
            f"at {_fmt_bytes(sup.log_max_bytes)}, {sup.log_backups} backup(s) per engine",
        ),
        ("launcher", sup.launcher),
        (
            "heartbeat",
            f"every {_fmt_duration(sup.heartbeat_interval_s)}, "
            f"timeout {_fmt_duration(sup.heartbeat_timeout_s)}",
        ),
    ]
    return ["supervisor:"] + [f"  {key:<16}{value}" for key, value in rows]


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n} bytes"


def _format_engine(e: EngineSpec) -> list[str]:
    b, sl = e.backoff, e.start_limit
    model = _printable(e.model.source) + (f" (dtype {e.model.dtype})" if e.model.dtype else "")
    env = " ".join(_printable(f"{k}={v}") for k, v in e.env) or "-"
    rows = [
        ("model", model),
        ("gpus", ",".join(map(str, e.gpus)) if e.gpus else "none (CPU)"),
        ("restart", f"{e.restart}; start_limit {sl.burst} in {_fmt_duration(sl.interval_s)}"),
        (
            "timeouts",
            f"startup {_fmt_duration(e.startup_timeout_s)}, "
            f"stall {_fmt_duration(e.stall_timeout_s)}, "
            f"stop {_fmt_duration(e.stop_timeout_s)}",
        ),
        (
            "backoff",
            f"initial {_fmt_duration(b.initial_s)}, max {_fmt_duration(b.max_s)}, "
            f"factor {b.factor:g}, "
            f"jitter {b.jitter:g}, reset after {_fmt_duration(b.reset_after_s)}",
        ),
        (
            "batch",
            f"max_batch_size {e.max_batch_size}, threads {e.threads}, "
            f"data_parallel {'yes' if e.data_parallel else 'no'}, launcher {e.launcher}",
        ),
        (
            "serving",
            f"as {_printable(e.served_model_name or e.group)}, queue_limit {e.queue_limit}, "
            f"request_timeout {_fmt_duration(e.request_timeout_s)}, "
            f"migration_limit {e.migration_limit}, rollout max_unavailable "
            f"{e.rollout.max_unavailable} max_surge {e.rollout.max_surge}",
        ),
        ("env", env),
    ]
    if e.is_command:
        rows = [row for row in rows if row[0] not in ("model", "batch")]
        port = "none" if e.port is None else ("auto (a free loopback port at each spawn)"
                                              if e.port == 0 else str(e.port))
        probe = e.probe
        checks = [f"port {port}",
                  "probe off" if probe is None else
                  f"probe GET {probe.path} every {_fmt_duration(probe.interval_s)}, timeout "
                  f"{_fmt_duration(probe.timeout_s)}, {probe.failures} failures = hung"]
        if e.progress is not None:
            checks.append(f"progress {e.progress.counter} while {e.progress.busy} > 0 "
                          f"({e.progress.metrics})")
        checks.append(f"openai {e.openai or 'no'}")
        rows[:0] = [("command", _printable(" ".join(e.command))),
                    ("cwd", _printable(e.cwd or "-")), ("checks", "; ".join(checks))]
        head = f"  {e.name}  (group {e.group}, rank {e.rank} of {e.replicas})"
        return [head] + [f"    {key:<10}{value}" for key, value in rows]
    if e.python:
        rows.insert(1, ("python", _printable(e.python)))
    if e.backend != "transformers" or e.engine_args:
        args = ", ".join(f"{k}={v}" for k, v in e.engine_args) or "-"
        rows.insert(1, ("backend", _printable(f"{e.backend}; engine_args {args}")))
    head = f"  {e.name}  (group {e.group}, rank {e.rank} of {e.replicas})"
    if e.standby:
        head = (f"  {e.name}  (group {e.group}, warm standby {e.rank}: built and heartbeating, "
                f"not routed; takes over a replica that dies)")
    return [head] + [f"    {key:<10}{value}" for key, value in rows]
