"""Stage 3's building blocks: the problem collector and one check per kind of value.

A check takes (problems, value, key path) and returns the validated value, or `_BAD` after
recording what is wrong; nothing raises, so every problem in a spec is reported at once.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from engined.supervisor.spec.model import (
    ModelSpec,
    SpecError,
    SpecProblem,
)
from engined.supervisor.spec.source import _describe, _join, _line_for, _show

MAX_DURATION_S = 365 * 86400.0  # keeps every timer API (threading, asyncio, zmq) far from overflow
MAX_GPU_INDEX = 1023
BUILTIN_MODELS = ("echo", "tiny-llama")
# The spec checks a dtype's shape only; the child, which has torch, decides whether torch knows
# it (an unknown one exits 78 there). The daemon cannot import torch to check it here.
_DTYPE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
RESTART_POLICIES = ("always", "on-failure", "never")
LAUNCHERS = ("forkserver", "exec")  # how engine children start (command engines: exec)
ENGINE_LOGS = ("files", "stdout")  # where engine output goes (supervisor.engine_logs)
RESERVED_NAMES = ("all",)  # enginectl's "every engine"
RESERVED_ENV = ("CUDA_VISIBLE_DEVICES", "NOTIFY_SOCKET")  # plus the ENGINED_ prefix
# ...except the knobs the engine child itself reads (engine/echo.py, engine/checkpoint.py): a spec
# sets them through `env` (e.g. ENGINED_ECHO_FAIL for fault injection).
ENGINE_ENV = ("ENGINED_CACHE_DIR", "ENGINED_FAULT_INJECTION")
ENGINE_ENV_PREFIX = ("ENGINED_ECHO_", "ENGINED_FAULT_")

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DURATION_RE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ms|s|m|h)?")
_HOSTNAME_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?")
_UNIT_DIVISOR = {"ms": 1000.0, "s": 1.0, None: 1.0}
_UNIT_FACTOR = {"m": 60.0, "h": 3600.0}


def parse_duration(value: object) -> float:
    """Seconds from "500ms", "30s", "10m", "1h", "1.5s", a bare number string, or int/float
    seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(
            f"expected a duration such as 500ms, 30s, 10m or 1h, got {_describe(value)}"
        )
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


def _duration_seconds(value: int | float | str) -> float:
    if not isinstance(value, str):
        return float(value)
    match = _DURATION_RE.fullmatch(value.strip())
    if match is None:
        if value.strip().startswith("-"):
            raise ValueError(f"duration must not be negative, got {_show(value)}")
        raise ValueError(
            f"invalid duration {_show(value)}: use a number with unit ms, s, m or h, "
            "e.g. 500ms, 30s, 10m, 1h"
        )
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
        found = [
            SpecProblem(source, path, _line_for(lines, path), message) for path, message in unique
        ]
        if found:  # in file order, so the list reads top to bottom next to the spec
            raise SpecError(sorted(found, key=lambda p: p.line if p.line is not None else 1 << 30))


_Check = Callable[[_Problems, Any, str], Any]  # returns the validated value or _BAD


def _unknown_keys(
    problems: _Problems,
    mapping: Mapping[str, Any],
    path: str,
    allowed: Iterable[str],
    hints: Mapping[str, str] | None = None,
) -> None:
    allowed = sorted(allowed)
    for key in mapping:
        if key in allowed:
            continue
        if hints and key in hints:
            problems.add(_join(path, key), hints[key])
            continue
        close = difflib.get_close_matches(key, allowed, n=1)
        guess = f"did you mean {close[0]!r}? " if close else ""
        problems.add(
            _join(path, key), f"unknown key {_show(key)} ({guess}allowed: {', '.join(allowed)})"
        )


def _mapping(
    problems: _Problems, value: Any, path: str, null_ok: bool = False
) -> dict[str, Any] | None:
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


_SIZE_RE = re.compile(r"([0-9]+)\s*(B|K|KB|KIB|M|MB|MIB|G|GB|GIB)?", re.IGNORECASE)
_SIZE_FACTOR = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
                "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def _size(low: int, high: int) -> _Check:
    """Bytes: an integer, or a string with a binary unit (`10MiB`, `512K`, `1G`)."""
    def check(problems: _Problems, value: Any, path: str) -> Any:
        if type(value) is int:
            size = value
        elif isinstance(value, str) and (m := _SIZE_RE.fullmatch(value.strip())):
            size = int(m.group(1)) * _SIZE_FACTOR[(m.group(2) or "").upper()]
        else:
            return problems.add(path, f"must be a size in bytes (an integer, or like 10MiB, "
                                      f"512K), got {_describe(value)}")
        if not low <= size <= high:
            return problems.add(path, f"must be between {low} and {high} bytes, got {size}")
        return size

    return check


def _optional_port(problems: _Problems, value: Any, path: str) -> Any:
    """A port number (1-65535), or null for none."""
    return None if value is None else _int_in(1, 65535)(problems, value, path)


def _optional_size(low: int, high: int) -> _Check:
    """A size (`_size`), or null for none."""
    inner = _size(low, high)

    def check(problems: _Problems, value: Any, path: str) -> Any:
        return None if value is None else inner(problems, value, path)

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
            return problems.add(
                path, f"must be one of {', '.join(choices)}; got {_describe(value)}"
            )
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


def _engine_name(problems: _Problems, value: Any, path: str) -> Any:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        return problems.add(path, f"must match [a-z0-9][a-z0-9_.-]{{0,62}}, got {_describe(value)}")
    if value in RESERVED_NAMES:
        return problems.add(path, f"{value!r} is reserved (enginectl uses it for every engine)")
    return value


# Structured checks ----------------------------------------------------------------------------


def _model(problems: _Problems, value: Any, path: str) -> Any:
    usage = "'builtin:echo', 'builtin:tiny-llama' or {path: DIR, dtype: ...}"
    if isinstance(value, str):
        kind, sep, name = value.partition(":")
        if not sep or kind != "builtin":
            return problems.add(
                path, f"must be {usage}; got {_show(value)} (a directory goes in {{path: ...}})"
            )
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
    return ModelSpec(
        source=model_path, builtin=None, path=model_path, dtype=None if dtype == "auto" else dtype
    )


def _dtype(problems: _Problems, value: Any, path: str) -> Any:
    if not isinstance(value, str) or not _DTYPE_RE.fullmatch(value):
        return problems.add(
            path,
            f"must be auto or a torch dtype name such as float32, float16 "
            f"or bfloat16; got {_show(value) if isinstance(value, str) else _describe(value)}",
        )
    return value


AUTO_GPUS = "auto"  # `gpus: auto`: resolved to the GPUs visible to engined (spec.resolve)


def _gpus(problems: _Problems, value: Any, path: str) -> Any:
    if value is None:
        return ()
    if value == AUTO_GPUS:
        return AUTO_GPUS
    if not isinstance(value, list):
        return problems.add(path, f"must be a list of GPU indices or 'auto', got "
                                  f"{_describe(value)}")
    first: dict[int, int] = {}  # gpu -> position, to name the earlier entry
    bad = False
    for i, item in enumerate(value):
        index = _int_in(0, MAX_GPU_INDEX)(problems, item, f"{path}[{i}]")
        if index is not _BAD and index in first:
            index = problems.add(
                f"{path}[{i}]", f"GPU {index} is listed twice (also {path}[{first[index]}])"
            )
        if index is _BAD:
            bad = True
        else:
            first[index] = i
    return _BAD if bad else tuple(value)


BACKENDS = ("transformers", "vllm")
_ARG_NAME_RE = re.compile(r"[a-z_][a-z0-9_]{0,63}")


def _engine_args(problems: _Problems, value: Any, path: str) -> Any:
    """vLLM's EngineArgs keywords: names and JSON values (checked by vLLM in the child; a bad
    one exits 78 with vLLM's message). Stored as sorted (name, canonical JSON) pairs."""
    mapping = _mapping(problems, value, path, null_ok=True)
    if mapping is None:
        return _BAD
    pairs = []
    for key, item in mapping.items():
        if not _ARG_NAME_RE.fullmatch(key):
            problems.add(_join(path, key), f"invalid argument name {_show(key)} (EngineArgs "
                                           f"keywords look like max_model_len)")
            continue
        try:
            pairs.append((key, json.dumps(item, sort_keys=True, allow_nan=False)))
        except (TypeError, ValueError):
            problems.add(_join(path, key), f"must be a plain value, got {_describe(item)}")
    return tuple(sorted(pairs))


# vLLM's OpenAI frontend options that decide how a chat is rendered and its output read (as
# `vllm serve` takes them), and their types
FRONTEND_ARGS: dict[str, type] = {
    "enable_auto_tool_choice": bool,  # tool_choice auto: the tool parser reads the output
    "tool_call_parser": str,  # vLLM's tool parser (e.g. hermes, llama3_json, mistral)
    "reasoning_parser": str,  # vLLM's reasoning parser (e.g. deepseek_r1, qwen3)
    "chat_template": str,  # a Jinja template, inline or a file's path
    "exclude_tools_when_tool_choice_none": bool,
}


def _frontend_args(problems: _Problems, value: Any, path: str) -> Any:
    """vLLM frontend options for a backend: vllm engine's chats (FRONTEND_ARGS): sorted (name,
    JSON value) pairs; a parser vLLM does not know fails the engine at load (exit 78)."""
    mapping = _mapping(problems, value, path, null_ok=True)
    if mapping is None:
        return _BAD
    pairs = []
    for key, item in mapping.items():
        kind = FRONTEND_ARGS.get(key)
        if kind is None:
            problems.add(_join(path, key), f"unknown frontend argument {_show(key)} (one of "
                                           f"{', '.join(sorted(FRONTEND_ARGS))})")
        elif not isinstance(item, kind) or (kind is str and not item):
            wanted = "true or false" if kind is bool else "a non-empty string"
            problems.add(_join(path, key), f"must be {wanted}, got {_describe(item)}")
        else:
            pairs.append((key, json.dumps(item)))
    return tuple(sorted(pairs))


def _env(problems: _Problems, value: Any, path: str) -> Any:
    mapping = _mapping(problems, value, path, null_ok=True)
    if mapping is None:
        return _BAD
    pairs = [_env_pair(problems, key, item, _join(path, key)) for key, item in mapping.items()]
    return _BAD if _any_bad(*pairs) else tuple(sorted(pairs))


def _env_pair(problems: _Problems, key: str, value: Any, path: str) -> Any:
    if not _ENV_NAME_RE.fullmatch(key):
        return problems.add(
            path, f"invalid environment variable name {_show(key)} (use [A-Za-z_][A-Za-z0-9_]*)"
        )
    engine_knob = key in ENGINE_ENV or key.startswith(ENGINE_ENV_PREFIX)
    if key in RESERVED_ENV or (key.startswith("ENGINED_") and not engine_knob):
        return problems.add(
            path, f"{key} is set by engined itself (reserved: {', '.join(RESERVED_ENV)}, ENGINED_*)"
        )
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return problems.add(
            path, f"must be a string or a number, got {_describe(value)} (quote it)"
        )
    text = value if isinstance(value, str) else str(value)
    if "\0" in text:
        return problems.add(path, "must not contain NUL characters")
    return (key, text)


def _http(problems: _Problems, value: Any, path: str) -> Any:
    if value is False or (isinstance(value, str) and value.strip().lower() == "off"):
        return None
    if not isinstance(value, str):
        hint = ' (quote IPv6 addresses: "[::1]:9400")' if isinstance(value, list) else ""
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
