"""How `engined --check` and the spec reference show resolved values (spec.keys' `Shown`)."""

from __future__ import annotations

from typing import Callable

from engined.supervisor.spec.checks import _fmt_duration
from engined.supervisor.spec.model import ModelSpec, ProbeSpec, ProgressSpec


def _printable(text: str) -> str:
    return text if text.isprintable() else repr(text)  # no terminal escapes from a spec


def _address(address: tuple[str, int] | None) -> str:
    return "off" if address is None else f"{address[0]}:{address[1]}"


def _http_address(address: tuple[str, int] | None) -> str:
    if address is not None and ":" in address[0]:
        return f"[{address[0]}]:{address[1]}"
    return _address(address)


def _or_default(default: str) -> Callable[[str | None], str]:
    return lambda path: _printable(path) if path else f"default ({default})"


def _printable_if_set(text: str | None) -> str | None:
    return _printable(text) if text else None


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n} bytes"


def _model_text(model: ModelSpec) -> str:
    return _printable(model.source) + (f" (dtype {model.dtype})" if model.dtype else "")


def _port_text(port: int | None) -> str:
    if port is None:
        return "none"
    return "auto (a free loopback port at each spawn)" if port == 0 else str(port)


def _probe_text(probe: ProbeSpec | None) -> str:
    if probe is None:
        return "probe off"
    return (f"probe GET {probe.path} every {_fmt_duration(probe.interval_s)}, timeout "
            f"{_fmt_duration(probe.timeout_s)}, {probe.failures} failures = hung")


def _progress_text(progress: ProgressSpec | None) -> str | None:
    if progress is None:
        return None
    return f"progress {progress.counter} while {progress.busy} > 0 ({progress.metrics})"
