"""Leftovers and samples are found among engined's descendants only (host.reaper.descendants):
a grandchild that left its parent's session is still found, an unrelated process is not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from engined.supervisor.host.reaper import descendants
from engined.supervisor.observe.sampler import sample_trees

# a child that starts a grandchild in a session of its own, prints its pid, then waits
SCRIPT = ("import subprocess, sys, time\n"
          "p = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
          "print(p.pid, flush=True)\n"
          "time.sleep(60)\n")


def test_descendants_cross_sessions_and_skip_strangers() -> None:
    child = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    stranger = subprocess.Popen(["sleep", "60"])
    assert child.stdout is not None
    grandchild = int(child.stdout.readline())
    try:
        found = descendants(child.pid)
        assert found == {grandchild}, found
        assert {child.pid, grandchild, stranger.pid} <= descendants(os.getpid())
        tree = sample_trees([child.pid])[child.pid]
        assert tree.pids == {child.pid, grandchild} and tree.rss_bytes > 0, tree
    finally:
        for pid in (grandchild, child.pid, stranger.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        child.wait()
        stranger.wait()
        deadline = time.monotonic() + 10  # the grandchild is init's (or a subreaper's) now
        while time.monotonic() < deadline and os.path.exists(f"/proc/{grandchild}/stat"):
            with open(f"/proc/{grandchild}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.05)
