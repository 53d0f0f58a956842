"""Fleet spec: read the YAML fleet file, validate it, resolve it into frozen dataclasses.

Three stages, each raising one SpecError that lists every problem as "FILE:LINE: key.path: message":
1. bytes -> text (size bound, strict UTF-8);
2. text -> plain values plus a key-path -> line map, by composing YAML nodes with a bounded
   SafeLoader (depth and node-count limits, duplicate-key detection, basic scalar tags only);
3. plain values -> FleetSpec (types, ranges, defaults merged, replicas expanded, cross checks).
Pure: no processes, no clock, no torch. Input is untrusted: nothing but SpecError escapes for any
bytes (fuzzed).
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

MAX_SPEC_BYTES = 1 << 20
MAX_NODES = 100_000  # composed nodes, and node visits with aliases expanded ("billion laughs")
MAX_DEPTH = 64  # the fleet spec needs ~5; the pure-Python composer recurses ~3 frames a level
MAX_DURATION_S = 365 * 86400.0  # keeps every timer API (threading, asyncio, zmq) far from overflow
MAX_GPU_INDEX = 1023
MAX_PROBLEMS = 50  # a generated 40,000-key mapping should not print 40,000 lines

BUILTIN_MODELS = ("echo", "tiny-llama")
# The spec checks a dtype's shape only; the child, which has torch, decides whether torch knows
# it (an unknown one exits 78 there). The daemon cannot import torch to check it here.
_DTYPE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
RESTART_POLICIES = ("always", "on-failure", "never")
RESERVED_NAMES = ("all",)  # enginectl's "every engine"
RESERVED_ENV = ("CUDA_VISIBLE_DEVICES", "NOTIFY_SOCKET")  # plus the ENGINED_ prefix
# ...except the knobs the engine child itself reads (engine/models.py, engine/llm.py): a spec
# sets them through `env` (e.g. ENGINED_ECHO_FAIL for fault injection).
ENGINE_ENV = ("ENGINED_CACHE_DIR", "ENGINED_FAULT_INJECTION")
ENGINE_ENV_PREFIX = ("ENGINED_ECHO_", "ENGINED_FAULT_")
DEFAULT_HTTP = ("127.0.0.1", 9400)

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DURATION_RE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ms|s|m|h)?")
_HOSTNAME_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?")
_SURROGATE_RE = re.compile("[\ud800-\udfff]")
_UNIT_DIVISOR = {"ms": 1000.0, "s": 1.0, None: 1.0}
_UNIT_FACTOR = {"m": 60.0, "h": 3600.0}


# ---------------------------------------------------------------------------------------------
# Public types


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
            found = found[:MAX_PROBLEMS] + [SpecProblem(found[0].file, "", None, f"... and {more} more problems")]
        self.problems: list[SpecProblem] = found
        super().__init__("\n".join(str(p) for p in self.problems))

    def __reduce__(self) -> tuple[Any, ...]:
        return (SpecError, (self.problems,))  # the default would rebuild from the joined text


@dataclass(frozen=True)
class BackoffSpec:
    initial_s: float
    max_s: float
    factor: float
    jitter: float
    reset_after_s: float


@dataclass(frozen=True)
class StartLimitSpec:
    burst: int
    interval_s: float


@dataclass(frozen=True)
class ModelSpec:
    source: str  # "builtin:echo", "builtin:tiny-llama" or the model directory
    builtin: str | None  # "echo" / "tiny-llama" / None
    path: str | None
    dtype: str | None  # None = auto


@dataclass(frozen=True)
class EngineSpec:
    """One replica, fully resolved (defaults merged)."""

    name: str  # "tiny-0"
    group: str  # "tiny"
    rank: int
    replicas: int
    model: ModelSpec
    gpus: tuple[int, ...]  # physical indices: this replica's share of the group's gpus
    data_parallel: bool
    max_batch_size: int
    threads: int
    env: tuple[tuple[str, str], ...]  # sorted
    restart: str
    backoff: BackoffSpec
    start_limit: StartLimitSpec
    startup_timeout_s: float
    stall_timeout_s: float
    stop_timeout_s: float


@dataclass(frozen=True)
class SupervisorSpec:
    http: tuple[str, int] | None  # None: HTTP endpoint off
    control_socket: str | None  # None: the daemon's default location
    runtime_dir: str | None
    log_dir: str | None
    heartbeat_interval_s: float
    heartbeat_timeout_s: float


@dataclass(frozen=True)
class FleetSpec:
    source: str
    supervisor: SupervisorSpec
    engines: tuple[EngineSpec, ...]  # every replica, in spec order

    def groups(self) -> dict[str, tuple[EngineSpec, ...]]:
        out: dict[str, list[EngineSpec]] = {}
        for engine in self.engines:
            out.setdefault(engine.group, []).append(engine)
        return {group: tuple(members) for group, members in out.items()}

    def engine(self, name: str) -> EngineSpec | None:
        return next((e for e in self.engines if e.name == name), None)


# ---------------------------------------------------------------------------------------------
# Public functions


def parse_duration(value: object) -> float:
    """Seconds from "500ms", "30s", "10m", "1h", "1.5s", a bare number string, or int/float seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a duration such as 500ms, 30s, 10m or 1h, got {_describe(value)}")
    try:
        seconds = _duration_seconds(value)
    except OverflowError:  # an int beyond float range
        seconds = math.inf if value > 0 else -math.inf  # type: ignore[operator]
    if math.isnan(seconds):
        raise ValueError("duration must be a number, got nan")
    if seconds < 0:
        raise ValueError(f"duration must not be negative, got {_show(value)}")
    if seconds > MAX_DURATION_S:
        raise ValueError(f"duration {_show(value)} is too large (at most 365 days)")
    return seconds


def load_fleet(path: str | os.PathLike[str]) -> FleetSpec:
    """Read and resolve a fleet file; raises SpecError for anything wrong, unreadable file included."""
    source = os.fsdecode(os.fspath(path))
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)  # bounded: a spec path may name /dev/zero
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SpecError([SpecProblem(source, "", None, f"cannot read fleet spec: {reason}")]) from None
    return parse_fleet(data, source)


def parse_fleet(text: str | bytes, source: str = "<string>") -> FleetSpec:
    """Validate and resolve fleet-spec text; raises SpecError listing every problem."""
    decoded = _decode(text, source)
    root, lines = _compose(decoded, source)
    return _resolve(root, lines, source)


def format_fleet(fleet: FleetSpec) -> str:
    """The resolved fleet as `engined --check` prints it."""
    groups = fleet.groups()
    out = [f"fleet {fleet.source}: {len(groups)} group(s), {len(fleet.engines)} replica(s)"]
    out += _format_supervisor(fleet.supervisor)
    out.append("engines:")
    for engine in fleet.engines:
        out += _format_engine(engine)
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# Stage 1: bytes -> text


def _decode(text: str | bytes, source: str) -> str:
    if isinstance(text, (bytes, bytearray, memoryview)):
        data = bytes(text)
        _check_size(len(data), source)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data[: exc.start].count(b"\n") + 1
            message = f"not valid UTF-8: byte 0x{data[exc.start]:02x} at offset {exc.start}"
            raise SpecError([SpecProblem(source, "", line, message)]) from None
    if not isinstance(text, str):
        raise TypeError(f"fleet spec text must be str or bytes, not {type(text).__name__}")
    _check_size(len(text), source)  # chars <= bytes, so this cheap check goes first
    _check_size(len(text.encode("utf-8", "surrogatepass")), source)
    return text


def _check_size(size: int, source: str) -> None:
    if size > MAX_SPEC_BYTES:
        message = f"fleet spec is too large (more than {MAX_SPEC_BYTES} bytes)"
        raise SpecError([SpecProblem(source, "", None, message)])


# ---------------------------------------------------------------------------------------------
# Stage 2: text -> plain values and a line map


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader whose composer refuses deep nesting and huge documents before they cost stack
    or memory (the stock composer recurses once per nesting level and has no size limit)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._nodes += 1
        if self._nodes > MAX_NODES:
            self._refuse(f"document has more than {MAX_NODES} YAML nodes")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                self._refuse(f"nesting deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def _refuse(self, problem: str) -> None:
        raise yaml.composer.ComposerError(None, None, problem, self.peek_event().start_mark)


def _compose(text: str, source: str) -> tuple[Any, dict[str, int]]:
    node = _compose_node(text, source)
    if node is None:
        raise SpecError([SpecProblem(source, "", None, "fleet spec is empty (expected a mapping with version: 1)")])
    walker = _Walker()
    try:
        value = walker.value(node, "", 0)
    except _Abort as abort:
        walker.problems.append(SpecProblem(source, abort.path, abort.line, abort.message))
    except RecursionError:  # only when called from an already deep stack: MAX_DEPTH bounds the walk
        walker.problems.append(SpecProblem(source, "", None, "YAML nesting too deep"))
    problems = [SpecProblem(source, p.path, p.line, p.message) for p in walker.problems]
    if problems:
        raise SpecError(problems)
    return value, walker.lines


def _compose_node(text: str, source: str) -> Node | None:
    loader: _BoundedLoader | None = None
    try:
        loader = _BoundedLoader(text)  # the reader rejects non-printable characters right here
        return loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        raise SpecError([_marked_problem(exc, source)]) from None
    except yaml.reader.ReaderError as exc:
        line = text[: exc.position].count("\n") + 1
        raise SpecError([SpecProblem(source, "", line, str(exc).split("\n")[0])]) from None
    except RecursionError:  # only when called from an already deep stack; the limits stop the rest
        raise SpecError([SpecProblem(source, "", None, "YAML nesting too deep")]) from None
    except Exception as exc:  # noqa: BLE001 - the parser is a black box fed hostile input
        raise SpecError([SpecProblem(source, "", None, f"cannot parse YAML: {type(exc).__name__}: {exc}")]) from None
    finally:
        if loader is not None:
            loader.dispose()


def _marked_problem(exc: yaml.MarkedYAMLError, source: str) -> SpecProblem:
    mark = exc.problem_mark or exc.context_mark
    context = exc.context
    if context and exc.context_mark and exc.problem_mark and exc.context_mark.line != exc.problem_mark.line:
        context += f" (line {exc.context_mark.line + 1})"  # e.g. where an unclosed quote began
    text = ": ".join(part for part in (context, exc.problem) if part)
    if mark is None:
        return SpecProblem(source, "", None, f"YAML error: {text}")
    return SpecProblem(source, "", mark.line + 1, f"YAML error: {text} (column {mark.column + 1})")


class _Abort(Exception):
    """Stops the walk: the document is too big or too deep to look at any further."""

    def __init__(self, path: str, line: int, message: str) -> None:
        super().__init__(message)
        self.path, self.line, self.message = path, line, message


_TAG = "tag:yaml.org,2002:"
_SCALAR_TAGS = frozenset(_TAG + t for t in ("null", "bool", "int", "float", "str"))


class _Walker:
    """Turns a composed node graph into plain dict/list/scalars, recording each key path's line.

    Aliases are expanded here, so every visit is counted (the composer only counted distinct
    nodes); recursive aliases are caught by tracking the nodes on the current path.
    """

    def __init__(self) -> None:
        self.lines: dict[str, int] = {}
        self.problems: list[SpecProblem] = []  # file filled in by the caller
        self._visits = 0
        self._open: set[int] = set()
        self._constructor = yaml.constructor.SafeConstructor()  # for scalars only

    def value(self, node: Node, path: str, depth: int) -> Any:
        line = node.start_mark.line + 1
        self._visits += 1
        if self._visits > MAX_NODES:
            raise _Abort(path, line, f"document expands to more than {MAX_NODES} YAML nodes (alias bomb?)")
        if depth > MAX_DEPTH:
            raise _Abort(path, line, f"nesting deeper than {MAX_DEPTH} levels")
        self.lines.setdefault(path, line)  # a mapping value keeps its key's line
        if isinstance(node, ScalarNode):
            return self._scalar(node, path)
        if id(node) in self._open:
            raise _Abort(path, line, "recursive YAML alias")
        self._open.add(id(node))
        try:
            if isinstance(node, SequenceNode):
                return self._sequence(node, path, depth)
            return self._mapping(node, path, depth)
        finally:
            self._open.discard(id(node))

    def _problem(self, path: str, node: Node, message: str) -> None:
        self.problems.append(SpecProblem("", path, node.start_mark.line + 1, message))

    def _scalar(self, node: ScalarNode, path: str) -> Any:
        if node.tag in (_TAG + "timestamp", _TAG + "value", _TAG + "merge"):
            return node.value  # implicit tags of plain text (a date, "=", "<<"): keep what was written
        if node.tag not in _SCALAR_TAGS:
            self._problem(path, node, f"unsupported YAML tag {_tag_name(node.tag)}")
            return None
        try:
            value = self._constructor.yaml_constructors[node.tag](self._constructor, node)
        except Exception as exc:  # noqa: BLE001 - e.g. !!int "x", or an int past Python's digit limit
            detail = f": {str(exc).split(';')[0]}" if isinstance(exc, ValueError) else ""
            self._problem(path, node, f"invalid {node.tag[len(_TAG):]} value {_show(node.value)}{detail}")
            return None
        if isinstance(value, str) and _SURROGATE_RE.search(value):
            self._problem(path, node, "string contains an invalid unicode escape (surrogate)")
            return None
        return value

    def _sequence(self, node: SequenceNode, path: str, depth: int) -> list[Any]:
        if node.tag != _TAG + "seq":
            self._problem(path, node, f"unsupported YAML tag {_tag_name(node.tag)}")
        return [self.value(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(node.value)]

    def _mapping(self, node: MappingNode, path: str, depth: int) -> dict[str, Any]:
        if node.tag != _TAG + "map":
            self._problem(path, node, f"unsupported YAML tag {_tag_name(node.tag)}")
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = self._key(key_node, path)
            if key is None:
                continue
            sub = _join(path, key)
            if key in out:  # PyYAML silently keeps the last one; a typo'd copy would hide
                self._problem(sub, key_node, f"duplicate key {_show(key)} (first on line {self.lines[sub]})")
                continue
            self.lines[sub] = key_node.start_mark.line + 1
            out[key] = self.value(value_node, sub, depth + 1)
        return out

    def _key(self, node: Node, path: str) -> str | None:
        self._visits += 1
        if node.tag == _TAG + "merge":
            self._problem(path, node, "YAML merge keys (<<) are not supported; use defaults:")
            return None
        if not isinstance(node, ScalarNode) or node.tag not in _SCALAR_TAGS:
            self._problem(path, node, "mapping keys must be plain strings")
            return None
        key = self._scalar(node, path)
        if not isinstance(key, str):
            self._problem(path, node, f"mapping keys must be strings, got {_describe(key)} (quote it)")
            return None
        return key


def _tag_name(tag: str) -> str:
    return "!!" + tag[len(_TAG):] if tag.startswith(_TAG) else _show(tag)


def _join(path: str, key: str) -> str:
    if len(key) > 64 or not key.isprintable():
        key = repr(key[:64])  # keeps each problem on one short line
    return f"{path}.{key}" if path else key


def _line_for(lines: Mapping[str, int], path: str) -> int | None:
    """The line of `path`, else of the nearest enclosing key or item that has one."""
    while path not in lines and path:
        cut = max(path.rfind("."), path.rfind("["))
        path = path[:cut] if cut > 0 else ""
    return lines.get(path)


# ---------------------------------------------------------------------------------------------
# Stage 3: plain values -> FleetSpec


_BAD: Any = object()  # a value whose problem is already recorded
_Located = tuple[Any, str | None]  # validated value and the key path it came from (None: built in)


def _any_bad(*values: Any) -> bool:
    return any(value is _BAD for value in values)


class _Problems:
    """Collects (path, message) pairs; lines are looked up once everything has been checked."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, path: str, message: str) -> Any:
        self.items.append((path, message))
        return _BAD

    def raise_if_any(self, source: str, lines: Mapping[str, int]) -> None:
        unique = dict.fromkeys(self.items)  # a bad default shared by several engines reports once
        found = [SpecProblem(source, path, _line_for(lines, path), message) for path, message in unique]
        if found:  # in file order, so the list reads top to bottom next to the spec
            raise SpecError(sorted(found, key=lambda p: p.line if p.line is not None else 1 << 30))


_Check = Callable[[_Problems, Any, str], Any]  # returns the validated value or _BAD


def _describe(value: object) -> str:
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "a mapping", type(None): "null"}
    kind = kinds.get(type(value), type(value).__name__)
    return kind if isinstance(value, (list, dict)) or value is None else f"{kind} {_show(value)}"


def _show(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    try:
        text = repr(value)
    except ValueError:  # int -> str refuses more than 4300 digits
        text = "<integer too large to print>"
    if len(text) <= 60:
        return text
    return text[:56] + ("...'" if text[0] in "'\"" else "...")


def _unknown_keys(problems: _Problems, mapping: Mapping[str, Any], path: str,
                  allowed: Iterable[str], hints: Mapping[str, str] | None = None) -> None:
    allowed = sorted(allowed)
    for key in mapping:
        if key in allowed:
            continue
        if hints and key in hints:
            problems.add(_join(path, key), hints[key])
            continue
        close = difflib.get_close_matches(key, allowed, n=1)
        guess = f"did you mean {close[0]!r}? " if close else ""
        problems.add(_join(path, key), f"unknown key {_show(key)} ({guess}allowed: {', '.join(allowed)})")


def _mapping(problems: _Problems, value: Any, path: str, null_ok: bool = False) -> dict[str, Any] | None:
    if value is None and null_ok:
        return {}  # an empty section, e.g. every line under `defaults:` commented out
    if isinstance(value, dict):
        return value
    problems.add(path, f"must be a mapping, got {_describe(value)}")
    return None


# Scalar checks --------------------------------------------------------------------------------


def _int_in(low: int, high: int) -> _Check:
    def check(problems: _Problems, value: Any, path: str) -> Any:
        if type(value) is not int:  # bool is an int subclass: `replicas: yes` is a mistake
            return problems.add(path, f"must be an integer, got {_describe(value)}")
        if not low <= value <= high:
            return problems.add(path, f"must be between {low} and {high}, got {_show(value)}")
        return value
    return check


def _bool(problems: _Problems, value: Any, path: str) -> Any:
    if not isinstance(value, bool):
        return problems.add(path, f"must be true or false, got {_describe(value)}")
    return value


def _number(problems: _Problems, value: Any, path: str) -> Any:
    if type(value) not in (int, float):
        return problems.add(path, f"must be a number, got {_describe(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        return problems.add(path, f"must be a finite number, got {_show(value)}")
    return number


def _factor(problems: _Problems, value: Any, path: str) -> Any:
    number = _number(problems, value, path)
    if number is not _BAD and number < 1:
        return problems.add(path, f"must be >= 1, got {_show(value)}")
    return number


def _jitter(problems: _Problems, value: Any, path: str) -> Any:
    number = _number(problems, value, path)
    if number is not _BAD and not 0 <= number < 1:
        return problems.add(path, f"must be >= 0 and < 1, got {_show(value)}")
    return number


def _duration(positive: bool) -> _Check:
    def check(problems: _Problems, value: Any, path: str) -> Any:
        try:
            seconds = parse_duration(value)
        except ValueError as exc:
            return problems.add(path, str(exc))
        if positive and seconds <= 0:
            return problems.add(path, f"must be greater than 0, got {_show(value)}")
        return seconds
    return check


def _enum(choices: tuple[str, ...]) -> _Check:
    def check(problems: _Problems, value: Any, path: str) -> Any:
        if not isinstance(value, str) or value not in choices:
            return problems.add(path, f"must be one of {', '.join(choices)}; got {_describe(value)}")
        return value
    return check


def _text(problems: _Problems, value: Any, path: str) -> Any:
    """A non-empty string usable as a path or argument (exec refuses NUL bytes)."""
    if not isinstance(value, str) or not value.strip():
        return problems.add(path, f"must be a non-empty string, got {_describe(value)}")
    if "\0" in value:
        return problems.add(path, "must not contain NUL characters")
    return value


def _optional_text(problems: _Problems, value: Any, path: str) -> Any:
    return None if value is None else _text(problems, value, path)


# Structured checks ----------------------------------------------------------------------------


def _model(problems: _Problems, value: Any, path: str) -> Any:
    usage = "'builtin:echo', 'builtin:tiny-llama' or {path: DIR, dtype: ...}"
    if isinstance(value, str):
        kind, sep, name = value.partition(":")
        if not sep or kind != "builtin":
            return problems.add(path, f"must be {usage}; got {_show(value)} (a directory goes in {{path: ...}})")
        if name not in BUILTIN_MODELS:
            known = ", ".join(f"builtin:{m}" for m in BUILTIN_MODELS)
            return problems.add(path, f"unknown builtin model {_show(value)} (known: {known})")
        return ModelSpec(source=value, builtin=name, path=None, dtype=None)
    if not isinstance(value, dict):
        return problems.add(path, f"must be {usage}; got {_describe(value)}")
    return _model_dir(problems, value, path)


def _model_dir(problems: _Problems, value: dict[str, Any], path: str) -> Any:
    _unknown_keys(problems, value, path, ("path", "dtype"))
    if "path" not in value:
        return problems.add(_join(path, "path"), "required: the model directory")
    model_path = _text(problems, value["path"], _join(path, "path"))
    dtype = _dtype(problems, value.get("dtype", "auto"), _join(path, "dtype"))
    if _any_bad(model_path, dtype) or set(value) - {"path", "dtype"}:
        return _BAD
    return ModelSpec(source=model_path, builtin=None, path=model_path, dtype=None if dtype == "auto" else dtype)


def _dtype(problems: _Problems, value: Any, path: str) -> Any:
    if not isinstance(value, str) or not _DTYPE_RE.fullmatch(value):
        return problems.add(path, f"must be auto or a torch dtype name such as float32, float16 "
                                  f"or bfloat16; got {_show(value) if isinstance(value, str) else _describe(value)}")
    return value


def _gpus(problems: _Problems, value: Any, path: str) -> Any:
    if value is None:
        return ()
    if not isinstance(value, list):
        return problems.add(path, f"must be a list of GPU indices, got {_describe(value)}")
    first: dict[int, int] = {}  # gpu -> position, to name the earlier entry
    bad = False
    for i, item in enumerate(value):
        index = _int_in(0, MAX_GPU_INDEX)(problems, item, f"{path}[{i}]")
        if index is not _BAD and index in first:
            index = problems.add(f"{path}[{i}]", f"GPU {index} is listed twice (also {path}[{first[index]}])")
        if index is _BAD:
            bad = True
        else:
            first[index] = i
    return _BAD if bad else tuple(value)


def _env(problems: _Problems, value: Any, path: str) -> Any:
    mapping = _mapping(problems, value, path, null_ok=True)
    if mapping is None:
        return _BAD
    pairs = [_env_pair(problems, key, item, _join(path, key)) for key, item in mapping.items()]
    return _BAD if _any_bad(*pairs) else tuple(sorted(pairs))


def _env_pair(problems: _Problems, key: str, value: Any, path: str) -> Any:
    if not _ENV_NAME_RE.fullmatch(key):
        return problems.add(path, f"invalid environment variable name {_show(key)} (use [A-Za-z_][A-Za-z0-9_]*)")
    engine_knob = key in ENGINE_ENV or key.startswith(ENGINE_ENV_PREFIX)
    if key in RESERVED_ENV or (key.startswith("ENGINED_") and not engine_knob):
        return problems.add(path, f"{key} is set by engined itself (reserved: {', '.join(RESERVED_ENV)}, ENGINED_*)")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return problems.add(path, f"must be a string or a number, got {_describe(value)} (quote it)")
    text = value if isinstance(value, str) else str(value)
    if "\0" in text:
        return problems.add(path, "must not contain NUL characters")
    return (key, text)


def _http(problems: _Problems, value: Any, path: str) -> Any:
    if value is False or (isinstance(value, str) and value.strip().lower() == "off"):
        return None
    if not isinstance(value, str):
        hint = " (quote IPv6 addresses: \"[::1]:9400\")" if isinstance(value, list) else ""
        return problems.add(path, f"must be 'HOST:PORT' or off, got {_describe(value)}{hint}")
    try:
        return _parse_host_port(value.strip())
    except ValueError as exc:
        return problems.add(path, f"invalid address {_show(value)}: {exc}")


def _parse_host_port(text: str) -> tuple[str, int]:
    if text.startswith("["):
        host, close, rest = text[1:].partition("]")
        port_text = rest[1:] if close and rest.startswith(":") else None
        if port_text is None:
            raise ValueError("expected [IPV6]:PORT")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{_show(host)} is not an IPv6 address") from None
    else:
        host, colon, port_text = text.rpartition(":")
        if not colon:
            raise ValueError("missing port (expected HOST:PORT)")
        if ":" in host:
            raise ValueError("put IPv6 addresses in brackets, e.g. [::1]:9400")
        if not host:
            raise ValueError("missing host (e.g. 127.0.0.1:9400)")
        if not _HOSTNAME_RE.fullmatch(host):
            raise ValueError(f"invalid host {_show(host)}")
    if not re.fullmatch(r"[0-9]{1,5}", port_text) or not 1 <= int(port_text) <= 65535:
        raise ValueError("port must be 1..65535")
    return host, int(port_text)


# Sections ------------------------------------------------------------------------------------

_BACKOFF_CHECKS: dict[str, _Check] = {
    "initial": _duration(positive=False), "max": _duration(positive=False),
    "factor": _factor, "jitter": _jitter, "reset_after": _duration(positive=False),
}
_START_LIMIT_CHECKS: dict[str, _Check] = {"burst": _int_in(1, 1_000_000), "interval": _duration(positive=True)}
_NESTED: dict[str, dict[str, _Check]] = {"backoff": _BACKOFF_CHECKS, "start_limit": _START_LIMIT_CHECKS}
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
}
_SETTING_KEYS = (*_SETTING_CHECKS, *_NESTED)
_ENGINE_ONLY = ("name", "replicas")
_BUILTIN_SETTINGS: dict[str, _Located] = {key: (value, None) for key, value in {
    "restart": "always", "startup_timeout": 600.0, "stall_timeout": 60.0, "stop_timeout": 30.0,
    "gpus": (), "gpus_per_replica": 0, "data_parallel": False, "max_batch_size": 8, "threads": 1,
    "env": (), "backoff.initial": 1.0, "backoff.max": 30.0, "backoff.factor": 2.0,
    "backoff.jitter": 0.1, "backoff.reset_after": 60.0, "start_limit.burst": 5,
    "start_limit.interval": 120.0,
}.items()}
_SUPERVISOR_CHECKS: dict[str, _Check] = {
    "http": _http, "control_socket": _optional_text, "runtime_dir": _optional_text,
    "log_dir": _optional_text, "heartbeat_interval": _duration(positive=True),
    "heartbeat_timeout": _duration(positive=True),
}
_SUPERVISOR_DEFAULTS: dict[str, Any] = {
    "http": DEFAULT_HTTP, "control_socket": None, "runtime_dir": None, "log_dir": None,
    "heartbeat_interval": 1.0, "heartbeat_timeout": 10.0,
}


def _resolve(root: Any, lines: Mapping[str, int], source: str) -> FleetSpec:
    problems = _Problems()
    if not isinstance(root, dict):
        problems.add("", f"top level must be a mapping (version, supervisor, defaults, engines); got {_describe(root)}")
        problems.raise_if_any(source, lines)
    top: dict[str, Any] = root
    _unknown_keys(problems, top, "", ("version", "supervisor", "defaults", "engines"))
    _check_version(problems, top)
    supervisor = _supervisor(problems, top.get("supervisor"))
    defaults = _defaults(problems, top.get("defaults"))
    engines = _engines(problems, top, defaults)
    problems.raise_if_any(source, lines)
    return FleetSpec(source=source, supervisor=supervisor, engines=engines)


def _check_version(problems: _Problems, top: Mapping[str, Any]) -> None:
    if "version" not in top:
        problems.add("version", "required: add 'version: 1' at the top")
    elif type(top["version"]) is not int or top["version"] != 1:
        problems.add("version", f"must be 1, got {_describe(top['version'])}")


def _supervisor(problems: _Problems, raw: Any) -> SupervisorSpec:
    section = _mapping(problems, raw, "supervisor", null_ok=True) or {}
    _unknown_keys(problems, section, "supervisor", _SUPERVISOR_CHECKS)
    values = dict(_SUPERVISOR_DEFAULTS)
    for key, check in _SUPERVISOR_CHECKS.items():
        if key in section:
            values[key] = check(problems, section[key], f"supervisor.{key}")
    interval, timeout = values["heartbeat_interval"], values["heartbeat_timeout"]
    if not _any_bad(interval, timeout) and timeout <= interval:
        path = "supervisor.heartbeat_timeout" if "heartbeat_timeout" in section else "supervisor.heartbeat_interval"
        problems.add(path, f"heartbeat_timeout ({_fmt_duration(timeout)}) must exceed "
                           f"heartbeat_interval ({_fmt_duration(interval)})")
    return SupervisorSpec(http=values["http"], control_socket=values["control_socket"],
                          runtime_dir=values["runtime_dir"], log_dir=values["log_dir"],
                          heartbeat_interval_s=interval, heartbeat_timeout_s=timeout)


def _defaults(problems: _Problems, raw: Any) -> dict[str, _Located]:
    section = _mapping(problems, raw, "defaults", null_ok=True) or {}
    hints = {key: f"{key!r} can only be set per engine, not in defaults" for key in _ENGINE_ONLY}
    _unknown_keys(problems, section, "defaults", _SETTING_KEYS, hints)
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


def _engines(problems: _Problems, top: Mapping[str, Any], defaults: dict[str, _Located]) -> tuple[EngineSpec, ...]:
    raw = top.get("engines")
    if "engines" not in top or not isinstance(raw, list) or not raw:
        got = "it is missing" if "engines" not in top else f"got {_describe(raw)}"
        problems.add("engines", f"must be a non-empty list of engines; {got}")
        return ()
    groups = [_group(problems, item, i, defaults) for i, item in enumerate(raw)]
    valid = [g for g in groups if g is not None]
    _check_names(problems, valid)
    _check_gpu_overlap(problems, valid)
    if len(valid) != len(groups) or any(_any_bad(*(v for v, _ in g.settings.values())) for g in valid):
        return ()
    return tuple(replica for g in valid for replica in _expand(g))


def _group(problems: _Problems, raw: Any, index: int, defaults: dict[str, _Located]) -> _Group | None:
    path = f"engines[{index}]"
    section = _mapping(problems, raw, path)
    if section is None:
        return None
    _unknown_keys(problems, section, path, (*_SETTING_KEYS, *_ENGINE_ONLY))
    name = _engine_name(problems, section.get("name"), f"{path}.name", "name" in section)
    replicas = _int_in(1, 1024)(problems, section.get("replicas", 1), f"{path}.replicas")
    settings = {**_BUILTIN_SETTINGS, **defaults, **_settings(problems, section, path)}
    if "model" not in settings:
        problems.add(f"{path}.model", "required: 'builtin:echo', 'builtin:tiny-llama' or {path: DIR}")
        settings["model"] = (_BAD, None)
    _check_backoff(problems, settings, path)
    if replicas is not _BAD:
        _check_gpu_split(problems, settings, replicas, path)
    if _any_bad(name, replicas):
        return None
    return _Group(index=index, name=name, replicas=replicas, settings=settings)


def _engine_name(problems: _Problems, value: Any, path: str, present: bool) -> Any:
    if not present:
        return problems.add(path, "required: each engine needs a name")
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        return problems.add(path, f"must match [a-z0-9][a-z0-9_.-]{{0,62}}, got {_describe(value)}")
    if value in RESERVED_NAMES:
        return problems.add(path, f"{value!r} is reserved (enginectl uses it for every engine)")
    return value


def _blame(engine_path: str, *located: _Located) -> str | None:
    """Where to report a cross-field problem: a value this engine set, else the first one set at all."""
    paths = [path for _, path in located if path is not None]
    return next((p for p in paths if p.startswith(engine_path + ".")), paths[0] if paths else None)


def _check_backoff(problems: _Problems, s: dict[str, _Located], path: str) -> None:
    initial, maximum = s["backoff.initial"], s["backoff.max"]
    if _any_bad(initial[0], maximum[0]) or maximum[0] >= initial[0]:
        return
    # blame is never None here: the built-in defaults are consistent, so someone set one of them
    problems.add(_blame(path, maximum, initial) or path, f"backoff.max ({_fmt_duration(maximum[0])}) must be "
                                                        f">= backoff.initial ({_fmt_duration(initial[0])})")


def _check_gpu_split(problems: _Problems, s: dict[str, _Located], replicas: int, path: str) -> None:
    (gpus, gpus_at), (per, per_at) = s["gpus"], s["gpus_per_replica"]
    if _any_bad(gpus, per):
        return
    # these depend on this engine's replicas: name the engine when the value came from defaults
    per_at = per_at or f"{path}.gpus_per_replica"
    gpus_at = gpus_at or f"{path}.gpus"
    suffix = lambda at: "" if at.startswith(path + ".") else f" (for {path})"  # noqa: E731
    if gpus and per == 0:
        problems.add(per_at, f"gpus_per_replica must be >= 1 when gpus are listed ({len(gpus)} given){suffix(per_at)}")
    elif not gpus and per > 0:
        problems.add(per_at, f"gpus_per_replica is {per} but no gpus are listed{suffix(per_at)}")
    elif gpus and len(gpus) != replicas * per:
        problems.add(gpus_at, f"{len(gpus)} gpus listed, but replicas ({replicas}) x gpus_per_replica ({per}) "
                              f"= {replicas * per}{suffix(gpus_at)}")


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
        for name, what in names:
            if name in taken and taken[name][0] != g.index:
                other_index, other = taken[name]
                problems.add(path, f"{what} collides with {other} of engines[{other_index}]")
            taken.setdefault(name, (g.index, what))


def _check_gpu_overlap(problems: _Problems, groups: list[_Group]) -> None:
    owner: dict[int, _Group] = {}
    for g in groups:
        gpus, gpus_path = g.settings["gpus"]
        if gpus is _BAD:
            continue
        for i, gpu in enumerate(gpus):
            other = owner.setdefault(gpu, g)
            if other is not g:
                problems.add(f"{gpus_path or f'engines[{g.index}].gpus'}[{i}]",
                             f"GPU {gpu} is used by both engine {other.name!r} (engines[{other.index}]) "
                             f"and engine {g.name!r} (engines[{g.index}])")


def _expand(g: _Group) -> list[EngineSpec]:
    s = {key: value for key, (value, _) in g.settings.items()}
    backoff = BackoffSpec(initial_s=s["backoff.initial"], max_s=s["backoff.max"], factor=s["backoff.factor"],
                          jitter=s["backoff.jitter"], reset_after_s=s["backoff.reset_after"])
    start_limit = StartLimitSpec(burst=s["start_limit.burst"], interval_s=s["start_limit.interval"])
    per = s["gpus_per_replica"]
    return [EngineSpec(
        name=f"{g.name}-{rank}", group=g.name, rank=rank, replicas=g.replicas, model=s["model"],
        gpus=tuple(s["gpus"][rank * per:(rank + 1) * per]), data_parallel=s["data_parallel"],
        max_batch_size=s["max_batch_size"], threads=s["threads"], env=s["env"], restart=s["restart"],
        backoff=backoff, start_limit=start_limit, startup_timeout_s=s["startup_timeout"],
        stall_timeout_s=s["stall_timeout"], stop_timeout_s=s["stop_timeout"],
    ) for rank in range(g.replicas)]


# ---------------------------------------------------------------------------------------------
# Durations and formatting


def _duration_seconds(value: int | float | str) -> float:
    if not isinstance(value, str):
        return float(value)
    match = _DURATION_RE.fullmatch(value.strip())
    if match is None:
        if value.strip().startswith("-"):
            raise ValueError(f"duration must not be negative, got {_show(value)}")
        raise ValueError(f"invalid duration {_show(value)}: use a number with unit ms, s, m or h, e.g. 500ms, 30s, 10m, 1h")
    number, unit = float(match.group(1)), match.group(2)
    if unit in _UNIT_FACTOR:
        return number * _UNIT_FACTOR[unit]
    return number / _UNIT_DIVISOR[unit]  # divide, so "100ms" is exactly 0.1


def _fmt_duration(seconds: float) -> str:
    for unit, size in (("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= size and (seconds / size).is_integer():
            return f"{int(seconds / size)}{unit}"
    if 0 < seconds < 1:
        return f"{seconds * 1000:g}ms"
    return f"{seconds:g}s"


def _printable(text: str) -> str:
    return text if text.isprintable() else repr(text)  # no terminal escapes from a spec


def _format_supervisor(sup: SupervisorSpec) -> list[str]:
    http = "off" if sup.http is None else (f"[{sup.http[0]}]:{sup.http[1]}" if ":" in sup.http[0]
                                          else f"{sup.http[0]}:{sup.http[1]}")
    rows = [
        ("http", http),
        ("control_socket", _printable(sup.control_socket) if sup.control_socket else "default (<runtime_dir>/control.sock)"),
        ("runtime_dir", _printable(sup.runtime_dir) if sup.runtime_dir else "default ($RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/engined or /tmp/engined-<uid>)"),
        ("log_dir", _printable(sup.log_dir) if sup.log_dir else "default ($LOGS_DIRECTORY or <runtime_dir>/logs)"),
        ("heartbeat", f"every {_fmt_duration(sup.heartbeat_interval_s)}, timeout {_fmt_duration(sup.heartbeat_timeout_s)}"),
    ]
    return ["supervisor:"] + [f"  {key:<16}{value}" for key, value in rows]


def _format_engine(e: EngineSpec) -> list[str]:
    b, sl = e.backoff, e.start_limit
    model = _printable(e.model.source) + (f" (dtype {e.model.dtype})" if e.model.dtype else "")
    env = " ".join(_printable(f"{k}={v}") for k, v in e.env) or "-"
    rows = [
        ("model", model),
        ("gpus", ",".join(map(str, e.gpus)) if e.gpus else "none (CPU)"),
        ("restart", f"{e.restart}; start_limit {sl.burst} in {_fmt_duration(sl.interval_s)}"),
        ("timeouts", f"startup {_fmt_duration(e.startup_timeout_s)}, stall {_fmt_duration(e.stall_timeout_s)}, "
                     f"stop {_fmt_duration(e.stop_timeout_s)}"),
        ("backoff", f"initial {_fmt_duration(b.initial_s)}, max {_fmt_duration(b.max_s)}, factor {b.factor:g}, "
                    f"jitter {b.jitter:g}, reset after {_fmt_duration(b.reset_after_s)}"),
        ("batch", f"max_batch_size {e.max_batch_size}, threads {e.threads}, "
                  f"data_parallel {'yes' if e.data_parallel else 'no'}"),
        ("env", env),
    ]
    head = f"  {e.name}  (group {e.group}, rank {e.rank} of {e.replicas})"
    return [head] + [f"    {key:<10}{value}" for key, value in rows]
