"""The peers: supervisord and circus, each from its own virtualenv, driven by pid.

Neither is ever installed into engined's environment: supervisord's distribution imports as
`supervisor`, the name of engined's source folder, and a peer's dependencies have no business in
the environment under test. Each gets a venv under `$ENGINED_BENCH_VENVS`, else
`$XDG_CACHE_HOME/engined-bench/venvs` (default `~/.cache/...`), made once (`python -m venv`, `pip
install NAME==VERSION`, pinned) and reused; the peers run from its binaries with `PYTHONPATH`
removed and a scratch working directory.

- `Supervisord`: `supervisord -n -c CONF`, N programs with `autorestart=true`, `startsecs=0`,
  child output piped to it (its default), status over XML-RPC on its unix socket; started
  through a shim that stamps its log lines in microseconds (its own have milliseconds).
- `Circus`: `circusd CONF`, one watcher of N, its default `check_delay` (5 s) or a given one;
  the bench subscribes to its pub-sub stream, whose `reap` events carry circus's reap time.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xmlrpc.client
from pathlib import Path

from bench.common import (
    BenchError,
    Tracker,
    UnixHTTPConnection,
    read_children,
    terminate,
    wait_until,
    without_engined_vars,
)

PEERS = {"supervisord": ("supervisor", "4.3.0"), "circus": ("circus", "0.19.0")}  # pinned
SLEEPER = f"{shlex.quote(sys.executable)} -c 'import time; time.sleep(1e9)'"  # the floor's


def peer_env() -> dict[str, str]:
    """The environment a peer runs in: nothing that points into engined's tree or venv."""
    env = without_engined_vars(None, "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "WATCHDOG_USEC",
                               "WATCHDOG_PID", "PYTHONSTARTUP")
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def ensure_venv(dist: str, version: str, timeout_s: float = 300.0) -> tuple[Path, str]:
    """The venv of `dist==version`, made if missing: (its path, what was done). Built in place
    under a lock (a venv cannot move) and marked complete last."""
    root = Path(os.environ.get("ENGINED_BENCH_VENVS") or Path(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "engined-bench"
        / "venvs")
    root.mkdir(parents=True, exist_ok=True)
    path, started = root / f"{dist}-{version}", time.monotonic()
    with open(root / f".{dist}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / ".engined-bench-ok").exists():
            return path, "reused"
        shutil.rmtree(path, ignore_errors=True)
        base = getattr(sys, "_base_executable", sys.executable)
        for argv in ([base, "-m", "venv", str(path)],
                     [str(path / "bin" / "python"), "-m", "pip", "install", "-q",
                      f"{dist}=={version}"]):
            try:
                done = subprocess.run(argv, env=peer_env(), cwd=root, stdin=subprocess.DEVNULL,
                                      capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                done = None
            if done is None or done.returncode != 0:
                shutil.rmtree(path, ignore_errors=True)
                why = "timed out" if done is None else (done.stderr or done.stdout)[-1500:]
                raise BenchError(f"`{' '.join(argv[-3:])}` failed: {why}")
        (path / ".engined-bench-ok").write_text(f"{dist}=={version}\n")
        return path, f"made in {time.monotonic() - started:.1f} s"


class _Peer:
    """A peer daemon in a short scratch directory (ZeroMQ ipc paths must stay short)."""

    def __init__(self, prefix: str, tracker: Tracker, venv: Path, n: int, label: str) -> None:
        self.tracker, self.venv, self.n, self.label = tracker, venv, n, label
        self.dir = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        self.log_path = self.dir / "daemon.out"
        self.proc: subprocess.Popen[bytes] | None = None

    def _popen(self, argv: list[str]) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, cwd=self.dir, env=peer_env(),
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self.tracker.add(self.proc.pid)

    def _wait_up(self, up, timeout_s: float) -> None:
        def check() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise BenchError(f"{self.label} exited with {self.proc.returncode}")
            return up()
        try:
            wait_until(check, timeout_s, f"{self.label}: {self.n} children", 0.05)
        except BenchError as exc:
            tail = self.log_path.read_text(errors="replace").splitlines()[-20:]
            raise BenchError(f"{exc}\n" + "\n".join(tail)) from None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM (both stop their children on it), wait, then SIGKILL the daemon by pid."""
        if self.proc is not None and self.proc.poll() is None:
            for pid in read_children(self.pid):
                self.tracker.add(pid)
            terminate(self.proc, timeout_s)

    def remove_dir(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


# --- supervisord ----------------------------------------------------------------------------------
SUPERVISORD_CONF = """\
[unix_http_server]
file = {dir}/s.sock

[supervisord]
nodaemon = true
logfile = {dir}/supervisord.log
pidfile = {dir}/supervisord.pid
childlogdir = {dir}/logs
loglevel = info

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl = unix://{dir}/s.sock

[program:sleeper]
command = {command}
numprocs = {n}
process_name = %(program_name)s_%(process_num)03d
autorestart = true
startsecs = 0
"""

# The unmodified supervisord, but each log line shows its own time.time() (the instant its
# `asctime` is taken from) in microseconds instead of milliseconds.
SUPERVISORD_SHIM = """\
import sys, time
from supervisor import loggers
def asdict(self):
    if self.dictrepr is None:
        msg = loggers.as_string(self.msg)
        if self.kw:
            msg = msg % self.kw
        self.dictrepr = {"message": msg, "levelname": loggers.LOG_LEVELS_BY_NUM[self.level],
                         "asctime": "%.6f" % time.time()}
    return self.dictrepr
loggers.LogRecord.asdict = asdict
from supervisor.supervisord import main
sys.argv = ["supervisord"] + sys.argv[1:]
main()
"""

# engined's echo engine as supervisord's child: its environment from a JSON file (supervisord's
# `environment=` cannot carry it), then exec, keeping the pid.
ECHO_WRAPPER = """\
import json, os, sys
os.environ.update(json.load(open(sys.argv[1])))
os.execv(sys.executable, [sys.executable, "-m", "engined.engine"])
"""

_EXITED_RE = re.compile(r"^(\d+\.\d+) \w+ exited: (\S+) \((.*)\)$", re.M)


class _UnixTransport(xmlrpc.client.Transport):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def make_connection(self, host):  # type: ignore[override]
        return UnixHTTPConnection(self.path, timeout_s=10.0)


class Supervisord(_Peer):
    """N sleeping children (or, with `child_env`, engined's echo engine child)."""

    def __init__(self, venv: Path, n: int, tracker: Tracker, label: str,
                 child_env: dict[str, str] | None = None) -> None:
        super().__init__("ebs", tracker, venv, n, label)
        command = SLEEPER
        if child_env is not None:
            (self.dir / "child-env.json").write_text(json.dumps(child_env))
            (self.dir / "echo.py").write_text(ECHO_WRAPPER)
            command = f"{shlex.quote(sys.executable)} {self.dir}/echo.py {self.dir}/child-env.json"
        (self.dir / "logs").mkdir()
        self.conf = self.dir / "supervisord.conf"
        self.conf.write_text(SUPERVISORD_CONF.format(dir=self.dir, n=n,
                                                     command=command.replace("%", "%%")))

    def start(self, timeout_s: float = 120.0) -> None:
        self._popen([str(self.venv / "bin" / "python"), "-c", SUPERVISORD_SHIM, "-n",
                     "-c", str(self.conf)])

        def up() -> bool:
            infos = self.infos()
            for i in infos:
                self.tracker.add(i["pid"])
            return len(infos) == self.n and all(i["statename"] == "RUNNING" for i in infos)
        self._wait_up(up, timeout_s)

    def infos(self) -> list[dict]:
        if not (self.dir / "s.sock").exists():
            return []
        try:
            proxy = xmlrpc.client.ServerProxy(
                "http://localhost", transport=_UnixTransport(str(self.dir / "s.sock")))
            return proxy.supervisor.getAllProcessInfo()
        except (OSError, xmlrpc.client.Error):
            return []

    def victim(self) -> int:
        """sleeper_000's pid once it is RUNNING (a kill in STARTING would mean BACKOFF)."""
        def running() -> int | None:
            info = next((i for i in self.infos() if i["name"] == "sleeper_000"), None)
            return info["pid"] if info and info["statename"] == "RUNNING" else None
        pid = wait_until(running, 10.0, f"{self.label}: sleeper_000 RUNNING")
        self.tracker.add(pid)
        return pid

    def exit_logged(self, after: float) -> float | None:
        """The first `exited:` line supervisord logged at or after `after` (its own clock)."""
        try:
            text = (self.dir / "supervisord.log").read_text(errors="replace")
        except OSError:
            return None
        found = [float(t) for t, _name, _why in _EXITED_RE.findall(text) if float(t) >= after]
        return min(found) if found else None

    def ctl_argv(self) -> list[str]:
        return [str(self.venv / "bin" / "supervisorctl"), "-c", str(self.conf), "status"]


# --- circus ---------------------------------------------------------------------------------------
CIRCUS_CONF = """\
[circus]
endpoint = ipc://{dir}/c.sock
pubsub_endpoint = ipc://{dir}/p.sock
statsd = false
{check_delay}
[watcher:sleeper]
cmd = {command}
numprocesses = {n}
warmup_delay = 0
respawn = true
"""


class Circus(_Peer):
    """One watcher of N sleeping children; `check_delay` None: its default (5 s from a config
    file). A thread records the `reap` events of its pub-sub stream as they arrive."""

    def __init__(self, venv: Path, n: int, tracker: Tracker, label: str,
                 check_delay: float | None = None) -> None:
        super().__init__("ebc", tracker, venv, n, label)
        self.conf = self.dir / "circus.ini"
        self.conf.write_text(CIRCUS_CONF.format(
            dir=self.dir, n=n, command=SLEEPER,
            check_delay="" if check_delay is None else f"check_delay = {check_delay:g}\n"))
        self.check_delay = 5.0 if check_delay is None else check_delay
        self.reaped: dict[int, float] = {}  # pid -> circus's own reap time
        self._stop, self._subscribed = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 120.0) -> None:
        self._popen([str(self.venv / "bin" / "circusd"), str(self.conf)])
        self._thread = threading.Thread(target=self._subscribe, daemon=True)
        self._thread.start()

        def up() -> bool:
            kids = read_children(self.pid)
            for pid in kids:
                self.tracker.add(pid)
            return len(kids) == self.n and self._subscribed.is_set()
        self._wait_up(up, timeout_s)

    def _subscribe(self) -> None:
        import zmq
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"watcher.")
        sock.connect(f"ipc://{self.dir}/p.sock")
        self._subscribed.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                topic, body = sock.recv_multipart()
                if topic.endswith(b".reap"):
                    msg = json.loads(body)
                    self.reaped[int(msg["process_pid"])] = float(msg["time"])
        finally:
            sock.close(0)
            ctx.term()

    def victim(self) -> int:
        kids = wait_until(lambda: (k := read_children(self.pid)) and len(k) == self.n and k,
                          15.0, f"{self.label}: {self.n} children")
        pid = min(kids)
        self.tracker.add(pid)
        return pid

    def ctl_argv(self) -> list[str]:
        return [str(self.venv / "bin" / "circusctl"), "--endpoint", f"ipc://{self.dir}/c.sock",
                "status"]

    def stop(self, timeout_s: float = 60.0) -> None:
        super().stop(timeout_s)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
