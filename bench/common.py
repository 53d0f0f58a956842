"""What the benchmarks share: errors and waits, process tracking and cleanup by pid, the engined
daemon (testkit/driver.py's `Daemon` with what a benchmark adds), clients of its control socket and
the benchmarks' HTTP load generator. How they report is bench/report.py.

The daemon driver is the tests' own, `testkit.driver`. What the benchmarks use of engined's
supervisor internals is imported here and nowhere else (HTTP over the control socket, the engine
channels, how the launcher builds an engine child's environment, the spec's source), so that it is
repointed in one place when they move. Nothing here kills by name: every process is tracked by pid
(psutil handles, which guard against pid reuse) and stopped by pid.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import psutil

# engined's supervisor internals, imported here only (`as`: re-exported to the benchmarks)
from engined.supervisor.client import UnixHTTPConnection as UnixHTTPConnection
from engined.supervisor.host.launcher import child_environment as child_environment
from engined.supervisor.host.launcher import expose_engine_package as expose_engine_package
from engined.supervisor.ipc import EngineChannels as EngineChannels
from engined.supervisor.spec import resolve
from testkit.driver import Daemon, build_spec, is_engine_of

ROOT = Path(__file__).resolve().parent.parent
# the checkout the engined under test is imported from: ROOT, unless bench/ runs from another
# worktree than the one engined is installed (editable) from
ENGINED_SOURCE = Path(resolve.__file__).resolve().parents[2]
T = TypeVar("T")


# --- errors and waits ---------------------------------------------------------------------------
class BenchError(Exception):
    pass


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str,
               interval_s: float = 0.005) -> T:
    """Poll `predicate` until truthy (returned) or the deadline (BenchError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise BenchError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(interval_s)


# --- processes ----------------------------------------------------------------------------------
def without_engined_vars(env: Mapping[str, str] | None = None, *drop: str) -> dict[str, str]:
    """`env` (default os.environ) minus every ENGINED_* variable, NOTIFY_SOCKET and `drop`."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items()
            if not k.startswith("ENGINED_") and k != "NOTIFY_SOCKET" and k not in drop}


def read_children(pid: int) -> set[int]:
    """Children of `pid` spawned by its main thread, from /proc/PID/task/PID/children.

    One open+read (a few microseconds); the kernel keeps this list, so a new child shows up the
    moment clone() returns in the parent. Both supervisors spawn from their main (event-loop)
    thread. psutil's children() scans all of /proc instead, so it is only the fallback.
    """
    try:
        fd = os.open(f"/proc/{pid}/task/{pid}/children", os.O_RDONLY)
    except FileNotFoundError:
        return {p.pid for p in psutil.Process(pid).children()}
    try:
        return {int(x) for x in os.read(fd, 65536).split()}
    finally:
        os.close(fd)


GUARD_MODULE = "engined.supervisor.host.guard"
FORK_SERVER_TITLE = "engined: fork server"  # engined.engine.contract's


def engine_processes(daemon: psutil.Process) -> list[psutil.Process]:
    """The daemon's engine children: its children without the guard (the one process that
    watches for the daemon's own death) and the fork servers."""
    found = []
    for child in daemon.children():
        try:
            cmdline = child.cmdline()
            if GUARD_MODULE not in cmdline and not " ".join(cmdline).startswith(
                    FORK_SERVER_TITLE) and "engined.engine.forkserver" not in cmdline:
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def cpu_s(proc: psutil.Process) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    t = proc.cpu_times()
    return t.user + t.system


def terminate(proc: subprocess.Popen | None, timeout_s: float,
              sig: int | None = signal.SIGTERM) -> bool:
    """Send `sig` (None: the caller already asked it to stop), wait up to `timeout_s`, SIGKILL
    if it is still there. True if it had to be killed."""
    if proc is None or proc.poll() is not None:
        return False
    if sig is not None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout_s)
        return False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return True


class Tracker:
    """Every process we started (psutil handles guard against pid reuse); killed by pid at exit."""

    def __init__(self) -> None:
        self.procs: dict[int, psutil.Process] = {}

    def add(self, pid: int | None) -> None:
        if pid and pid not in self.procs:
            try:
                self.procs[pid] = psutil.Process(pid)
            except psutil.Error:
                pass

    def kill_leftovers(self) -> list[int]:
        killed = []
        for pid, proc in self.procs.items():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    proc.kill()
                    killed.append(pid)
            except psutil.Error:
                pass
        return killed


class Cleanup:
    """What a benchmark run started, undone in one place (also when it fails half-way).

    `close()`: stop every started thing, newest first (and remove its directory, if it has
    one), SIGKILL by pid whatever the tracker saw that is still alive, run the closers, remove
    the scratch directories.
    """

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.started: list[Any] = []
        self.closers: list[Callable[[], None]] = []
        self.dirs: list[Path] = []

    def start(self, thing: T, *args: Any, **kwargs: Any) -> T:
        self.started.append(thing)
        thing.start(*args, **kwargs)  # type: ignore[attr-defined]
        return thing

    def stop(self, thing: Any, *args: Any, **kwargs: Any) -> Any:
        """Stop one started thing now, and remove its directory if it has one."""
        result = thing.stop(*args, **kwargs)
        self.started.remove(thing)
        if hasattr(thing, "remove_dir"):
            thing.remove_dir()
        return result

    def scratch(self, prefix: str) -> Path:
        """A short scratch directory under /tmp (ZeroMQ ipc:// paths must stay short)."""
        path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        self.dirs.append(path)
        return path

    def close(self) -> list[int]:
        """Returns the pids the tracker had to SIGKILL (after the things' own stops)."""
        for thing in reversed(self.started):
            try:
                thing.stop()
                if hasattr(thing, "remove_dir"):
                    thing.remove_dir()
            except Exception as exc:  # noqa: BLE001 - cleanup must go on
                print(f"cleanup: {exc}", file=sys.stderr)
        self.started.clear()
        killed = self.tracker.kill_leftovers()
        for close in self.closers:
            try:
                close()
            except Exception as exc:  # noqa: BLE001
                print(f"cleanup: {exc}", file=sys.stderr)
        for path in self.dirs:
            shutil.rmtree(path, ignore_errors=True)
        return killed


# --- engined ------------------------------------------------------------------------------------
# Every restart immediate: no backoff delay, the failure streak resets at once, never FAILED.
IMMEDIATE_RESTARTS = {
    "restart": "always",
    "backoff": {"initial": "0s", "max": "0s", "factor": 1.0, "jitter": 0, "reset_after": "0s"},
    "start_limit": {"burst": 1000000, "interval": "1s"},
    "stop_timeout": "10s",
}
HEARTBEATS = {"heartbeat_interval": "1s", "heartbeat_timeout": "10s"}


def spec_has_key(key: str) -> bool:
    """Whether this engined's spec knows `key` (one still being built may not): its resolver's
    source names it."""
    return f'"{key}"' in Path(resolve.__file__).read_text()


class KeepAlive:
    """One keep-alive HTTP connection to the control socket; reconnects once if it went away."""

    def __init__(self, socket_path: str, timeout_s: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.conn: UnixHTTPConnection | None = None

    def round_trip(self, method: str, path: str, body: bytes | None = None,
                   headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        for attempt in range(2):
            if self.conn is None:
                self.conn = UnixHTTPConnection(self.socket_path, self.timeout_s)
            try:
                self.conn.request(method, path, body, headers or {})
                response = self.conn.getresponse()
                return response.status, response.read()
            except (OSError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


_HEADERS = (b"content-length", b"transfer-encoding", b"connection")  # what LeanHTTP reads


class LeanHTTP:
    """The benchmarks' load generator for JSON POSTs: HTTP/1.1 over asyncio streams, one
    keep-alive connection per request in flight (reused once its answer is read), the body
    encoded once per request and the answer parsed by Content-Length (or chunks).

    It replaces aiohttp's client where a benchmark compares paths by their time: the client
    runs on the same 2 cores as what it measures, and aiohttp's per-request machinery (0.14-0.2
    ms of CPU a request here, against 0.08 ms for this: bursts of 8 against a server that
    answers at once) was counted in every HTTP path's figure. A serving client lives on another
    host; the servers still parse full HTTP.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, unix: str | None = None,
                 timeout_s: float = 300.0) -> None:
        self.host, self.port, self.unix = host, port, unix
        self.timeout_s = timeout_s
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        """(status, the answer's JSON); raises BenchError on a non-JSON or cut answer."""
        async with asyncio.timeout(self.timeout_s):  # no task of its own, unlike wait_for
            return await self._post(path, json.dumps(body).encode())

    async def _post(self, path: str, data: bytes) -> tuple[int, Any]:
        while self._idle:
            reader, writer = self._idle.pop()
            if reader.at_eof() or writer.is_closing():
                writer.close()  # the server closed it while idle (uvicorn after 5 s)
                continue
            try:
                return await self._exchange(reader, writer, path, data)
            except (asyncio.IncompleteReadError, ConnectionResetError) as exc:
                if getattr(exc, "partial", b""):
                    raise
                # closed by the server as this request went out: nothing was answered, so it
                # goes again on another connection (as HTTP clients retry on a stale one)
        if self.unix is not None:
            reader, writer = await asyncio.open_unix_connection(self.unix)
        else:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        return await self._exchange(reader, writer, path, data)

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        path: str, data: bytes) -> tuple[int, Any]:
        try:
            writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s"
                         % (path.encode(), self.host.encode(), len(data), data))
            head = (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
            status = int(head[0][9:12])  # HTTP/1.1 NNN
            headers = {k.lower(): v.strip() for k, _, v in
                       (line.partition(b":") for line in head[1:]) if k.lower() in _HEADERS}
            if b"content-length" in headers:
                raw = await reader.readexactly(int(headers[b"content-length"]))
            elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
                raw = b""
                while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                    raw += (await reader.readexactly(size + 2))[:-2]
                await reader.readuntil(b"\r\n")  # the empty trailer
            else:
                raise BenchError(f"POST {path}: HTTP {status} without a length: {head}")
            answer = json.loads(raw)
        except BaseException:
            writer.close()
            raise
        if headers.get(b"connection", b"").lower() == b"close":
            writer.close()
        else:
            self._idle.append((reader, writer))
        return status, answer

    def close(self) -> None:
        while self._idle:
            self._idle.pop()[1].close()


class StatusConnection(KeepAlive):
    """GET /v1/status on one keep-alive connection, each round trip timed (`times`)."""

    def __init__(self, socket_path: str, timeout_s: float = 5.0) -> None:
        super().__init__(socket_path, timeout_s)
        self.times: list[float] = []

    def get(self) -> dict:
        started = time.perf_counter()
        status, body = self.round_trip("GET", "/v1/status")
        self.times.append(time.perf_counter() - started)
        if status != 200:
            raise BenchError(f"GET /v1/status: HTTP {status}: {body[:200]!r}")
        return json.loads(body)


class BenchDaemon(Daemon):
    """testkit/driver.py's Daemon in a short directory under /tmp (`/tmp/<prefix>XXXXXXXX`, runtime
    dir `rt/` in it: ZeroMQ ipc paths must stay short), with what a benchmark adds: every restart
    immediate, 1 s heartbeats, no ENGINED_* variable from our environment (but our PYTHONPATH,
    if any: the daemon runs the engined the benchmark imports), GET /v1/status on a
    keep-alive connection (`status_times`), pids tracked by the Tracker, BenchError with the
    daemon's log tail instead of AssertionError. `watched` is the engine the single-engine
    helpers (`engine()`, `wait_ready()`) look at by default: replica 0 of the first engine."""

    log_lines = 20  # lines of each log in an error message
    log_engines: tuple[str, ...] = ()  # engines whose own log tails go into error messages
    # how long `start` and `wait_ready` wait by default, and how often they look
    start_timeout_s, start_interval_s = 120.0, 0.05
    ready_timeout_s, ready_interval_s = 30.0, 0.005

    def __init__(self, prefix: str, tracker: Tracker, engines: list[dict[str, Any]],
                 http: str = "off", status_timeout_s: float = 5.0,
                 supervisor: dict[str, Any] | None = None) -> None:
        """`supervisor`: more keys of the spec's `supervisor` section (e.g. `gateway`)."""
        root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        spec = build_spec(root, engines, {"http": http, **HEARTBEATS, **(supervisor or {})},
                          IMMEDIATE_RESTARTS)
        env: dict[str, str | None] = {k: None for k in os.environ
                                      if k.startswith("ENGINED_") or k == "NOTIFY_SOCKET"}
        if os.environ.get("PYTHONPATH"):  # the daemon runs the engined this process imports
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        super().__init__(root, spec, env=env)
        self.dir = root
        self.tracker = tracker
        self.replicas = sum(e.get("replicas", 1) for e in engines)
        self.watched = f"{engines[0]['name']}-0"
        self.status_conn = StatusConnection(self.socket, status_timeout_s)
        self.stop_note = ""

    @property
    def status_times(self) -> list[float]:
        return self.status_conn.times

    def start(self, timeout_s: float | None = None, interval_s: float | None = None) -> None:
        """Run it; wait until all its engines are READY (BenchError with the log tail if not)."""
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        interval_s = self.start_interval_s if interval_s is None else interval_s

        def all_ready() -> bool:
            self.check_alive()
            engines = self.status()["engines"]
            for e in engines:
                self.tracker.add(e["pid"])
            failed = [e for e in engines if e["state"] == "FAILED"]  # never restarted: give up
            if failed:
                raise BenchError(f"{len(failed)} engine(s) FAILED while starting, e.g. "
                                 f"{failed[0]['name']}: {failed[0].get('fail_reason')}")
            return len(engines) == self.replicas and all(e["state"] == "READY" for e in engines)
        try:
            try:
                super().start(timeout_s)
            finally:
                if self.proc is not None:
                    self.tracker.add(self.proc.pid)
            wait_until(all_ready, timeout_s, f"{self.replicas} engines READY", interval_s)
        except (AssertionError, BenchError) as exc:
            raise BenchError(f"{exc}\n{self.log_tail()}") from None

    def child_load_s(self, incarnation: int, name: str | None = None) -> float | None:
        """The child's own import -> warm-up time, from its `[ready]` log line."""
        name = name or self.watched
        line = re.compile(rf"^\[ready\] {re.escape(name)} incarnation (\d+) loaded in "
                          rf"([0-9.]+)s", re.M)
        for inc, load_s in line.findall(self.log_text(name)):
            if int(inc) == incarnation:
                return float(load_s)
        return None

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise BenchError(f"engined exited with {self.proc.returncode}")

    def log_tail(self) -> str:
        """The last lines of the daemon's stderr log (and of the `log_engines` logs)."""
        texts = [self.stderr_text()] + [self.log_text(name) for name in self.log_engines]
        return "\n".join("\n".join(t.splitlines()[-self.log_lines:]) for t in texts)

    def status(self) -> dict:
        return self.status_conn.get()

    def engine(self, name: str | None = None) -> dict:
        name = name or self.watched
        return next(e for e in self.status()["engines"] if e["name"] == name)

    def wait_ready(self, min_incarnation: int, timeout_s: float | None = None,
                   interval_s: float | None = None, name: str | None = None) -> dict:
        """`name` READY with incarnation >= min_incarnation (BenchError if FAILED or late)."""
        name = name or self.watched
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
        interval_s = self.ready_interval_s if interval_s is None else interval_s

        def ready() -> dict | None:
            self.check_alive()
            e = self.engine(name)
            if e["state"] == "FAILED":
                raise BenchError(f"{name} FAILED: {e.get('fail_reason')}")
            return e if e["state"] == "READY" and e["incarnation"] >= min_incarnation else None
        try:
            e = wait_until(ready, timeout_s, f"{name} READY (incarnation >= {min_incarnation})",
                           interval_s)
        except BenchError as exc:
            raise BenchError(f"{exc}\n{self.log_tail()}") from None
        self.tracker.add(e["pid"])
        return e

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait, SIGKILL (then `stop_note` says so). Before that, every engine it ever
        spawned that is still its engine goes to the tracker, so a leftover is killed by pid."""
        self.status_conn.close()
        was_running = self.alive()
        if was_running:
            for pid in self.spawned_pids():
                if is_engine_of(pid, self.pid):
                    self.tracker.add(pid)
        code = super().stop(timeout_s)
        if was_running and code is None:
            self.stop_note = "engined did not stop in time: SIGKILLed"
        return code

    def remove_dir(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
