"""`python -m engined.supervisor.guard DAEMON_PID`: outlives a SIGKILLed engined and kills every
process that carries its mark (see engined.supervisor.reaper).

It blocks on stdin (a pipe whose write end only the daemon holds). EOF comes when the daemon
exits for any reason: a clean shutdown has stopped every engine already, so nothing is found; a
SIGKILLed daemon leaves engines (which PR_SET_PDEATHSIG kills) and their descendants that left the
engine's process group (which nothing else would kill). It kills until none is left, then exits.
It imports only the standard library and the contract module: it starts in milliseconds.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from engined.engine.contract import ENV_OWNER  # the contract is standard library only

ROUNDS = 50  # a killed parent's children may still be forking for a moment
ROUND_S = 0.1


def _mark(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    key = ENV_OWNER.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(key):
            return item[len(key):].decode(errors="replace")
    return None


def marked_processes(prefix: str) -> list[int]:
    """Live pids whose ENGINED_OWNER mark equals `prefix`, or starts with it when it ends in
    '/' (every process of one daemon)."""
    own, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == own:
            continue
        mark = _mark(int(entry))
        if mark is not None and (mark == prefix or (prefix.endswith("/")
                                                    and mark.startswith(prefix))):
            out.append(int(entry))
    return out


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    daemon = argv[1]
    while os.read(0, 4096):
        pass  # the daemon writes nothing; any data would be ignored
    prefix = f"{daemon}/"
    killed: set[int] = set()
    for _ in range(ROUNDS):
        found = marked_processes(prefix)
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(ROUND_S)
    if killed:
        print(f"engined guard: daemon {daemon} is gone; killed {len(killed)} leftover "
              f"process(es): {sorted(killed)}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
