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
from collections.abc import Callable, Iterable

# the adapter the request being handled asks for (None: the base model), set by the gateway
ADAPTER: contextvars.ContextVar[str | None] = contextvars.ContextVar("adapter", default=None)

Address = tuple[str, int]


class AdapterBook:
    def __init__(self, declared: Callable[[], Iterable[tuple[str, tuple[tuple[str, str], ...]]]]
                 ) -> None:
        self._declared = declared  # (group, its spec's adapters) for every group
        self.loaded: dict[str, dict[str, str]] = {}  # group -> name -> dir, loaded at run time
        self.held: dict[Address, set[str]] = {}  # incarnation -> the adapters it holds
        self.changed: Callable[[], None] = lambda: None  # the state snapshot is due

    def declared(self, group: str) -> dict[str, str]:
        return next((dict(pairs) for g, pairs in self._declared() if g == group), {})

    def of_group(self, group: str) -> dict[str, str]:
        """Every adapter the group serves: the spec's, then the run time's."""
        return {**self.declared(group), **self.loaded.get(group, {})}

    def models(self) -> dict[str, str]:
        """adapter name -> group."""
        groups = {g for g, _ in self._declared()} | set(self.loaded)
        return {name: group for group in sorted(groups) for name in self.of_group(group)}

    def holds(self, address: Address, adapter: str) -> bool:
        return adapter in self.held.get(address, ())

    def ready(self, address: Address, adapters: Iterable[str]) -> None:
        self.held[address] = set(adapters)

    def gone(self, address: Address) -> None:
        self.held.pop(address, None)

    def add(self, group: str, name: str, path: str) -> None:
        self.loaded.setdefault(group, {})[name] = path
        self.changed()

    def remove(self, group: str, name: str) -> None:
        self.loaded.get(group, {}).pop(name, None)
        for held in self.held.values():
            held.discard(name)
        self.changed()

    def restore(self, loaded: dict[str, dict[str, str]]) -> None:
        """What the engined this one replaced (or that crashed) had loaded at run time."""
        self.loaded = {group: dict(adapters) for group, adapters in loaded.items()}


__all__ = ["ADAPTER", "AdapterBook"]
