"""Process level: the fork server (`python -m engined.engine.forkserver`) on its own channel, the
test standing in for the daemon: its handshake, what it refuses, when it will not fork."""

from __future__ import annotations

import array
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engined.engine import contract
from engined.engine.forkserver import CHANNEL_FD, device_fds, tasks, unsafe
from testkit.enginechild import REPO_ROOT, _env

TIMEOUT_S = 60.0


class Server:
    def __init__(self, *preload: str, env: dict[str, str] | None = None) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        full = {**_env(Path("/nonexistent")), contract.ENV_PARENT_PID: str(os.getpid()),
                **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-c",
             f"import os; os.dup2({theirs.fileno()}, {CHANNEL_FD}); import "
             "runpy; runpy.run_module('engined.engine.forkserver', run_name='__main__')",
             *preload], cwd=REPO_ROOT, env=full, pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        theirs.close()
        self.channel = ours
        ours.settimeout(TIMEOUT_S)

    def receive(self) -> dict:
        return json.loads(self.channel.recv(1 << 20))

    def send(self, data: bytes, fds: list[int] = ()) -> None:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        self.channel.sendmsg([data], ancillary)

    def close(self) -> int:
        self.channel.close()
        try:
            return self.proc.wait(TIMEOUT_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:  # by pid, only what this test started
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(timeout=10)


def test_handshake_then_malformed_requests_are_refused_and_eof_ends_it(servers):
    server = Server()
    servers.append(server)
    ready = server.receive()
    assert ready["ready"] is True and ready["pid"] == server.proc.pid, ready
    assert ready["preloaded"] == [] and ready["tasks"] >= 1, ready
    server.send(b"{not json")  # and no descriptor either
    assert server.receive() == {"error": "malformed spawn request"}
    r, w = os.pipe()
    try:
        for bad in (b"[1, 2]", b'{"env": {}}', b'{"env": {"ENGINED_CONFIG": 1}}'):
            server.send(bad, [w])  # JSON, but no engine to fork: refused before any fork
            assert server.receive() == {"error": "malformed spawn request"}, bad
    finally:
        os.close(r)
        os.close(w)
    assert server.proc.poll() is None  # refusing a request does not end the server
    assert server.close() == 0  # EOF: the daemon is done with it


def test_a_preload_that_fails_is_reported_then_78(servers):
    server = Server("no_such_module_for_engined")
    servers.append(server)
    message = server.receive()
    assert "no_such_module_for_engined" in message["error"], message
    assert server.proc.wait(TIMEOUT_S) == contract.EXIT_CONFIG


def test_a_thread_started_after_preloading_makes_it_refuse_to_fork_and_exit(servers):
    server = Server(env={"ENGINED_FAULT_FORKSERVER_THREAD": "1"})
    servers.append(server)
    assert server.receive()["ready"] is True
    r, w = os.pipe()
    try:
        server.send(json.dumps({"env": {contract.ENV_CONFIG: "{}"}, "name": "x"}).encode(), [w])
        reply = server.receive()
    finally:
        os.close(r)
        os.close(w)
    assert reply["error"].startswith("unsafe: ") and "thread" in reply["error"], reply
    assert server.proc.wait(TIMEOUT_S) == contract.EXIT_FAILURE


def test_the_checks_see_native_tasks_and_device_descriptors():
    before = tasks()
    assert unsafe(before) is None
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while tasks() == before and time.monotonic() < deadline:
            time.sleep(0.01)
        why = unsafe(before)
        assert why is not None and "1 thread(s)" in why, why
    finally:
        stop.set()
        thread.join()
    with open(os.devnull) as held:  # a stand-in for /dev/nvidia0: the check is by path prefix
        assert os.devnull in device_fds(os.devnull)
        why = unsafe(tasks(), prefix=os.devnull)
        assert why is not None and "GPU devices open" in why and str(held.name) in why
    assert device_fds() == []  # this machine's test process holds no GPU device
