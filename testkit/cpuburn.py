"""A busy machine on demand, for reproducing what only a loaded box shows.

`burning(n, max_s)` starts `n` processes that spin on a CPU each and kills them by pid when the
block ends; each also ends itself after `max_s`, so a burner can never outlive a crashed test by
long. From a shell (for running any test on a loaded box):

    python testkit/cpuburn.py N MAX_S     # prints the burners' pids, waits, kills them by pid
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

_SPIN = "import time\nend = time.monotonic() + {max_s}\nwhile time.monotonic() < end:\n    pass\n"


def start_burners(n: int, max_s: float) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", _SPIN.format(max_s=float(max_s))],
                             stdin=subprocess.DEVNULL) for _ in range(n)]


def stop_burners(burners: list[subprocess.Popen[bytes]]) -> None:
    for proc in burners:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
    for proc in burners:
        proc.wait(timeout=30)


@contextlib.contextmanager
def burning(n: int, max_s: float) -> Iterator[list[int]]:
    """`n` CPU burners for the block (at most `max_s` each); yields their pids."""
    burners = start_burners(n, max_s)
    try:
        yield [p.pid for p in burners]
    finally:
        stop_burners(burners)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    count, limit_s = int(sys.argv[1]), float(sys.argv[2])
    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` also kills the burners
    with burning(count, limit_s) as pids:
        print("burners:", *pids, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            time.sleep(limit_s)
