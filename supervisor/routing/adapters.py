"""LoRA adapters that survive restarts: which adapters each group serves, which each live
incarnation holds, and the requests that name one.

A group's adapters are its spec's (`adapters: {name: dir}`) and those loaded at run time through
the gateway (`POST /v1/load_lora_adapter`), kept here and in the state snapshot (so an upgrade in
place and a crash adoption keep them). engined's own engines get all of them in their config at
every spawn (a start, a restart, a wake, a standby's build) and load them before READY; what an
incarnation holds is what its READY said, plus what was loaded into it since. A server engined did
not write (`vllm serve`, a command engine) is sent them (`POST /v1/load_lora_adapter`) once READY.
A request for an adapter goes only to an incarnation that holds it (`ADAPTER`, read by the
router's pick).
"""

from __future__ import annotations

import contextvars
import logging
import os
from collections.abc import Callable, Iterable

# the adapter the request being handled asks for (None: the base model), set by the gateway
ADAPTER: contextvars.ContextVar[str | None] = contextvars.ContextVar("adapter", default=None)

Address = tuple[str, int]
CONFIG_FILE = "adapter_config.json"  # what makes a directory an adapter (engine.adapters)

log = logging.getLogger("engined.routing")


class AdapterBook:
    def __init__(self, declared: Callable[[], Iterable[tuple[str, tuple[tuple[str, str], ...]]]],
                 spec_key: Callable[[], object] = lambda: None) -> None:
        self._declared = declared  # (group, its spec's adapters) for every group
        # what `declared` is read from (the fleet's spec: a reload replaces it): the spec's
        # adapters and every request's model lookup are read again only when it or `loaded`
        # changed, not per request
        self._spec_key = spec_key
        self._cache: tuple[object, int, dict[str, dict[str, str]], dict[str, str]] | None = None
        self._version = 0  # `loaded` changed
        self.loaded: dict[str, dict[str, str]] = {}  # group -> name -> dir, loaded at run time
        self.held: dict[Address, set[str]] = {}  # incarnation -> the adapters it holds
        self.changed: Callable[[], None] = lambda: None  # the state snapshot is due
        self._missing: set[tuple[str, str]] = set()  # run-time ones whose directory went away

    def _current(self) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
        """(group -> its spec's adapters, adapter name -> group), cached."""
        key, cache = self._spec_key(), self._cache
        if cache is None or cache[0] is not key or cache[1] != self._version:
            declared = {g: dict(pairs) for g, pairs in self._declared() if pairs}
            groups = sorted(set(declared) | set(self.loaded))
            models = {name: group for group in groups
                      for name in {**declared.get(group, {}), **self.loaded.get(group, {})}}
            cache = self._cache = (key, self._version, declared, models)
        return cache[2], cache[3]

    def declared(self, group: str) -> dict[str, str]:
        return dict(self._current()[0].get(group, {}))

    def served(self, group: str) -> dict[str, str]:
        """Every adapter the group serves: the spec's, then the run time's."""
        return {**self.declared(group), **self.loaded.get(group, {})}

    def of_group(self, group: str) -> dict[str, str]:
        """What a replica of the group is given as it starts (its config), and brought up to
        once READY: the spec's adapters, and the run time's whose directory still holds an
        adapter_config.json. One whose directory went away since it was loaded is left out
        (said once): in a config it would make every start of the group's replicas a config
        error (exit 78: FAILED, never restarted). It stays served where it is held, and is
        given again once its directory is back. (The spec's are the operator's config: one
        of them gone is that error.)"""
        run_time = {name: path for name, path in self.loaded.get(group, {}).items()
                    if self._present(group, name, path)}
        return {**self.declared(group), **run_time}

    def _present(self, group: str, name: str, path: str) -> bool:
        present = os.path.isfile(os.path.join(path, CONFIG_FILE))
        if present:
            self._missing.discard((group, name))
        elif (group, name) not in self._missing:
            self._missing.add((group, name))
            log.warning("[lora] %s: adapter %s: %s holds no %s any more: replicas that start "
                        "now start without it", group, name, path, CONFIG_FILE)
        return present

    def models(self) -> dict[str, str]:
        """adapter name -> group (read on every gateway request: cached)."""
        return self._current()[1]

    def holds(self, address: Address, adapter: str) -> bool:
        return adapter in self.held.get(address, ())

    def ready(self, address: Address, adapters: Iterable[str]) -> None:
        self.held[address] = set(adapters)

    def gone(self, address: Address) -> None:
        self.held.pop(address, None)

    def add(self, group: str, name: str, path: str) -> None:
        self.loaded.setdefault(group, {})[name] = path
        self._version += 1
        self.changed()

    def remove(self, group: str, name: str) -> None:
        self.loaded.get(group, {}).pop(name, None)
        for held in self.held.values():
            held.discard(name)
        self._version += 1
        self.changed()

    def restore(self, loaded: dict[str, dict[str, str]]) -> None:
        """What the engined this one replaced (or that crashed) had loaded at run time."""
        self.loaded = {group: dict(adapters) for group, adapters in loaded.items()}
        self._version += 1


__all__ = ["ADAPTER", "AdapterBook"]
