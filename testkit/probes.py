"""Helpers only tests use, kept out of testkit/driver.py on purpose: the benchmarks are made of
driver.py (bench/stale.py walks their imports), so a helper added there makes every committed
result stale although nothing a benchmark does changed."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

import psutil

from testkit.driver import Daemon, free_port


def http_text(method: str, url: str, body: Any = None,
              timeout_s: float = 30.0) -> tuple[int, str]:
    """One request with a JSON body over TCP: (status, the answer's text), errors included."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def free_port_range(count: int) -> int:
    """A base port with `count` free loopback ports from it (supervisor.replica_ports)."""
    for _ in range(50):
        base = free_port()
        if base + count > 65535:
            continue
        held = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                held.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError("no free range of loopback ports")


def spawned_tree(daemon: Daemon) -> set[int]:
    """Every engine pid `daemon` spawned and their live descendants (a test that SIGKILLs the
    daemon kills these by pid)."""
    tree = daemon.spawned_pids()
    for pid in list(tree):
        try:
            tree |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    return tree
