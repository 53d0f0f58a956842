"""Process checks for the fault-injection tier."""

from __future__ import annotations

import psutil


def fleet_processes(daemon_pid: int) -> list[int]:
    """Every live (non-zombie) process on the host that was spawned as an engine of `daemon_pid`,
    found by its environment, so a child the daemon never got to log is found too."""
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get("ENGINED_PARENT_PID") == str(daemon_pid):
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return sorted(found)
