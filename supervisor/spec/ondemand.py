"""The on-demand keys' checks: engines that sleep when idle and wake on a request
(`idle_timeout`, `min_replicas`, `wake_timeout`, `sleep_mode`), the host's memory budget that
swaps them (`supervisor.memory_budget`), and LoRA adapters (`adapters`). Per value here, and what
holds across keys (`check_group`, `check_budget`), called by resolve.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from engined.supervisor.spec.checks import _BAD, _duration, _Located, _mapping, _Problems
from engined.supervisor.spec.source import _describe, _join, _show

SLEEP_MODES = ("stop", "level1", "level2")
_ADAPTER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}")
_SECONDS = _duration(positive=True)


def _optional_duration(problems: _Problems, value: Any, path: str) -> Any:
    """A duration, or null for none (never)."""
    return None if value is None else _SECONDS(problems, value, path)


def _adapters(problems: _Problems, value: Any, path: str) -> Any:
    """LoRA adapters, name -> directory (relative to the spec file); sorted pairs."""
    mapping = _mapping(problems, value, path, null_ok=True)
    if mapping is None:
        return _BAD
    pairs = []
    for name, where in mapping.items():
        at = _join(path, str(name))
        if not isinstance(name, str) or not _ADAPTER_RE.fullmatch(name):
            problems.add(at, f"an adapter's name must be letters, digits and _.:/- (it is the "
                             f"model name clients ask for), got {_show(name)}")
        elif not isinstance(where, str) or not where or "\0" in where:
            problems.add(at, f"must be the adapter's directory (a path), got {_describe(where)}")
        else:
            pairs.append((name, where))
    return tuple(sorted(pairs))


def check_group(problems: _Problems, s: dict[str, _Located], replicas: Any, path: str,
                command: Any) -> None:
    """What holds across an engine's on-demand keys (`command`: a command engine's, as
    written; None for engined's own engines)."""
    idle, idle_at = s["idle_timeout"]
    least, least_at = s["min_replicas"]
    mode, mode_at = s["sleep_mode"]
    if idle not in (None, _BAD):
        if isinstance(least, int) and isinstance(replicas, int) and least > replicas:
            problems.add(least_at or f"{path}.min_replicas",
                         f"min_replicas {least} is more than the engine's {replicas} replicas")
        if s["data_parallel"][0] is True and least not in (0, replicas, _BAD):
            problems.add(least_at or f"{path}.min_replicas",
                         "a data-parallel group sleeps and wakes as a whole: min_replicas must "
                         f"be 0 or {replicas}")
        standby, standby_at = s["standby"]
        if standby not in (0, _BAD):
            problems.add(standby_at or f"{path}.standby",
                         "standby keeps spares awake and idle_timeout puts the group to sleep: "
                         "choose one")
    if mode in ("level1", "level2"):
        check_sleep_mode(problems, s, mode, mode_at or f"{path}.sleep_mode", command)
    adapters, adapters_at = s["adapters"]
    if adapters not in ((), _BAD) and not command:
        backend = s["backend"][0]
        source = getattr(s["model"][0], "source", "")
        if backend != "vllm" and source != "builtin:echo":
            problems.add(adapters_at or f"{path}.adapters",
                         f"LoRA adapters need backend: vllm (or a `vllm serve` command engine "
                         f"started with --enable-lora); this engine runs {backend}")


def check_sleep_mode(problems: _Problems, s: dict[str, _Located], mode: str, where: str,
                     command: Any) -> None:
    """sleep_mode level1/level2 is vLLM's sleep mode: a `backend: vllm` engine or a `vllm
    serve` command engine started with --enable-sleep-mode, on GPUs (CUDA, ROCm), not a
    data-parallel gang; builtin:echo mimics it (engine.echo) for the supervisor's tests."""
    echo = not command and getattr(s["model"][0], "source", "") == "builtin:echo"
    backend = s["backend"][0]
    if s["data_parallel"][0] is True:
        problems.add(where, f"sleep_mode {mode} keeps each process: a data-parallel group sleeps "
                            f"and wakes whole by a stop (use sleep_mode: stop)")
    elif echo:
        return
    elif not command and backend != "vllm":
        problems.add(where, f"sleep_mode {mode} is vLLM's sleep mode: it needs backend: vllm or "
                            f"a `vllm serve` command engine (this engine runs {backend}); use "
                            f"sleep_mode: stop")
    elif not s["gpus"][0]:
        problems.add(where, f"sleep_mode {mode} is vLLM's sleep mode, which works on CUDA and "
                            f"ROCm GPUs only, and this engine has no gpus (it runs on the CPU): "
                            f"use sleep_mode: stop")
    elif isinstance(command, list) and "--enable-sleep-mode" not in command:
        problems.add(where, f"sleep_mode {mode} needs the server started with "
                            f"--enable-sleep-mode: add it to the engine's command")


def check_budget(problems: _Problems, budget: tuple[int | None, int | None],
                 engines: Sequence[Any]) -> None:
    """A memory budget every engine's memory_limit fits in (host: engines without GPUs; gpu:
    per GPU, engines with GPUs)."""
    host, gpu = budget
    for engine in engines:
        limit = engine.memory_limit
        room, key = (gpu, "gpu") if engine.gpus else (host, "host")
        if limit is not None and room is not None and limit > room:
            problems.add(f"supervisor.memory_budget.{key}",
                         f"{room} bytes is below engine {engine.group!r}'s memory_limit "
                         f"({limit} bytes): it could never wake")
            return
