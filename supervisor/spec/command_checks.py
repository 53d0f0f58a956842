"""The checks of a command engine's keys (a server engined did not write, `command:`): its argv,
its port, its probe, its progress metrics, whether the gateway may route to it and its canary.
The building blocks are supervisor.spec.checks'."""

from __future__ import annotations

import re
from typing import Any

from engined.supervisor.spec.checks import (
    _BAD,
    _any_bad,
    _duration,
    _int_in,
    _mapping,
    _Problems,
    _unknown_keys,
)
from engined.supervisor.spec.model import VLLM_PROGRESS, CanarySpec, ProbeSpec, ProgressSpec
from engined.supervisor.spec.source import _describe, _join, _show

# Command engines ------------------------------------------------------------------------------

MAX_ARGV = 4096
_METRIC_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
PROGRESS_PRESETS = {"vllm": VLLM_PROGRESS}


def _command(problems: _Problems, value: Any, path: str) -> Any:
    """argv of a server engined did not write: a non-empty list of strings (no shell)."""
    if isinstance(value, str):
        return problems.add(path, f"must be a list of arguments (argv, no shell), e.g. "
                                  f"[vllm, serve, /models/x, --port, '{{port}}']; got "
                                  f"{_show(value)}")
    if not isinstance(value, list):
        return problems.add(path, f"must be a list of arguments, got {_describe(value)}")
    if not value:
        return problems.add(path, "must not be empty: it starts with the program to run")
    if len(value) > MAX_ARGV:
        return problems.add(path, f"at most {MAX_ARGV} arguments, got {len(value)}")
    argv = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            problems.add(f"{path}[{i}]", f"must be a string or a number, got {_describe(item)}")
            continue
        text = item if isinstance(item, str) else str(item)
        if "\0" in text:
            problems.add(f"{path}[{i}]", "must not contain NUL characters")
            continue
        argv.append(text)
    if len(argv) != len(value):
        return _BAD
    if not argv[0].strip():
        return problems.add(f"{path}[0]", "the program to run must not be empty")
    return tuple(argv)


def _port(problems: _Problems, value: Any, path: str) -> Any:
    """`auto` (0: a free loopback port at each spawn) or the first replica's port."""
    if value == "auto":
        return 0
    if type(value) is not int or not 1 <= value <= 65535:
        return problems.add(path, f"must be auto or a port number (1-65535), got "
                                  f"{_describe(value)}")
    return value


def _section_or_off(problems: _Problems, value: Any, path: str,
                    keys: tuple[str, ...]) -> Any:
    """A section of optional `keys` (null: all defaults), False for off / false, _BAD."""
    if value in ("off", False):
        return False
    mapping = _mapping(problems, value, path, null_ok=True)
    if mapping is None:
        return _BAD
    _unknown_keys(problems, mapping, path, keys)
    return mapping


def _probe(problems: _Problems, value: Any, path: str) -> Any:
    """{path, interval, timeout, failures} (each optional), or off / false: no probe."""
    mapping = _section_or_off(problems, value, path, ("path", "interval", "timeout", "failures"))
    if mapping in (False, _BAD):
        return mapping
    default = ProbeSpec()
    url_path = mapping.get("path", default.path)
    if not isinstance(url_path, str) or not url_path.startswith("/") or any(
            c.isspace() or ord(c) < 32 for c in url_path) or len(url_path) > 1024:
        url_path = problems.add(_join(path, "path"), f"must be an HTTP path starting with /, "
                                                     f"got {_describe(url_path)}")
    interval = _duration(positive=True)(problems, mapping.get("interval", default.interval_s),
                                        _join(path, "interval"))
    timeout = _duration(positive=True)(problems, mapping.get("timeout", default.timeout_s),
                                       _join(path, "timeout"))
    failures = _int_in(1, 1000)(problems, mapping.get("failures", default.failures),
                                _join(path, "failures"))
    if _any_bad(url_path, interval, timeout, failures):
        return _BAD
    return ProbeSpec(url_path, interval, timeout, failures)


def _canary(problems: _Problems, value: Any, path: str) -> Any:
    """{idle, timeout} (each optional), or off / false: none."""
    mapping = _section_or_off(problems, value, path, ("idle", "timeout"))
    if mapping in (False, _BAD):
        return mapping
    default = CanarySpec()
    idle = _duration(positive=True)(problems, mapping.get("idle", default.idle_s),
                                    _join(path, "idle"))
    timeout = _duration(positive=True)(problems, mapping.get("timeout", default.timeout_s),
                                       _join(path, "timeout"))
    if _any_bad(idle, timeout):
        return _BAD
    return CanarySpec(idle, timeout)


def _progress(problems: _Problems, value: Any, path: str) -> Any:
    """`vllm`, or {metrics: PATH, busy: GAUGE, counter: COUNTER} for other servers."""
    if isinstance(value, str):
        if value not in PROGRESS_PRESETS:
            return problems.add(path, f"must be {' or '.join(PROGRESS_PRESETS)}, or "
                                      f"{{metrics: /metrics, busy: GAUGE, counter: COUNTER}}; "
                                      f"got {_show(value)}")
        return PROGRESS_PRESETS[value]
    mapping = _mapping(problems, value, path)
    if mapping is None:
        return _BAD
    _unknown_keys(problems, mapping, path, ("metrics", "busy", "counter"))
    found: dict[str, Any] = {}
    for key in ("busy", "counter"):
        item = mapping.get(key)
        if key not in mapping:
            found[key] = problems.add(_join(path, key), "required: a metric name")
        elif not isinstance(item, str) or not _METRIC_RE.fullmatch(item):
            found[key] = problems.add(_join(path, key), f"must be a Prometheus metric name, got "
                                                        f"{_describe(item)}")
        else:
            found[key] = item
    metrics = mapping.get("metrics", "/metrics")
    if not isinstance(metrics, str) or not metrics.startswith("/") or any(
            c.isspace() for c in metrics):
        metrics = problems.add(_join(path, "metrics"), f"must be an HTTP path starting with /, "
                                                       f"got {_describe(metrics)}")
    if _any_bad(metrics, *found.values()):
        return _BAD
    return ProgressSpec(metrics=metrics, busy=found["busy"], counter=found["counter"])


def _openai(problems: _Problems, value: Any, path: str) -> Any:
    """Whether the gateway routes to the server's OpenAI API: true (plain OpenAI), vllm (vLLM's
    extensions too: token ids in answers, so a stream can continue on another replica), false."""
    if value is True:
        return "openai"
    if value is False:
        return ""
    if value == "vllm":
        return "vllm"
    return problems.add(path, f"must be true, false or vllm, got {_describe(value)}")
