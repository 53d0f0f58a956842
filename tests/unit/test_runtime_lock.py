"""The runtime lock: one daemon per runtime directory, no lock file left after a clean exit, and
no window where two daemons both believe they hold it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engined.supervisor.host import runtime
from engined.supervisor.host.runtime import RuntimeLock, StartupError


def test_held_lock_refuses_a_second_daemon_and_a_clean_release_removes_the_file(
        tmp_path: Path) -> None:
    first, second = RuntimeLock(tmp_path), RuntimeLock(tmp_path)
    first.acquire()
    assert first.path.read_text().strip() == str(os.getpid())
    with pytest.raises(StartupError, match=f"another engined \\(pid {os.getpid()}\\)"):
        second.acquire()
    first.release(unlink=True)
    assert not first.path.exists()  # a clean exit leaves no lock file
    second.acquire()  # and the next daemon starts as if none had been there
    assert second.path.exists()
    second.release()
    assert second.path.exists()  # an unclean exit (no unlink): the next one reuses the file


def test_a_lock_won_on_a_file_just_unlinked_is_stale_and_taken_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race the unlink opens: B opens the file, A (holding it) unlinks and releases, B's
    flock then succeeds on a file no longer at the path. B must notice and lock the new file."""
    holder = RuntimeLock(tmp_path)
    holder.acquire()
    real_open = os.open
    opened: list[int] = []

    def open_then_holder_leaves(path, flags, mode=0o777):
        fd = real_open(path, flags, mode)
        if not opened:  # the first open: the holder exits cleanly right now
            holder.release(unlink=True)
        opened.append(fd)
        return fd

    monkeypatch.setattr(runtime.os, "open", open_then_holder_leaves)
    late = RuntimeLock(tmp_path)
    late.acquire()
    assert len(opened) == 2  # the stale file was let go, the one at the path locked
    assert os.fstat(late.fd).st_ino == os.stat(late.path).st_ino
    late.release(unlink=True)
