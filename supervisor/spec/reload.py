"""Reload planning (pure): the difference between the running fleet spec and a new one.

Per replica: added, removed, changed (restarted with reason `reload`) or unchanged (left running,
same pid and incarnation). A changed replica count only adds or removes replicas: the group size
is not part of a non-data-parallel replica's identity, so `tiny-0` survives `replicas: 2 -> 3`.
Data-parallel ranks do depend on the group size (it is their world size), so there a resize
changes every rank. Supervisor-level keys cannot be applied live; they are reported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engined.supervisor.spec.model import EngineSpec, FleetSpec, SupervisorSpec


class ReloadRejected(Exception):
    """The new spec is invalid (or engined is stopping); nothing was changed."""


@dataclass(frozen=True)
class ReloadPlan:
    added: tuple[EngineSpec, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[EngineSpec, ...] = ()
    unchanged: tuple[EngineSpec, ...] = ()  # may carry a new (equivalent) spec, e.g. group size
    restart_required: tuple[str, ...] = field(default_factory=tuple)

    def summary(self) -> dict[str, list[str]]:
        return {"added": [e.name for e in self.added], "removed": list(self.removed),
                "changed": [e.name for e in self.changed],
                "unchanged": [e.name for e in self.unchanged],
                "restart_required": list(self.restart_required)}


def identity(spec: EngineSpec) -> EngineSpec:
    """What must stay equal for a running replica to be left alone."""
    # the launcher applies from the next spawn; the on-demand keys apply at once
    spec = dataclasses.replace(spec, launcher="", idle_timeout_s=None, min_replicas=0,
                               wake_timeout_s=0.0)
    return spec if spec.data_parallel else dataclasses.replace(spec, replicas=0)


def plan_reload(old: FleetSpec, new: FleetSpec) -> ReloadPlan:
    old_by_name = {e.name: e for e in old.engines}
    new_by_name = {e.name: e for e in new.engines}
    added = tuple(e for e in new.engines if e.name not in old_by_name)
    removed = tuple(e.name for e in old.engines if e.name not in new_by_name)
    both = [e for e in new.engines if e.name in old_by_name]
    changed = tuple(e for e in both if identity(e) != identity(old_by_name[e.name]))
    unchanged = tuple(e for e in both if identity(e) == identity(old_by_name[e.name]))
    return ReloadPlan(added, removed, changed, unchanged,
                      supervisor_changes(old.supervisor, new.supervisor))


# applied by a reload: the token file is re-read; the launcher is the engines' (next spawn)
LIVE_SUPERVISOR_KEYS = ("api_key_file", "control_token_file", "launcher", "memory_budget")


def supervisor_changes(old: SupervisorSpec, new: SupervisorSpec) -> tuple[str, ...]:
    """Supervisor keys that changed and need a restart of engined to apply."""
    return tuple(f"supervisor.{f.name.removesuffix('_s')}"
                 for f in dataclasses.fields(SupervisorSpec)
                 if f.name not in LIVE_SUPERVISOR_KEYS
                 and getattr(old, f.name) != getattr(new, f.name))
