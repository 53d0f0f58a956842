"""sd_notify for Type=notify: READY, STATUS, WATCHDOG, RELOADING and STOPPING.

A datagram to $NOTIFY_SOCKET (a path, or `@name` for the abstract namespace). Without
NOTIFY_SOCKET every call is a no-op, so the daemon runs the same under systemd and in a terminal.
The launcher strips NOTIFY_SOCKET and WATCHDOG_* from children's environments.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Callable, Mapping

log = logging.getLogger("engined.systemd")


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.address = _address(env.get("NOTIFY_SOCKET", ""))
        self.watchdog_s = _watchdog_interval(env)
        self.last_status = ""
        self._sock: socket.socket | None = None
        if self.address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *fields: str) -> None:
        if self._sock is None or self.address is None:
            return
        try:
            self._sock.sendto("\n".join(fields).encode(), self.address)
        except OSError as exc:  # systemd gone or socket full: never fatal to the fleet
            log.debug("[systemd] notify failed: %s", exc)

    def ready(self, status: str) -> None:
        self.last_status = status
        self.notify("READY=1", f"STATUS={status}")

    def status(self, text: str) -> None:
        if text != self.last_status:
            self.last_status = text
            self.notify(f"STATUS={text}")

    def reloading(self) -> None:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}", "STATUS=reloading")

    def stopping(self) -> None:
        self.notify("STOPPING=1", "STATUS=stopping engines")

    async def watchdog(self, healthy: Callable[[], bool]) -> None:
        """WATCHDOG=1 at half of WATCHDOG_USEC, from the event loop and only while it is healthy:
        a blocked loop sends nothing, so systemd restarts us."""
        if self.watchdog_s is None or self._sock is None:
            return
        while True:
            if healthy():
                self.notify("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_s / 2)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _address(value: str) -> str | bytes | None:
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()  # abstract namespace
    return value


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """WATCHDOG_USEC in seconds, if it is meant for us (WATCHDOG_PID absent or our pid)."""
    usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1e6 if value > 0 else None
