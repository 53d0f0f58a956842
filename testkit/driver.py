"""The one daemon driver, shared by the tests (through tests/conftest.py's fixtures) and the
benchmarks (bench/): start a real engined on a spec, drive it as a user would, clean up by pid.

`Daemon(root, spec)` writes a fleet spec into a short directory (ZeroMQ ipc:// paths must stay
under ~100 characters); `start()` runs the real daemon (`python -m engined.supervisor.daemon -c
SPEC`) and waits with a deadline until its control socket answers. `ctl(...)` runs `enginectl` as
a subprocess, `status()` reads GET /v1/status over the unix socket, `wait_for(...)` polls a
condition with a deadline, `spawned_pids()` lists every engine it ever started (for the
no-orphans checks). Nothing here is pytest-specific.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, TypeVar

import psutil
import yaml

from engined.supervisor.ctl import client

REPO_ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

DAEMON_START_TIMEOUT_S = 20.0
DAEMON_STOP_TIMEOUT_S = 30.0
DEFAULT_WAIT_S = 20.0
CTL_TIMEOUT_S = 60.0
ORPHAN_GRACE_S = 5.0  # PR_SET_PDEATHSIG is asynchronous: the kernel kills, init reaps

T = TypeVar("T")

_SPAWN_RE = re.compile(r"\bspawned pid (\d+)")
_DAEMON_LOG_RE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\w+) (.*)$")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NOTIFY_SOCKET", "ENGINED_SOCKET", "ENGINED_CONFIG_FILE",
                        "RUNTIME_DIRECTORY", "LOGS_DIRECTORY", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env.pop("PYTHONPATH", None)  # the installed package is what runs, never the source tree
    env["PYTHONUNBUFFERED"] = "1"
    return env


# --- HTTP over the control socket -------------------------------------------------------------


def http_request(sock_path: str, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None,
                 timeout_s: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """One request on its own connection; returns (status, headers, body)."""
    return client.request(sock_path, method, path, body, headers, timeout_s)


# --- the daemon driver ------------------------------------------------------------------------


class Daemon:
    """One running engined, its files, and helpers to drive it like a user would."""

    def __init__(self, root: Path, spec: dict[str, Any],
                 env: Mapping[str, str | None] | None = None) -> None:
        """`env`: changes to the environment the daemon runs in, on top of `_clean_env()`; a None
        value removes that variable (the benchmarks drop every ENGINED_* variable)."""
        self.root = root
        self.spec = spec
        self.spec_path = root / "fleet.yaml"
        self.runtime_dir = root / "rt"
        self.log_dir = self.runtime_dir / "logs"
        self.socket = str(self.runtime_dir / "control.sock")
        self.stderr_path = root / "engined.stderr"
        self.proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None
        self.seen_pids: set[int] = set()
        self.server_pids: set[int] = set()  # fork servers seen in status
        self.expect_unclean_exit = False  # set by tests that kill the daemon on purpose
        self.env_changes: dict[str, str | None] = dict(env or {})
        self.wrapper: list[str] = []  # a command engined runs under (unshare for PID 1)
        self.python = PYTHON  # the interpreter engined runs in (another install's, to upgrade it)
        self.spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))

    # --- process ---------------------------------------------------------------------------
    def environment(self) -> dict[str, str]:
        """The daemon's environment: `_clean_env()` with the `env` changes applied."""
        env = _clean_env()
        for key, value in self.env_changes.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def start(self, timeout_s: float = DAEMON_START_TIMEOUT_S,
              pass_fds: tuple[int, ...] = ()) -> None:
        """Run the daemon; wait up to `timeout_s` until its control socket answers.
        `pass_fds`: descriptors it inherits, as from a careless parent."""
        self.returncode = None
        with open(self.stderr_path, "ab") as err:
            self.proc = subprocess.Popen(
                [*self.wrapper, self.python, "-m", "engined.supervisor.daemon", "-c",
                 str(self.spec_path)],
                cwd=REPO_ROOT, env=self.environment(), stdin=subprocess.DEVNULL,
                stdout=err, stderr=err, pass_fds=pass_fds)
        self.wait_for(self._answers, timeout_s, "the control socket to answer")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _answers(self) -> bool:
        if not os.path.exists(self.socket):
            return False
        try:
            status, _, _ = http_request(self.socket, "GET", "/v1/status", timeout_s=5.0)
        except OSError:
            return False
        return status == 200

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout_s: float = DAEMON_STOP_TIMEOUT_S) -> int:
        assert self.proc is not None
        self.returncode = self.proc.wait(timeout=timeout_s)
        return self.returncode

    def stop(self, timeout_s: float = DAEMON_STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait (up to `timeout_s`), SIGKILL if needed; returns the exit code of a graceful
        stop, else None."""
        if self.proc is None:
            return None
        if self.proc.poll() is not None:
            self.returncode = self.proc.returncode
            return self.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.wait_exit(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            return None

    # --- driving it ------------------------------------------------------------------------
    def ctl(self, *args: str, timeout_s: float = CTL_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """Run `enginectl --socket SOCK ARGS...`; never raises on a non-zero exit."""
        return subprocess.run([PYTHON, "-m", "engined.supervisor.ctl.cli", "--socket", self.socket,
                               *args], cwd=REPO_ROOT, env=_clean_env(), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout_s)

    def ctl_popen(self, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
        return subprocess.Popen([PYTHON, "-m", "engined.supervisor.ctl.cli", "--socket",
                                 self.socket, *args], cwd=REPO_ROOT, env=_clean_env(),
                                stdin=subprocess.DEVNULL, text=True, **kwargs)

    def http(self, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        return http_request(self.socket, method, path, body, headers)

    def status(self) -> dict[str, Any]:
        code, _, body = http_request(self.socket, "GET", "/v1/status")
        assert code == 200, f"GET /v1/status -> {code}: {body!r}"
        data = json.loads(body)
        self.seen_pids.update(e["pid"] for e in data["engines"] if e.get("pid"))
        # fork servers: the fixture checks that none outlives the daemon either
        self.server_pids.update(s["pid"] for s in data["supervisor"].get("fork_servers", [])
                                if s.get("pid"))
        return data

    def engines(self) -> dict[str, dict[str, Any]]:
        return {e["name"]: e for e in self.status()["engines"]}

    def engine(self, name: str) -> dict[str, Any]:
        return self.engines()[name]

    def wait_for(self, predicate: Callable[[], T], timeout_s: float = DEFAULT_WAIT_S,
                 what: str = "condition", interval_s: float = 0.05) -> T:
        """Poll `predicate` until truthy (returned) or the deadline (AssertionError)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate()
            if value:
                return value
            exited = self.proc is not None and self.proc.poll() is not None
            if exited and not self.expect_unclean_exit:
                raise AssertionError(f"engined exited with {self.proc.returncode} while waiting "
                                     f"for {what}")
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what} "
                                     f"(last value {value!r})")
            time.sleep(interval_s)

    def holds(self, predicate: Callable[[], Any], duration_s: float, what: str,
              interval_s: float = 0.05) -> None:
        """Assert `predicate` stays truthy for `duration_s` (for "nothing else happens")."""
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            assert predicate(), f"{what} stopped holding"
            time.sleep(interval_s)

    def wait_state(self, name: str, state: str, timeout_s: float = DEFAULT_WAIT_S,
                   where: Callable[[dict[str, Any]], bool] = lambda e: True) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            e = self.engine(name)
            return e if e["state"] == state and where(e) else None
        return self.wait_for(check, timeout_s, f"{name} to be {state}")

    def wait_all_ready(self, timeout_s: float = DEFAULT_WAIT_S) -> dict[str, dict[str, Any]]:
        def check() -> dict[str, dict[str, Any]] | None:
            engines = self.engines()
            ok = all(e["state"] == "READY" and e["pid"] for e in engines.values())
            return engines if ok else None
        return self.wait_for(check, timeout_s, "every engine READY")

    def wait_restarted(self, name: str, old_pid: int,
                       timeout_s: float = DEFAULT_WAIT_S) -> dict[str, Any]:
        """READY again with a pid other than `old_pid`."""
        return self.wait_state(name, "READY", timeout_s,
                               lambda e: e["pid"] is not None and e["pid"] != old_pid)

    # --- files -----------------------------------------------------------------------------
    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def log_text(self, name: str) -> str:
        try:
            return self.log_path(name).read_text("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def stderr_text(self) -> str:
        try:
            return self.stderr_path.read_text("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def daemon_log(self) -> list[tuple[float, str, str]]:
        """(unix time, level, message) for each line of the daemon's stderr log."""
        out = []
        for line in self.stderr_text().splitlines():
            m = _DAEMON_LOG_RE.match(line)
            if m:
                stamp = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                out.append((stamp, m.group(2), m.group(3)))
        return out

    def spawned_pids(self) -> set[int]:
        """Every engine pid the daemon ever spawned, from the per-engine log files."""
        pids = set(self.seen_pids)
        if self.log_dir.is_dir():
            for path in self.log_dir.glob("*.log*"):
                pids.update(int(p) for p in _SPAWN_RE.findall(path.read_text("utf-8", "replace")))
        pids.update(int(p) for p in re.findall(r"\[spawn\] \S+ pid (\d+)", self.stderr_text()))
        return pids

    def dump(self) -> None:
        """Print what helps diagnose a failure (pytest shows it for failing tests only)."""
        print(f"===== engined stderr ({self.stderr_path}) =====")
        print(self.stderr_text()[-int(os.environ.get("ENGINED_TEST_DUMP_CHARS", "20000")):])
        if self.log_dir.is_dir():
            for path in sorted(self.log_dir.glob("*.log")):
                print(f"===== {path.name} =====")
                print(path.read_text("utf-8", "replace")[-5000:])


# --- process helpers --------------------------------------------------------------------------


def http_json(method: str, url: str, body: Any = None,
              timeout_s: float = 30.0) -> tuple[int, Any]:
    """One JSON request over TCP (a gateway, a server): (status, the JSON answer), errors
    included."""
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


class BackgroundStream:
    """A streamed completion read in a thread: `started` is set at its first chunk, `text()` is
    what arrived so far (all of it once `join` returns)."""

    def __init__(self, client: Any, model: str, prompt: str, max_tokens: int) -> None:
        self.started = threading.Event()
        self._parts: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(client, model, prompt,
                                                                 max_tokens))
        self._thread.start()

    def _read(self, client: Any, model: str, prompt: str, max_tokens: int) -> None:
        for chunk in client.completions.create(model=model, prompt=prompt,
                                               max_tokens=max_tokens, stream=True):
            self._parts.extend(c.text for c in chunk.choices)
            self.started.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def text(self) -> str:
        return "".join(self._parts)


def free_port() -> int:
    """A loopback TCP port nothing listens on now (the test's gateway, HTTP or server binds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_daemon(engines: list[dict[str, Any]], supervisor: dict[str, Any] | None = None,
                   defaults: dict[str, Any] | None = None,
                   prefix: str = "eg") -> Iterator[Daemon]:
    """A daemon outside the function-scoped `engined` fixture (a module's shared fleet), with
    its teardown checks: a clean exit on SIGTERM (or already stopped cleanly by the test) and no
    engine or fork server left."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    daemon = Daemon(root, build_spec(root, engines, supervisor, defaults))
    try:
        daemon.start()
        yield daemon
        if daemon.alive():
            daemon.spawned_pids()
            with contextlib.suppress(Exception):
                daemon.status()
        code = daemon.stop()
        alive = wait_engines_gone(daemon.spawned_pids() | daemon.server_pids, daemon.pid,
                                  ORPHAN_GRACE_S)
        assert code == 0, f"engined did not exit cleanly on SIGTERM (exit {code})"
        assert not alive, f"engine processes outlived engined: {alive}"
    finally:
        if daemon.alive():
            daemon.stop()
        if daemon.proc is not None:
            for pid in wait_engines_gone(daemon.spawned_pids() | daemon.server_pids,
                                         daemon.pid, 0):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        daemon.dump()
        shutil.rmtree(root, ignore_errors=True)


def process_gone(pid: int) -> bool:
    """Gone, or a zombie (an orphan waiting for an init that may not reap in a container)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def is_engine_of(pid: int, daemon_pid: int) -> bool:
    """Still alive, not a zombie, and an engine child of that daemon (not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        try:
            env = proc.environ()  # engine children name the daemon; command engines carry its mark
            return env.get("ENGINED_PARENT_PID") == str(daemon_pid) or \
                env.get("ENGINED_OWNER", "").startswith(f"{daemon_pid}/")
        except psutil.AccessDenied:  # another uid's: go by its title, or its argv without one
            cmdline = proc.cmdline()
            return cmdline[-2:] == ["-m", "engined.engine"] or \
                bool(cmdline) and cmdline[0].startswith("engined: ")
    except psutil.NoSuchProcess:
        return False


def leftover_engines(pids: set[int], daemon_pid: int) -> list[int]:
    return sorted(pid for pid in pids if is_engine_of(pid, daemon_pid))


def wait_engines_gone(pids: set[int], daemon_pid: int, timeout_s: float) -> list[int]:
    """Poll until none of `pids` is a live engine of `daemon_pid`; return those still alive."""
    deadline = time.monotonic() + timeout_s
    while (alive := leftover_engines(pids, daemon_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def stream_lines(stream: IO[str]) -> queue.Queue[str | None]:
    """Lines of a subprocess's text stream as they arrive (None at EOF), read by a thread."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def read_until(lines: queue.Queue[str | None], needle: str, timeout_s: float) -> list[str]:
    """Lines up to and including the first containing `needle`; AssertionError at the deadline
    or at EOF."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"{needle!r} not seen within {timeout_s:g}s; got {seen}")


def _dur(seconds: float) -> str:
    return f"{seconds:g}s"


def build_spec(root: Path, engines: list[dict[str, Any]] | None,
               supervisor: dict[str, Any] | None,
               defaults: dict[str, Any] | None) -> dict[str, Any]:
    sup = {"http": "off", "runtime_dir": str(root / "rt"),
           "heartbeat_interval": _dur(0.2), "heartbeat_timeout": _dur(1.5)}
    sup.update(supervisor or {})
    spec: dict[str, Any] = {"version": 1, "supervisor": sup}
    if defaults:
        spec["defaults"] = defaults
    spec["engines"] = engines if engines is not None else [
        {"name": "echo", "replicas": 1, "model": "builtin:echo"}]
    return spec


# --- the vLLM venv --------------------------------------------------------------------------------
VLLM_PYTHON_ENV = "ENGINED_VLLM_PYTHON"
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
_VLLM_PROBE = ("import importlib.util as u; print(all(u.find_spec(m) is not None "
               "for m in ('vllm', 'torch', 'zmq', 'msgspec')))")


def vllm_python_or_skip(what: str) -> str:
    """The vLLM venv's interpreter (ENGINED_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python), as
    an absolute path, not resolved (a venv's python is a symlink, and the venv is only a venv
    through that link). Without one the caller skips, except under CI=true, where `what` (the
    vLLM tier, the vLLM benchmark) must run and fails."""
    import pytest

    def unavailable(message: str) -> None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message} (CI=true: {what} must run)", pytrace=False)
        pytest.skip(message)

    path = os.path.abspath(os.environ.get(VLLM_PYTHON_ENV) or DEFAULT_VLLM_PYTHON)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        unavailable(f"no vLLM interpreter at {path} (set {VLLM_PYTHON_ENV}, or create "
                    f"{DEFAULT_VLLM_PYTHON.parent.parent}: see the README, \"Run vLLM under "
                    f"engined\")")
    probe = subprocess.run([path, "-c", _VLLM_PROBE], capture_output=True, text=True,
                           timeout=60, cwd=Path(path).parent)
    if probe.stdout.strip() != "True":
        unavailable(f"{path} lacks vllm, torch, pyzmq or msgspec: {probe.stdout.strip()} "
                    f"{probe.stderr.strip()[-500:]}")
    return path
