"""The peer supervisors of `bench.compare`: supervisord and circus, each in its own virtualenv.

Neither is ever installed into engined's own environment: supervisord's distribution imports as
`supervisor`, the name of engined's source folder (engined installs as `engined.supervisor`, but
run from the repository root the folder would shadow supervisord), and a peer's dependencies
have no business in the environment under test. Each peer gets a venv under
`$ENGINED_BENCH_VENVS`, else `$XDG_CACHE_HOME/engined-bench/venvs` (default `~/.cache/...`),
created once with `python -m venv` + `pip install NAME==VERSION` and reused afterwards; the peers
run from those venvs' own binaries with `PYTHONPATH` removed from their environment and a
neutral working directory, so nothing of engined's tree is importable there.

Drivers (each tracked by pid and stopped by pid):
- `Supervisord`: `supervisord -n -c CONF`, programs with `autorestart=true`, `startsecs=0`, child
  output piped to supervisord (its default `stdout_logfile=AUTO`), optionally an event listener
  that timestamps every PROCESS_STATE_EXITED it receives, status over XML-RPC on its unix socket.
- `Circus`: `circusd CONF` with one watcher, its default `check_delay` or a given one; the bench
  subscribes to circusd's pub-sub stream, whose `reap` events carry circus's own reap time.
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

# Pinned, so a result names exactly what it measured.
PEERS = {"supervisord": ("supervisor", "4.3.0"), "circus": ("circus", "0.19.0")}
SLEEPER_CODE = "import time; time.sleep(1e9)"  # bench/floor.py's sleeping child
VENV_TIMEOUT_S = 300.0


# --- virtual environments -------------------------------------------------------------------------
def venv_root() -> Path:
    if os.environ.get("ENGINED_BENCH_VENVS"):
        return Path(os.environ["ENGINED_BENCH_VENVS"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "engined-bench" / "venvs"


def peer_env(**extra: str) -> dict[str, str]:
    """The environment a peer runs in: nothing that points into engined's tree or venv."""
    env = without_engined_vars(None, "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "WATCHDOG_USEC",
                               "WATCHDOG_PID", "PYTHONSTARTUP")
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def venv_ready(dist: str, version: str, root: Path | None = None) -> Path | None:
    path = (root or venv_root()) / f"{dist}-{version}"
    return path if (path / ".engined-bench-ok").exists() else None


def ensure_venv(dist: str, version: str, root: Path | None = None,
                timeout_s: float = VENV_TIMEOUT_S) -> tuple[Path, str]:
    """The venv of `dist==version`, created if missing. Returns (path, what was done).

    A venv cannot be moved (its scripts' shebangs name its path), so it is built in place under a
    lock and marked complete last; a half-built one (no marker) is removed and built again.
    """
    root = root or venv_root()
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{dist}-{version}"
    marker = path / ".engined-bench-ok"
    with open(root / f".{dist}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return path, "reused"
        shutil.rmtree(path, ignore_errors=True)
        started = time.monotonic()
        base = getattr(sys, "_base_executable", sys.executable)
        for argv in ([base, "-m", "venv", str(path)],
                     [str(path / "bin" / "python"), "-m", "pip", "install", "-q",
                      f"{dist}=={version}"]):
            left = timeout_s - (time.monotonic() - started)
            try:
                done = subprocess.run(argv, env=peer_env(), cwd=root, stdin=subprocess.DEVNULL,
                                      capture_output=True, text=True, timeout=max(1.0, left))
            except subprocess.TimeoutExpired:
                shutil.rmtree(path, ignore_errors=True)
                raise BenchError(f"creating the {dist} venv took over {timeout_s:g} s") from None
            if done.returncode != 0:
                shutil.rmtree(path, ignore_errors=True)
                text = (done.stderr or done.stdout).strip()
                last = text.splitlines()[-1] if text else ""
                raise BenchError(f"`{' '.join(argv[-3:])}` failed ({done.returncode}): "
                                 f"{last[:200]}\n{text[-1500:]}")
        marker.write_text(f"{dist}=={version}\n")
        return path, f"created in {time.monotonic() - started:.1f} s"


# --- shared ---------------------------------------------------------------------------------------
class _Peer:
    """A peer daemon in a short scratch directory (ZeroMQ ipc paths must stay short)."""

    label = "peer"

    def __init__(self, prefix: str, tracker: Tracker) -> None:
        self.tracker = tracker
        self.dir = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        self.log_path = self.dir / "daemon.out"
        self.proc: subprocess.Popen[bytes] | None = None

    def _popen(self, argv: list[str]) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, cwd=self.dir, env=peer_env(),
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self.tracker.add(self.proc.pid)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise BenchError(f"{self.label} exited with {self.proc.returncode}:\n"
                             f"{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def children(self) -> set[int]:
        return read_children(self.pid)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (both stop their children on it), wait, then SIGKILL the daemon by pid."""
        if self.proc is not None and self.proc.poll() is None:
            for pid in self.children():
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

LISTENER_CONF = """
[eventlistener:exits]
command = {python} {script} {out}
events = PROCESS_STATE_EXITED
"""

# The event listener: supervisord's documented stdin/stdout protocol; one line per event,
# `<time.time() on receipt> <pid> <eventname>`, written before it acknowledges the event.
LISTENER_SCRIPT = """\
import sys, time
out = open(sys.argv[1], "a", buffering=1)
while True:
    sys.stdout.write("READY\\n"); sys.stdout.flush()
    header = sys.stdin.readline()
    t = time.time()
    if not header:
        break
    fields = dict(x.split(":", 1) for x in header.split())
    payload = sys.stdin.read(int(fields["len"]))
    body = dict(x.split(":", 1) for x in payload.split() if ":" in x)
    out.write("%.6f %s %s\\n" % (t, body.get("pid", "?"), fields.get("eventname", "?")))
    sys.stdout.write("RESULT 2\\nOK"); sys.stdout.flush()
"""

# supervisord stamps its log lines with millisecond resolution, too coarse for a ~1 ms
# detection. This shim runs the unmodified supervisord but prints each log line's own
# time.time() (the same instant its `asctime` is taken from) with microseconds instead.
SUPERVISORD_SHIM = """\
import sys, time
from supervisor import loggers
def asdict(self):
    if self.dictrepr is None:
        now = time.time()
        msg = loggers.as_string(self.msg)
        if self.kw:
            msg = msg % self.kw
        self.dictrepr = {"message": msg, "levelname": loggers.LOG_LEVELS_BY_NUM[self.level],
                         "asctime": "%.6f" % now}
    return self.dictrepr
loggers.LogRecord.asdict = asdict
from supervisor.supervisord import main
sys.argv = ["supervisord"] + sys.argv[1:]
main()
"""

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
    """supervisord from its venv, N copies of a trivial program, `autorestart`, `startsecs=0`.

    piped=True: the sleeping child as it is (its stdout/stderr are supervisord's pipes, the
    default). piped=False: the same child with its stdio redirected to /dev/null at exec, so that
    only SIGCHLD tells supervisord of an exit.
    """

    def __init__(self, venv: Path, n: int, tracker: Tracker, *, listener: bool = True,
                 piped: bool = True, label: str = "supervisord",
                 child_env: dict[str, str] | None = None) -> None:
        super().__init__("ebs", tracker)
        self.venv, self.n, self.label = venv, n, label
        self.listener_out = self.dir / "events.txt"
        if child_env is not None:
            # engined's own echo engine as the child: a wrapper sets its environment (JSON in a
            # file: supervisord's `environment=` cannot carry it) and execs it, keeping the pid.
            (self.dir / "child-env.json").write_text(json.dumps(child_env))
            (self.dir / "echo.py").write_text(ECHO_WRAPPER)
            sleeper = (f"{shlex.quote(sys.executable)} {self.dir / 'echo.py'} "
                       f"{self.dir / 'child-env.json'}")
        else:
            sleeper = f"{shlex.quote(sys.executable)} -c {shlex.quote(SLEEPER_CODE)}"
        command = sleeper if piped else (
            "/bin/sh -c " + shlex.quote(f"exec {sleeper} </dev/null >/dev/null 2>&1"))
        conf = SUPERVISORD_CONF.format(dir=self.dir, command=command.replace("%", "%%"), n=n)
        (self.dir / "logs").mkdir()
        if listener:
            script = self.dir / "listener.py"
            script.write_text(LISTENER_SCRIPT)
            conf += LISTENER_CONF.format(python=venv / "bin" / "python", script=script,
                                         out=self.listener_out)
        self.conf = self.dir / "supervisord.conf"
        self.conf.write_text(conf)
        self.has_listener = listener

    def start(self, timeout_s: float = 120.0) -> None:
        self._popen([str(self.venv / "bin" / "python"), "-c", SUPERVISORD_SHIM, "-n",
                     "-c", str(self.conf)])

        def up():
            self.check_alive()
            if not (self.dir / "s.sock").exists():
                return False
            infos = self.infos()
            for i in infos:
                self.tracker.add(i["pid"])
            sleepers = [i for i in infos if i["group"] == "sleeper"]
            return len(sleepers) == self.n and all(i["statename"] == "RUNNING" for i in infos)
        try:
            wait_until(up, timeout_s, f"{self.label}: {self.n} programs RUNNING", 0.05)
        except BenchError as exc:
            raise BenchError(f"{exc}\n{self.log_tail()}") from None

    def rpc(self) -> xmlrpc.client.ServerProxy:
        return xmlrpc.client.ServerProxy("http://localhost",
                                         transport=_UnixTransport(str(self.dir / "s.sock")))

    def infos(self) -> list[dict]:
        try:
            return self.rpc().supervisor.getAllProcessInfo()
        except (OSError, xmlrpc.client.Error):
            return []

    def victim(self) -> int:
        """The pid of sleeper_000 once it is RUNNING (a kill in STARTING would mean BACKOFF)."""
        def running():
            self.check_alive()
            info = self.rpc().supervisor.getProcessInfo("sleeper:sleeper_000")
            return info["pid"] if info["statename"] == "RUNNING" and info["pid"] else None
        pid = wait_until(running, 10.0, f"{self.label}: sleeper_000 RUNNING", 0.005)
        self.tracker.add(pid)
        return pid

    def exit_logged(self, after: float) -> float | None:
        """The first `exited:` line supervisord logged at or after `after` (its own clock)."""
        try:
            text = (self.dir / "supervisord.log").read_text(errors="replace")
        except OSError:
            return None
        times = [float(t) for t, _name, _why in _EXITED_RE.findall(text) if float(t) >= after]
        return min(times) if times else None

    def exit_notified(self, pid: int) -> float | None:
        """When the event listener received PROCESS_STATE_EXITED for `pid`."""
        try:
            lines = self.listener_out.read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            t, p, name = line.split()
            if p == str(pid) and name == "PROCESS_STATE_EXITED":
                return float(t)
        return None

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
    """circusd from its venv: one watcher of N sleeping children; check_delay None = its default
    (5 s from a config file). A subscriber thread records its pub-sub events as they arrive."""

    def __init__(self, venv: Path, n: int, tracker: Tracker, check_delay: float | None = None,
                 label: str = "circus") -> None:
        super().__init__("ebc", tracker)
        self.venv, self.n, self.label = venv, n, label
        self.conf = self.dir / "circus.ini"
        self.conf.write_text(CIRCUS_CONF.format(
            dir=self.dir, n=n, command=f"{sys.executable} -c {shlex.quote(SLEEPER_CODE)}",
            check_delay="" if check_delay is None else f"check_delay = {check_delay:g}\n"))
        self.endpoint = f"ipc://{self.dir}/c.sock"
        self.check_delay = 5.0 if check_delay is None else check_delay  # circus's file default
        self.reaped: dict[int, float] = {}  # pid -> circus's own reap time ("time" of the event)
        self.reap_received: dict[int, float] = {}  # pid -> when the subscriber got the event
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._subscribed = threading.Event()

    def start(self, timeout_s: float = 120.0) -> None:
        self._popen([str(self.venv / "bin" / "circusd"), str(self.conf)])
        self._thread = threading.Thread(target=self._subscribe, daemon=True)
        self._thread.start()

        def up():
            self.check_alive()
            kids = self.children()
            for pid in kids:
                self.tracker.add(pid)
            return len(kids) == self.n and self._subscribed.is_set()
        try:
            wait_until(up, timeout_s, f"{self.label}: {self.n} children", 0.05)
        except BenchError as exc:
            raise BenchError(f"{exc}\n{self.log_tail()}") from None

    def _subscribe(self) -> None:
        import zmq
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"watcher.")
        sock.connect(f"ipc://{self.dir}/p.sock")
        self._subscribed.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                topic, body = sock.recv_multipart()
                now = time.time()
                if topic.endswith(b".reap"):
                    msg = json.loads(body)
                    self.reaped[int(msg["process_pid"])] = float(msg["time"])
                    self.reap_received[int(msg["process_pid"])] = now
        finally:
            sock.close(0)
            ctx.term()

    def victim(self) -> int:
        kids = wait_until(lambda: (k := self.children()) and len(k) == self.n and k, 15.0,
                          f"{self.label}: {self.n} children")
        pid = min(kids)
        self.tracker.add(pid)
        return pid

    def ctl_argv(self) -> list[str]:
        return [str(self.venv / "bin" / "circusctl"), "--endpoint", self.endpoint, "status"]

    def stop(self, timeout_s: float = 60.0) -> None:
        super().stop(timeout_s)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
