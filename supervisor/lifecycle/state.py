"""Engine lifecycle states, the only transitions allowed between them, and the reasons an engine
(re)starts or goes down."""

from __future__ import annotations

import enum


class EngineState(enum.Enum):
    STOPPED = "STOPPED"
    STARTING = "STARTING"
    READY = "READY"
    STOPPING = "STOPPING"
    BACKOFF = "BACKOFF"
    FAILED = "FAILED"
    ASLEEP = "ASLEEP"  # on demand: no process, not down; the next request (or `wake`) starts it


class Reason(enum.Enum):
    """Why an engine (re)started or went down; used in metrics, status and logs."""

    EXIT = "exit"
    SIGNAL = "signal"
    HANG = "hang"
    STALL = "stall"
    MEMORY = "memory"  # held more than its memory_limit (engine.memory)
    CANARY = "canary"  # did not answer a one-token request sent while idle (probe.Prober)
    STARTUP_TIMEOUT = "startup_timeout"
    GROUP = "group"
    MANUAL = "manual"
    RELOAD = "reload"
    SPAWN_ERROR = "spawn_error"  # the child could not be started at all


class IllegalTransition(RuntimeError):
    def __init__(self, old: EngineState, new: EngineState) -> None:
        super().__init__(f"illegal engine state transition {old.value} -> {new.value}")
        self.old, self.new = old, new


_S = EngineState
# STARTING/READY -> STOPPED/BACKOFF/FAILED directly: the child exited by itself (crash, exit 78).
# STOPPING -> STOPPED/BACKOFF/FAILED: we killed it (stop, hang, stall, startup timeout, group).
# -> ASLEEP wherever a stop may end: a sleep is a stop that the next request undoes.
TRANSITIONS: dict[EngineState, frozenset[EngineState]] = {
    # STOPPED/FAILED -> BACKOFF/FAILED: a start whose child could not be spawned at all.
    _S.STOPPED: frozenset({_S.STARTING, _S.BACKOFF, _S.FAILED, _S.ASLEEP}),
    _S.STARTING: frozenset({_S.READY, _S.STOPPING, _S.BACKOFF, _S.FAILED, _S.STOPPED, _S.STARTING,
                            _S.ASLEEP}),
    _S.READY: frozenset({_S.STOPPING, _S.BACKOFF, _S.FAILED, _S.STOPPED, _S.STARTING, _S.ASLEEP}),
    _S.STOPPING: frozenset({_S.STOPPED, _S.BACKOFF, _S.FAILED, _S.STARTING, _S.ASLEEP}),
    _S.BACKOFF: frozenset({_S.STARTING, _S.STOPPED, _S.FAILED, _S.ASLEEP}),
    _S.FAILED: frozenset({_S.STARTING, _S.STOPPED, _S.BACKOFF, _S.ASLEEP}),
    # a wake spawns (STARTING), or could not (BACKOFF, FAILED); `stop` parks it. Asleep in
    # place (vLLM's sleep mode, the process kept): woken (READY), stopped (STOPPING), or its
    # process died (ASLEEP, no process: the next wake spawns)
    _S.ASLEEP: frozenset({_S.STARTING, _S.STOPPED, _S.BACKOFF, _S.FAILED, _S.READY,
                          _S.STOPPING}),
}


def check_transition(old: EngineState, new: EngineState) -> EngineState:
    """Return `new` if old -> new is allowed, else raise IllegalTransition naming both."""
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(old, new)
    return new
