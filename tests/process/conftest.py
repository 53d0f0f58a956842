"""Fixtures of the process tier: the sockets an engine child talks to, and its processes."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.enginechild import Channels


@pytest.fixture
def channels() -> Iterator[Channels]:
    root = Path(tempfile.mkdtemp(prefix="ec", dir="/tmp"))  # ipc:// paths must stay short
    chans = Channels(root)
    yield chans
    chans.close()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:  # by pid, only what this test started
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


