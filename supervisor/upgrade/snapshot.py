"""The daemon's state as a file: what a new engined needs to take over running engines.

`<runtime_dir>/state.json`, written atomically (a temporary file in the same directory, fsync,
rename), read by the engined that replaces this one: in place by `enginectl upgrade` (the same
pid re-executes itself, supervisor.handover) or after a crash. The format is versioned:

* `format` 1 is this one. A reader takes every format up to its own; a newer one (written by a
  later release, then a downgrade) is not guessed at: the reader starts fresh and says so.
* Fields a reader does not know are ignored and named in the log (a later release's additions).
* A file that cannot be read, is not JSON, or does not have this shape never stops engined from
  starting: `load` returns None with the reason, and the daemon starts fresh.

What is kept is what status and metrics report and supervision decides by: per replica its
incarnation, its live process (pid, the process's start time, its owner token, its output pipe
and port), its state and desired state, restarts by reason, request outcomes, the last exit,
backoff and FAILED parks; the event history; the gateway's counters; and, for an in-place
upgrade only, the descriptors handed across the exec (listening sockets, the guard's pipe, the
runtime lock).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import msgspec
from msgspec import Struct

log = logging.getLogger("engined")

FORMAT = 1
FILE_NAME = "state.json"


class Process(Struct, kw_only=True):
    """A live incarnation's process: who it is (pid, its start time in clock ticks since boot,
    the owner token in its environment: together they tell it from a reused pid) and what the
    daemon holds of it."""

    pid: int
    start_ticks: int
    token: str
    address: tuple[str, int]  # (name, number) its messages carry (a promoted standby's own)
    output_fd: int | None = None  # the read end of its output pipe (handed across an exec)
    port: int | None = None  # a command engine's
    launcher: str = "exec"
    spawned_ago_s: float = 0.0  # its spawn, before the snapshot
    ready_ago_s: float | None = None  # its READY, before the snapshot (None: not READY yet)
    ready: dict[str, Any] | None = None  # its READY message (proto.Ready's fields)
    spec: str = ""  # a digest of the engine spec it was started with ("": not known)
    pidfd: int | None = None  # a process that is not our child: its pidfd, kept across an exec


class Replica(Struct, kw_only=True):
    name: str
    state: str  # EngineState's value
    desired: str = "run"  # or "stopped" (an operator's stop)
    incarnation: int = 0
    since: float = 0.0  # unix time it entered `state`
    restarts: dict[str, int] = {}  # Reason's value -> count
    requests: dict[str, int] = {}  # outcome -> count
    last_exit: dict[str, Any] | None = None
    startup_s: float | None = None
    cpu_seconds_exited: float = 0.0
    oom_exited: int = 0  # earlier incarnations' out-of-memory steps
    fail_reason: str = ""
    restart_in_s: float | None = None  # a backoff's respawn, from the snapshot's time
    restart_reason: str | None = None  # what that respawn counts as (Reason's value)
    failures: list[float] = []  # the owner's recent failures, seconds before the snapshot
    consecutive: int = 0  # the owner's failure streak (backoff)
    shortages: int = 0  # spawns refused in a row for lack of resources
    process: Process | None = None


class Fds(Struct, kw_only=True):
    """Descriptors that survive an in-place exec, by what they are."""

    lock: int | None = None  # the runtime directory's flock
    guard_pid: int | None = None
    guard_fd: int | None = None  # the write end of the guard's pipe
    control: int | None = None  # listening sockets
    http: int | None = None
    gateway: int | None = None
    connections: dict[str, list[int]] = {}  # idle accepted connections, by server


class Counters(Struct, kw_only=True):
    """What /metrics counts that no replica keeps (Prometheus counters never go back)."""

    gateway_requests: list[tuple[str, str, int]] = []  # (model, outcome, count)
    gateway_migrations: dict[str, int] = {}
    ipc_dropped: dict[str, int] = {}
    handover_cut: int = 0  # gateway requests an upgrade's drain bound cut, all upgrades


class Snapshot(Struct, kw_only=True):
    format: int = FORMAT
    engined: str = ""  # the writer's version
    pid: int = 0
    written_at: float = 0.0  # unix time
    handovers: int = 0  # in-place upgrades and adoptions so far (the daemon's generation)
    reloads: int = 1  # the spec's generation (control's `generation`)
    replicas: list[Replica] = []
    events: list[dict[str, Any]] = []
    events_total: int = 0
    counters: Counters = msgspec.field(default_factory=Counters)
    handover_started: float | None = None  # unix time the old code stopped accepting
    fork_servers: list[dict[str, Any]] = []  # ready fork servers handed across an exec
    fds: Fds | None = None
    adapters: dict[str, dict[str, str]] = {}  # run-time LoRA adapters: group -> name -> dir


_ENCODER = msgspec.json.Encoder()


def path_in(runtime_dir: Path) -> Path:
    return runtime_dir / FILE_NAME


def dump(snapshot: Snapshot) -> bytes:
    return _ENCODER.encode(snapshot)


def write(path: Path, snapshot: Snapshot) -> None:
    """Atomically: a reader sees the previous file or this one, never a part (even after a
    crash or a power cut: the data is synced before the rename)."""
    data = dump(snapshot)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class Unreadable(ValueError):
    """Why a snapshot was not used."""


def parse(data: bytes) -> tuple[Snapshot, list[str]]:
    """The snapshot in `data`, and the names of the fields it had that this reader does not
    know; Unreadable if it is not a snapshot this release can use."""
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise Unreadable(f"not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise Unreadable(f"expected an object, got {type(raw).__name__}")
    version = raw.get("format")
    if not isinstance(version, int) or isinstance(version, bool):
        raise Unreadable(f"'format': expected an integer, got {version!r}")
    if version > FORMAT:
        raise Unreadable(f"format {version} is newer than this engined's ({FORMAT}): "
                         f"written by a later release")
    if version < 1:
        raise Unreadable(f"format {version} does not exist")
    unknown = sorted(_unknown(raw, Snapshot, ""))
    try:
        return msgspec.convert(raw, Snapshot), unknown
    except msgspec.ValidationError as exc:
        raise Unreadable(str(exc)) from None


def load(path: Path) -> tuple[Snapshot | None, str]:
    """The snapshot at `path`, or None and why not (missing, unreadable, a newer format).
    Never raises for what is in the file; unknown fields are logged and ignored."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, "none"
    except OSError as exc:
        return None, f"cannot read {path}: {exc.strerror or exc}"
    try:
        snapshot, unknown = parse(data)
    except Unreadable as exc:
        return None, f"{path}: {exc}"
    if unknown:
        log.warning("[snapshot] %s: ignored fields this engined does not know: %s", path,
                    ", ".join(unknown))
    return snapshot, "ok"


def _unknown(raw: Any, kind: type[Struct], at: str) -> list[str]:
    """Paths of the keys in `raw` that `kind` (and its nested structs) do not declare."""
    if not isinstance(raw, dict):
        return []
    out = []
    fields = {f.name: f.type for f in msgspec.structs.fields(kind)}
    for key, value in raw.items():
        path = f"{at}.{key}" if at else str(key)
        if key not in fields:
            out.append(path)
            continue
        nested = _struct_of(fields[key])
        if nested is None:
            continue
        if isinstance(value, list):
            for i, item in enumerate(value):
                out.extend(_unknown(item, nested, f"{path}[{i}]"))
        else:
            out.extend(_unknown(value, nested, path))
    return out


def _struct_of(annotation: Any) -> type[Struct] | None:
    """The Struct inside `T`, `T | None` or `list[T]`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, Struct):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _struct_of(arg)
        if found is not None:
            return found
    return None


def start_ticks(pid: int) -> int | None:
    """The process's start time (field 22 of /proc/PID/stat, clock ticks since boot): with the
    pid, it names one process for the machine's uptime. None if there is no such process."""
    found = parent_and_start(pid)
    return found[1] if found is not None else None


def parent_and_start(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks since boot) from /proc/PID/stat, read once; None
    if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces or parentheses
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None
