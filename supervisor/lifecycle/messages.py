"""What a replica's processes say, applied to the replica: heartbeats, loading progress, READY
and the cleanup report, by the address (engine, incarnation) each message carries. A message of
another incarnation changes nothing; one that comes before its spawn returned waits with it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from engined.engine import protocol as proto
from engined.supervisor.lifecycle.history import History
from engined.supervisor.lifecycle.state import EngineState

if TYPE_CHECKING:
    import asyncio

    from engined.supervisor.lifecycle.clock import Clock
    from engined.supervisor.lifecycle.incarnation import Incarnation

log = logging.getLogger("engined.engine")


class Receiver(Protocol):
    """What of a replica its messages read and change (supervisor.lifecycle.replica)."""

    state: EngineState
    incarnation: int
    current: Incarnation | None
    history: History
    clock: Clock

    @property
    def name(self) -> str: ...

    @property
    def wakeup(self) -> asyncio.Event: ...

    def knows(self, address: tuple[str, int]) -> bool: ...

    def reattached(self) -> None: ...

    def set_state(self, new: EngineState) -> None: ...


def deliver(replica: Receiver, msg: proto.ChildMessage) -> bool:
    """Apply a message from the child; False if it is from another incarnation."""
    inc, address = replica.current, (msg.engine, msg.incarnation)
    if inc is not None and not inc.attached and address == inc.address:
        inc.early.append(msg)  # its spawn has not returned yet
        return True
    if isinstance(msg, proto.Goodbye) and replica.knows(address):
        # A cleanup report may arrive after an immediate restart already began: it changes no
        # state, so keep it (with its incarnation) rather than drop it as stale.
        replica.history.cleanup = {**msg.cleanup, "incarnation": float(msg.incarnation)}
        return True
    if inc is None or address != inc.address or inc.vitals is None or not inc.alive:
        return False
    now = replica.clock.monotonic()
    if isinstance(msg, proto.Heartbeat):
        if replica.state is EngineState.STARTING and inc.adopted_at is not None:
            replica.reattached()  # adopted loading: it heartbeats only once past its READY
        if inc.on_heartbeat(msg, now):  # work began: the stall deadline may now come first
            replica.wakeup.set()
        # Otherwise a heartbeat only moves deadlines later: the watcher re-checks at the old
        # deadline with fresh data, and a fleet of idle engines costs no wake-ups.
    elif isinstance(msg, proto.Ready):
        if inc.reattaching:  # a command engine's first passing probe after an upgrade
            replica.reattached()
        elif replica.state is EngineState.STARTING:
            replica.history.startup_s = inc.on_ready(msg, now)
            replica.set_state(EngineState.READY)
            log.info("[ready] %s pid %s incarnation %d in %.3fs (device %s)", replica.name,
                     inc.pid, replica.incarnation, replica.history.startup_s, msg.device)
            replica.wakeup.set()
    elif isinstance(msg, proto.Progress):
        inc.on_progress(msg, now, replica.state is EngineState.STARTING)
    return True
