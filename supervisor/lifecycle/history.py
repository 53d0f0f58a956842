"""What a replica remembers across its incarnations: restarts by reason, request outcomes, the
last exit (with its log tail), the last cleanup report, the CPU of the dead; and what an exit or a
failed spawn is, told to the owner that decides (`Down`, `SpawnFailure`)."""

from __future__ import annotations

import collections
import dataclasses
import errno
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engined.engine.contract import CONFIG_LINE_PREFIX, EXIT_CONFIG
from engined.supervisor.host.exits import ExitRecord, ExitStatus
from engined.supervisor.host.oom import OomWitness
from engined.supervisor.lifecycle.clock import Clock
from engined.supervisor.lifecycle.incarnation import Incarnation
from engined.supervisor.lifecycle.policy import exit_reason
from engined.supervisor.lifecycle.state import Reason
from engined.supervisor.lifecycle.view import LastExit
from engined.supervisor.logs import LogSink

EXIT_TAIL_LINES = 40  # a fault report with its stack (fork-served engines have 5 frames more)


@dataclass(frozen=True)
class Down:
    """An exit for the owner to decide about."""

    reason: Reason
    status: ExitStatus
    at: float  # monotonic
    ready_since: float | None  # monotonic start of the READY run that just ended
    peer_stop: bool  # the owner stopped it (a peer failed): not a failure of its own
    pid: int
    description: str  # "killed by SIGKILL"
    config_error: str | None = None  # exit 78: the child's own words ("[config] ..." line)

    @property
    def headline(self) -> str:
        """For the owner's log line: an invalid config says what was invalid."""
        return f"exit 78: {self.config_error}" if self.config_error else self.description


@dataclass(frozen=True)
class SpawnFailure:
    """A child that could not be started at all (posix_spawn, pipe2 or pidfd_open failed, or
    engined held the spawn back to keep its file-descriptor reserve)."""

    errno: int | None
    description: str
    at: float  # monotonic


@dataclass
class History:
    log: LogSink
    restarts: collections.Counter[Reason] = field(default_factory=collections.Counter)
    requests: collections.Counter[str] = field(default_factory=collections.Counter)
    last_exit: LastExit | None = None
    startup_s: float | None = None
    cleanup: dict[str, float] = field(default_factory=dict)
    cpu_seconds_exited: float = 0.0
    oom_exited: int = 0  # out-of-memory steps of earlier incarnations (engine.memory)

    def restore(self, restarts: Mapping[Reason, int], requests: Mapping[str, int],
                last_exit: LastExit | None, startup_s: float | None,
                cpu_seconds_exited: float, oom_exited: int) -> None:
        """The record an earlier engined kept (supervisor.upgrade's hand-over and adoption)."""
        self.restarts.update(restarts)
        self.requests.update(requests)
        if last_exit is not None:
            self.last_exit = last_exit
        self.startup_s, self.cpu_seconds_exited = startup_s, cpu_seconds_exited
        self.oom_exited = oom_exited

    def view_fields(self) -> dict[str, Any]:
        return {"restarts_by_reason": tuple((r.value, n) for r, n in self.restarts.items()),
                "startup_s": self.startup_s, "last_exit": self.last_exit,
                "last_cleanup": dict(self.cleanup),
                "cpu_seconds_exited": self.cpu_seconds_exited, "oom_exited": self.oom_exited,
                "requests": tuple(self.requests.items())}

    def exited(self, inc: Incarnation, record: ExitRecord, killed_for: Reason | None,
               requested: bool, oom: OomWitness | None) -> Down:
        """An incarnation's exit: noted in the log, its CPU kept; what the owner is told."""
        assert inc.child is not None
        status, pid = record.status, inc.child.pid
        self.cpu_seconds_exited += record.cpu_seconds
        last = inc.vitals.heartbeat if inc.vitals is not None else None
        self.oom_exited += last.oom_total if last is not None else 0
        expected = requested or killed_for is not None
        oom_kill = (not expected and status.signal == signal.SIGKILL and oom is not None
                    and oom.killed(pid))
        self.log.note(f"pid {pid} exited: {status.describe(oom_kill)}")
        config_error = self._config_error(inc.log_mark) if status.code == EXIT_CONFIG else None
        ready_since = inc.vitals.ready_at if inc.vitals is not None else None
        return Down(exit_reason(status, killed_for), status, record.at_monotonic, ready_since,
                    False, pid, status.describe(oom_kill), config_error)

    def record_exit(self, inc: Incarnation, record: ExitRecord, reason: Reason,
                    description: str) -> None:
        status = record.status
        self.last_exit = LastExit(status.code, status.signal_name, reason.value, record.at_wall,
                                  description,
                                  tuple(self.log.tail_since(inc.log_mark, EXIT_TAIL_LINES)))

    def relabel(self, reason: Reason) -> None:
        """The last exit counts as `reason` after all (a rank that failed after its peer)."""
        last = self.last_exit
        if last is not None and last.reason != reason.value:
            self.last_exit = dataclasses.replace(last, reason=reason.value)

    def spawn_failed(self, exc: OSError, clock: Clock) -> SpawnFailure:
        code = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno else "?"
        text = f"cannot start: {exc.strerror or exc} ({code})"
        if exc.filename:
            text += f": {exc.filename}"
        self.last_exit = LastExit(None, None, Reason.SPAWN_ERROR.value, clock.wall(), text, ())
        self.log.note(text)
        return SpawnFailure(exc.errno, text, clock.monotonic())

    def _config_error(self, mark: int) -> str | None:
        """The reason an exit-78 child printed (its last `[config] ...` line), if any."""
        for line in reversed(self.log.tail_since(mark, EXIT_TAIL_LINES * 5)):
            if line.startswith(CONFIG_LINE_PREFIX):
                return line[len(CONFIG_LINE_PREFIX):].strip()
        return None
