"""The floor: a minimal pidfd-based asyncio supervisor, the baseline engined is measured against.

`python -m bench.core.floor [N] [ARGV...]` keeps N copies of ARGV alive (default: a sleeping Python
interpreter, exec'd like engined execs its engines; children's stdio is /dev/null). Each exit is
seen through a pidfd registered with the event loop; the child is reaped and respawned at once.
Written to stdout, one write per line:
  spawn <pid> <unix time>   (after posix_spawn returned)
  exit <pid> <unix time>    (time.time() taken first thing in the pidfd callback)
  ready                     (all N children spawned)
SIGTERM/SIGINT: SIGKILL and reap the children, exit 0.
"""

import asyncio
import os
import signal
import sys
import time

SLEEPER = [sys.executable, "-c", "import time; time.sleep(1e9)"]
DEVNULL = [(os.POSIX_SPAWN_OPEN, fd, "/dev/null", os.O_RDWR, 0) for fd in (0, 1, 2)]


async def supervise(n: int, argv: list[str]) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    children: dict[int, int] = {}  # pid -> pidfd

    def out(line: str) -> None:
        os.write(1, (line + "\n").encode())

    def spawn() -> None:
        pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=DEVNULL)
        t = time.time()
        children[pid] = fd = os.pidfd_open(pid)
        loop.add_reader(fd, on_exit, pid, fd)
        out(f"spawn {pid} {t:.6f}")

    def on_exit(pid: int, fd: int) -> None:
        t = time.time()
        loop.remove_reader(fd)
        os.close(fd)
        del children[pid]
        os.waitpid(pid, 0)
        if not stop.is_set():
            spawn()  # respawn first, report after
        out(f"exit {pid} {t:.6f}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    for _ in range(n):
        spawn()
    out("ready")
    await stop.wait()
    for pid, fd in list(children.items()):
        loop.remove_reader(fd)
        os.close(fd)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    asyncio.run(supervise(int(sys.argv[1]) if len(sys.argv) > 1 else 1, sys.argv[2:] or SLEEPER))
