"""LoRA adapters in an engine: which are loaded, by name, and what makes a directory one.

An engine loads adapters while it is built (EngineConfig.adapters: name -> absolute directory,
before READY, which lists them) and at run time (the load_adapter / unload_adapter tasks); a
request names the one it generates with (GenerateRequest.adapter). The backends that can
(vLLM; builtin:echo, cheaply, for the supervisor's tests) keep an `Adapters` registry; the
others refuse (`backend.no_adapters`). The checks here are the same for every backend, so an
adapter that is not one gets the same words from each: a relative path, no directory, no
adapter_config.json, a config that is not a LoRA. What only the backend knows (vLLM: the rank
against max_lora_rank, the weights against the model) it says itself.

A name loaded again from the same directory is already loaded (idempotent); from another
directory it is refused (unload it first): two directories under one name would make which
weights answered depend on timing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engined.engine.backend import EngineConfigError, ProgressFn, RequestRejected

if TYPE_CHECKING:
    from engined.engine.backend import Backend

CONFIG_FILE = "adapter_config.json"


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str  # absolute, normalised
    rank: int  # its adapter_config.json's r
    slot: int = 0  # the backend's id for it (vLLM's lora_int_id), unique in the process


def read_adapter(name: str, path: str) -> Adapter:
    """Adapter `name` at `path`, if that is a LoRA adapter directory: RequestRejected naming
    the adapter and what is wrong otherwise."""
    if not name or not name.isprintable() or name != name.strip():
        raise RequestRejected(f"adapter name {name!r} must be printable, without surrounding "
                              f"spaces, and not empty")
    where = f"adapter {name!r}"
    if not path or not os.path.isabs(path):
        raise RequestRejected(f"{where}: its path {path!r} must be an absolute directory")
    directory = Path(os.path.normpath(path))
    if not directory.is_dir():
        raise RequestRejected(f"{where}: {directory} is not a directory")
    config_file = directory / CONFIG_FILE
    try:
        config: Any = json.loads(config_file.read_text("utf-8"))
    except FileNotFoundError:
        raise RequestRejected(f"{where}: {directory} is not a LoRA adapter directory (no "
                              f"{CONFIG_FILE})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestRejected(f"{where}: cannot read {config_file}: {exc}") from None
    return Adapter(name, str(directory), _rank(where, config_file, config))


def _rank(where: str, config_file: Path, config: Any) -> int:
    """Its LoRA rank, where the config is a plain LoRA's (PEFT's peft_type LORA)."""
    if not isinstance(config, dict):
        raise RequestRejected(f"{where}: {config_file} is not a JSON object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise RequestRejected(f"{where}: {config_file} has peft_type {kind!r}, not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise RequestRejected(f"{where}: {config_file} has no LoRA rank r (got {rank!r})")
    return rank


class Adapters:
    """The adapters loaded in one engine, by name (written by its backend only)."""

    def __init__(self) -> None:
        self.loaded: dict[str, Adapter] = {}
        self._last_slot = 0

    def names(self) -> list[str]:
        return sorted(self.loaded)

    def get(self, name: str) -> Adapter:
        """The loaded adapter `name`; RequestRejected naming it and the loaded ones."""
        adapter = self.loaded.get(name)
        if adapter is None:
            raise RequestRejected(f"adapter {name!r} is not loaded in this engine (loaded: "
                                  f"{', '.join(self.names()) or 'none'})")
        return adapter

    def prepare(self, name: str, path: str) -> Adapter | None:
        """What loading `name` from `path` means: the adapter to load (with a fresh slot), or
        None when it is already loaded from there. RequestRejected for a directory that is not
        an adapter, or a name loaded from another directory."""
        adapter = read_adapter(name, path)
        current = self.loaded.get(name)
        if current is not None and current.path == adapter.path:
            return None
        if current is not None:
            raise RequestRejected(f"adapter {name!r} is already loaded from {current.path} "
                                  f"(unload it before loading {adapter.path})")
        self._last_slot += 1
        return Adapter(adapter.name, adapter.path, adapter.rank, self._last_slot)

    def add(self, adapter: Adapter) -> None:
        """`adapter`, from `prepare`, is loaded now."""
        self.loaded[adapter.name] = adapter

    def remove(self, name: str) -> Adapter:
        """Unloaded: RequestRejected naming it if it was not loaded."""
        adapter = self.get(name)
        del self.loaded[name]
        return adapter


def check_config_adapters(adapters: dict[str, str]) -> list[Adapter]:
    """The config's adapters, read before anything is built: exit 78 for one that is not."""
    try:
        return [read_adapter(name, path) for name, path in sorted(adapters.items())]
    except RequestRejected as exc:
        raise EngineConfigError(str(exc)) from None


def load_config_adapters(backend: Backend, adapters: dict[str, str],
                         progress: ProgressFn) -> None:
    """Load the config's adapters into the built backend, before READY: one the backend
    refuses is a configuration error (exit 78, with the backend's words)."""
    for name, path in sorted(adapters.items()):
        progress("adapters", f"{name} from {path}")
        try:
            backend.load_adapter(name, path)
        except RequestRejected as exc:
            message = str(exc)
            if not message.startswith(f"adapter {name!r}"):
                message = f"adapter {name!r} ({path}): {message}"
            raise EngineConfigError(message) from None
