"""A busy machine is no reason to restart anything: two CPU hogs for ~30 s beside a fleet under
traffic (the situation that once got a healthy engine killed as stalled in a CI soak)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from testkit.driver import http_request

pytestmark = [pytest.mark.soak, pytest.mark.timeout(600)]

HOG_S = 30.0
SUPERVISOR = {"heartbeat_interval": "0.5s", "heartbeat_timeout": "5s"}


def test_two_cpu_hogs_beside_a_fleet_under_traffic_restart_nothing(engined, tiny_cache):
    d = engined([{"name": "echo", "replicas": 4, "model": "builtin:echo",
                  "env": {"ENGINED_ECHO_TOKEN_MS": "2"}},
                 {"name": "tiny", "model": "builtin:tiny-llama", "stall_timeout": "10s",
                  "env": {"ENGINED_CACHE_DIR": str(tiny_cache)}}],
                supervisor=SUPERVISOR, ready=False)
    d.wait_all_ready(timeout_s=180)
    before = {n: (e["pid"], e["incarnation"]) for n, e in d.engines().items()}
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    answers: list[int] = []
    stop = threading.Event()

    def traffic(engine: str) -> None:
        while not stop.is_set():
            body = json.dumps({"prompt": "busy machine", "engine": engine,
                               "max_tokens": 8}).encode()
            code, _, _ = http_request(d.socket, "POST", "/v1/generate", body,
                                      {"Content-Type": "application/json"}, timeout_s=120)
            answers.append(code)
            time.sleep(0.05)

    workers = [threading.Thread(target=traffic, args=(e,), daemon=True)
               for e in ("echo", "tiny")]
    try:
        for w in workers:
            w.start()
        d.holds(lambda: all(e["state"] == "READY" for e in d.engines().values()), HOG_S,
                "every engine READY under load")
    finally:
        stop.set()
        for hog in hogs:
            hog.kill()
            hog.wait()
        for w in workers:
            w.join(timeout=180)
    after = {n: (e["pid"], e["incarnation"]) for n, e in d.engines().items()}
    assert after == before
    assert all(e["restarts"] == 0 for e in d.engines().values())
    assert answers and set(answers) == {200}, answers
