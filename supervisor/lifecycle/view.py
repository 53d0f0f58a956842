"""Immutable snapshots of the fleet: what status, metrics, health, readiness and counts read.

A replica builds its `EngineView` on request (and publishes one with every state change,
supervisor.notices); whatever only reports reads views, never a replica's fields. The one live
reader is the router (supervisor.routing), which asks a replica for its serving incarnation on
every request. "Wanted vs ready" is decided here once (`FleetView`), for every reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engined.engine import protocol as proto
from engined.supervisor.lifecycle.state import EngineState


@dataclass(frozen=True)
class LastExit:
    code: int | None
    signal: str | None
    reason: str
    at: float  # unix time
    description: str
    log_tail: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "signal": self.signal, "reason": self.reason, "at": self.at,
                "description": self.description, "log_tail": list(self.log_tail)}


@dataclass(frozen=True)
class EngineView:
    """One replica at one moment. Times are unix seconds unless named `*_mono`."""

    name: str
    group: str
    rank: int
    model: str
    gpus: tuple[int, ...]
    state: EngineState
    wanted: bool  # desired state is "run" (an operator did not stop it)
    pid: int | None  # the live child's pid
    incarnation: int
    restarts_by_reason: tuple[tuple[str, int], ...]
    since: float  # when it entered `state`
    spawned_at: float | None  # the current (or last) incarnation's spawn
    startup_s: float | None  # the last spawn -> READY
    heartbeat_at: float | None  # the current (or last) incarnation's last heartbeat, or READY
    heartbeat_age_s: float | None  # the live child's
    heartbeat: proto.Heartbeat | None  # the live child's last heartbeat
    ready: proto.Ready | None  # the current incarnation's READY
    phase: str
    restart_at: float | None  # a backoff's planned respawn
    fail_reason: str
    last_exit: LastExit | None
    last_cleanup: dict[str, float]
    cpu_seconds_exited: float  # earlier incarnations' CPU, so the counter never goes back
    requests: tuple[tuple[str, int], ...]  # outcome -> count, daemon-side
    data_parallel: bool
    port: int | None = None  # a command engine's port (its current or last incarnation's)
    command: bool = False  # a server engined did not write (probed, not heartbeating)
    launcher: str = ""  # what started the current (or last) incarnation, and why not forked
    standby: bool = False  # a warm spare of its group: not routed, not counted as serving
    adopted_at: float | None = None  # its process was handed over by an engined upgrade (unix)
    oom_exited: int = 0  # earlier incarnations' out-of-memory steps (the counter never goes back)
    desired: str = "run"  # run | stopped | asleep (on demand: a request wakes it)

    @property
    def oom_total(self) -> int:
        """Out-of-memory steps continued, every incarnation of this replica."""
        hb = self.heartbeat
        return self.oom_exited + (hb.oom_total if hb is not None else 0)

    @property
    def is_ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def asleep(self) -> bool:
        """Put to sleep (or going to sleep): not down, it wakes on the next request."""
        return self.desired == "asleep"

    @property
    def restarts(self) -> int:
        return sum(n for _, n in self.restarts_by_reason)

    def requests_of(self, outcome: str) -> int:
        return dict(self.requests).get(outcome, 0)

    def restarts_of(self, reason: str) -> int:
        return dict(self.restarts_by_reason).get(reason, 0)


@dataclass(frozen=True)
class FleetView:
    engines: tuple[EngineView, ...]
    stopping: bool = False  # engined is shutting down: not ready, whatever the engines

    def wanted(self) -> list[EngineView]:
        """The serving replicas that should run (standbys are counted apart: `standbys`)."""
        return [e for e in self.engines if e.wanted and not e.standby]

    def standbys(self) -> tuple[int, int]:
        """(READY standbys, standbys that should run)."""
        spares = [e for e in self.engines if e.wanted and e.standby]
        return sum(1 for e in spares if e.is_ready), len(spares)

    def counts(self) -> tuple[int, int]:
        """(READY engines, engines that should run)."""
        wanted = self.wanted()
        return sum(1 for e in wanted if e.is_ready), len(wanted)

    def groups(self) -> dict[str, list[EngineView]]:
        out: dict[str, list[EngineView]] = {}
        for engine in self.engines:
            out.setdefault(engine.group, []).append(engine)
        return out

    def health(self) -> tuple[int, dict[str, Any]]:
        """/health: 200 only when every engine that should run is READY."""
        ready, wanted = self.counts()
        status = "ok" if ready == wanted else ("down" if not ready else "degraded")
        body: dict[str, Any] = {"status": status,
                                "engines": {e.name: e.state.value for e in self.engines},
                                "ready": ready, "expected": wanted}
        spares_ready, spares = self.standbys()
        if spares:  # a standby still building leaves the fleet serving in full: not degraded
            body["standby"] = {"ready": spares_ready, "expected": spares}
        return (200 if status == "ok" else 503), body

    def readiness(self) -> tuple[int, dict[str, Any]]:
        """/readyz: 200 when every group that should serve has a READY replica or sleeps (a
        request wakes it); 503 when one has neither, when nothing should serve at all (every
        engine stopped), and from the moment engined begins to shut down (a SIGTERM: its drain
        runs behind a 503)."""
        if self.stopping:
            return 503, {"status": "shutting down", "groups": {}}
        groups = {group: any(e.is_ready or e.asleep for e in members
                             if (e.wanted or e.asleep) and not e.standby)
                  for group, members in self.groups().items()
                  if any((e.wanted or e.asleep) and not e.standby for e in members)}
        ok = bool(groups) and all(groups.values())
        status = "ready" if ok else ("not ready" if groups else "nothing to serve")
        return (200 if ok else 503), {"status": status, "groups": groups}
