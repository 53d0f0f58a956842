"""What the benchmarks share: errors and waits, process tracking and cleanup by pid, the engined
daemon (testkit/driver.py's `Daemon` with what a benchmark adds) and clients of its control socket.
How they report is bench/report.py.

The daemon driver is the tests' own, `testkit.driver`. What the benchmarks use of engined's
supervisor internals (HTTP over the control socket, the engine channels, how the launcher builds an
engine child's environment) is imported here and nowhere else, so that it is repointed in one
place when they move. Nothing here kills by name: every process is tracked by pid
(psutil handles, which guard against pid reuse) and stopped by pid.
"""

from __future__ import annotations

import http.client
import json
import os
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
from engined.supervisor.ctl.client import UnixHTTPConnection as UnixHTTPConnection
from engined.supervisor.host.launcher import child_environment as child_environment
from engined.supervisor.host.launcher import expose_engine_package as expose_engine_package
from engined.supervisor.ipc import EngineChannels as EngineChannels
from testkit.driver import Daemon, build_spec, is_engine_of

ROOT = Path(__file__).resolve().parent.parent
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


def build_checkpoint(cache: Path) -> Path:
    """builtin:tiny-llama's checkpoint built into `cache` (untimed), exactly as an engine builds
    it on first use: one thread, offline, no GPU, the installed engined."""
    env = without_engined_vars(None, "WATCHDOG_USEC", "WATCHDOG_PID", "PYTHONPATH")
    env.update({"ENGINED_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""})
    code = ("from engined.engine.checkpoint import tiny_llama_dir; "
            "print(tiny_llama_dir(lambda phase, detail: None))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        raise BenchError(f"building tiny-llama failed:\n{done.stderr[-2000:]}")
    return Path(done.stdout.strip())


# --- engined ------------------------------------------------------------------------------------
# Every restart immediate: no backoff delay, the failure streak resets at once, never FAILED.
IMMEDIATE_RESTARTS = {
    "restart": "always",
    "backoff": {"initial": "0s", "max": "0s", "factor": 1.0, "jitter": 0, "reset_after": "0s"},
    "start_limit": {"burst": 1000000, "interval": "1s"},
    "stop_timeout": "10s",
}
HEARTBEATS = {"heartbeat_interval": "1s", "heartbeat_timeout": "10s"}


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


class StatusConnection(KeepAlive):
    """GET /v1/status on one keep-alive connection."""

    def get(self) -> dict:
        status, body = self.round_trip("GET", "/v1/status")
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
