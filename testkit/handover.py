"""What the hand-over tests share (tests/e2e/test_upgrade.py, test_recovery.py): a fleet of
every kind of engine, gateway clients that record every outcome, an engine's identity, a
metric's value."""

from __future__ import annotations

import threading
import time
import urllib.request
from typing import Any

import openai
import psutil

from testkit.driver import PYTHON, REPO_ROOT

SERVER = str(REPO_ROOT / "testkit" / "commandserver.py")
SLOW = {"ENGINED_ECHO_TOKEN_MS": "15"}
FLEET = [
    {"name": "echo", "replicas": 2, "standby": 1, "model": "builtin:echo", "env": SLOW},
    {"name": "ex", "replicas": 1, "model": "builtin:echo", "launcher": "exec", "env": SLOW},
    {"name": "web", "command": [PYTHON, SERVER, "--port", "{port}"], "port": "auto",
     "probe": {"interval": "200ms", "timeout": "300ms", "failures": 3}},
    {"name": "bad", "model": "builtin:echo", "env": {"ENGINED_ECHO_FAIL": "build"},
     "backoff": {"initial": "0s"}, "start_limit": {"burst": 1, "interval": "60s"}},
]
TEXT = "the quick brown fox jumps over the lazy dog"


def identity(d) -> dict[str, tuple[int, float, int, int]]:
    """Per engine: (pid, the process's start time, incarnation, restarts)."""
    out = {}
    for name, e in d.engines().items():
        if e["pid"] is not None:
            out[name] = (e["pid"], psutil.Process(e["pid"]).create_time(), e["incarnation"],
                         e["restarts"])
    return out


class Clients:
    """Gateway clients in threads, streamed and not, until stopped: every outcome kept."""

    def __init__(self, port: int, threads: int) -> None:
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                    max_retries=0, timeout=60)
        self.stop = threading.Event()
        self.ok = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True)
                        for i in range(threads)]

    def run(self, i: int) -> None:
        while not self.stop.is_set():
            try:
                if i % 2:
                    text = "".join(c.choices[0].text for c in self.client.completions.create(
                        model="echo", prompt=TEXT, max_tokens=30, stream=True) if c.choices)
                else:
                    text = self.client.completions.create(
                        model="echo", prompt=TEXT, max_tokens=30).choices[0].text
                assert text == TEXT[:30], text
                with self.lock:
                    self.ok += 1
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                with self.lock:
                    self.errors.append(f"{exc!r} ({exc.__cause__!r}, {time.time():.3f})")

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))
