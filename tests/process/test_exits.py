"""Exit detection by pidfd (supervisor.host.exits) on real processes: the status and CPU of a
child, and a child someone else reaped first, whose status is unknown, never a clean 0."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from engined.supervisor.host.exits import ExitStatus, watch_exit


def _spawn(code: str) -> int:
    return os.posix_spawn(sys.executable, [sys.executable, "-c", code], dict(os.environ))


def test_the_exit_status_and_cpu_of_a_child():
    async def main() -> None:
        pid = _spawn("import os, sys; sum(range(10**6)); sys.exit(3)")
        record = await asyncio.wait_for(watch_exit(asyncio.get_running_loop(), pid), 30)
        assert record.status == ExitStatus(code=3) and record.cpu_seconds > 0
        pid = _spawn("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
        record = await asyncio.wait_for(watch_exit(asyncio.get_running_loop(), pid), 30)
        assert record.status == ExitStatus(signal=signal.SIGKILL)
    asyncio.run(main())


def test_a_child_reaped_elsewhere_is_an_unknown_exit_not_a_clean_one():
    async def main() -> None:
        pid = _spawn("pass")  # exits 0
        future = watch_exit(asyncio.get_running_loop(), pid)
        assert os.waitpid(pid, 0)[0] == pid  # someone else takes its status first
        record = await asyncio.wait_for(future, 30)
        assert record.status is ExitStatus.UNKNOWN and not record.status.clean
        assert record.status.describe() == \
            "exit status unknown (not engined's child: adopted, or reaped elsewhere)"
    asyncio.run(main())
