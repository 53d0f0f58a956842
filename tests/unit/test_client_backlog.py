"""enginectl's connection waits for room in a full accept backlog (a burst of clients, a busy
daemon) instead of failing at once: a unix socket with a timeout answers EAGAIN immediately."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from engined.supervisor.ctl import client


def _fill(path: str) -> list[socket.socket]:
    """Connections until the backlog is full (the next non-blocking connect says EAGAIN)."""
    held = []
    for _ in range(64):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(path)
        except BlockingIOError:
            sock.close()
            return held
        held.append(sock)
    raise AssertionError("the backlog never filled")


def test_a_full_backlog_is_waited_for_until_there_is_room(tmp_path: Path):
    path = str(tmp_path / "s.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    held = _fill(path)
    accepted: list[socket.socket] = []

    def make_room() -> None:
        time.sleep(0.3)
        server.settimeout(5)
        accepted.append(server.accept()[0])  # one leaves the backlog: room for the client

    worker = threading.Thread(target=make_room)
    worker.start()
    conn = client.UnixHTTPConnection(path, timeout_s=10)
    try:
        conn.connect()  # before: BlockingIOError at once
        assert conn.sock is not None
    finally:
        worker.join()
        conn.close()
        for sock in held + accepted:
            sock.close()
        server.close()


def test_a_backlog_that_stays_full_still_fails_within_the_connect_timeout(tmp_path: Path,
                                                                          monkeypatch):
    monkeypatch.setattr(client, "CONNECT_TIMEOUT_S", 0.3)
    path = str(tmp_path / "s.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    held = _fill(path)
    conn = client.UnixHTTPConnection(path, timeout_s=10)
    try:
        with pytest.raises(BlockingIOError):
            conn.connect()
    finally:
        for sock in held:
            sock.close()
        server.close()
