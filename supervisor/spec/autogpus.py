"""`gpus: auto`, resolved: which of the GPUs visible to engined each such engine takes. The
visible GPUs come from a lookup that the caller brings (the daemon reads its host's once, at
start; `--check` says what it found separately): resolving a spec never reads the host."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engined.supervisor.spec.checks import _BAD, AUTO_GPUS, _any_bad, _Located, _Problems

# The GPUs `gpus: auto` may take, and where they were read: (indices, source)
GpuLookup = Callable[[], tuple[tuple[int, ...], str]]


def no_gpus() -> tuple[tuple[int, ...], str]:
    """The lookup of a spec resolved without a host (a text, a test): `gpus: auto` engines are
    resolved as CPU engines, gpus_per_replica or not (the daemon and --check read the host)."""
    return (), "no host given"



class AutoGpus:
    """`gpus: auto`: each such engine, in spec order, takes the GPUs visible to engined that no
    engine lists and no earlier `auto` engine took: gpus_per_replica of them per replica (and
    standby), or, with gpus_per_replica 0, an equal share of them. None visible: the CPU.
    The visible GPUs come from `lookup`, which the caller brings (the daemon reads its host's
    once, at start): resolving a spec never reads the host itself."""

    def __init__(self, raw: list[Any], lookup: GpuLookup) -> None:
        self.lookup = lookup
        self.taken = {gpu for item in raw if isinstance(item, dict)
                      and isinstance(item.get("gpus"), list)
                      for gpu in item["gpus"] if isinstance(gpu, int)}
        self._visible: tuple[tuple[int, ...], str] | None = None

    def allot(self, problems: _Problems, s: dict[str, _Located], replicas: int,
              path: str) -> None:
        (gpus, gpus_at), (per, per_at) = s["gpus"], s["gpus_per_replica"]
        if gpus != AUTO_GPUS or _any_bad(per, s["standby"][0]):
            return
        if self.lookup is no_gpus:  # no host to read: what runs here is decided where it runs
            s["gpus"], s["gpus_per_replica"] = ((), gpus_at), (0, per_at)
            return
        if self._visible is None:
            self._visible = self.lookup()
        visible, source = self._visible
        free = [g for g in visible if g not in self.taken]
        count = replicas + s["standby"][0]
        if not visible and per == 0:
            s["gpus"] = ((), gpus_at)  # no GPU here: the engines run on the CPU
            return
        per = per or len(free) // count
        if per == 0 or len(free) < count * per:
            problems.add(gpus_at or f"{path}.gpus",
                         f"gpus: auto found {len(free)} free GPU(s) of {len(visible)} visible "
                         f"(from {source}), but {count} replica(s) x gpus_per_replica "
                         f"({per or 1}) need {count * (per or 1)}")
            s["gpus"] = (_BAD, gpus_at)
            return
        chosen = tuple(free[:count * per])
        self.taken.update(chosen)
        s["gpus"], s["gpus_per_replica"] = (chosen, gpus_at), (per, per_at)


__all__ = ["AutoGpus", "GpuLookup", "no_gpus"]
