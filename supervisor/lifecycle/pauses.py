"""The daemon's own pauses, as the liveness policy reads them (supervisor.lifecycle.policy) and
the loop monitor records them (supervisor.lifecycle.loopmonitor)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pauses:
    """Spans of monotonic time in which the daemon itself did not run (its event loop was
    blocked, or the process frozen: SIGSTOP, a VM pause, a swap storm, a debugger). Heartbeats
    that arrived meanwhile sat unread in the kernel: nothing that happened (or did not) in a
    pause may count against an engine."""

    spans: tuple[tuple[float, float], ...] = ()

    def after(self, t: float) -> float:
        """Seconds of pause since `t`: how far a deadline measured from `t` moves back."""
        return sum(end - max(start, t) for start, end in self.spans if end > t)

    def add(self, start: float, end: float, keep: int = 256) -> Pauses:
        return Pauses((*self.spans, (start, end))[-keep:])


NO_PAUSES = Pauses()
