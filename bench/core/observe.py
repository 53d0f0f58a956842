"""How a kill is timed and seen, and the floor beside engined.

- `ProcEvents`: the kernel's fork/exec/exit events (netlink proc connector, CLOCK_MONOTONIC
  stamps): the bench sleeps through a kill and reads afterwards what happened when, so nothing
  spins while a supervisor reacts (a spinning observer slowed a killed child's exit from ~1.0 to
  ~4.7 ms on a 2-CPU box: os.kill() wakes the victim on the killer's CPU). Needs root; without it
  `kill_once` polls the supervisor's kernel child list (a read, then a 50 µs sleep).
- `Floor`: bench/core/floor.py as its own process, with a sleeping child or with engined's very
  `python -m engined.engine` echo child, whose two engine channels `ReadyListener` binds as the
  daemon does (so the child runs against a live peer and its READY is seen).
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from bench.common import (
    ROOT,
    BenchDaemon,
    BenchError,
    Cleanup,
    Tracker,
    expose_engine_package,
    read_children,
    terminate,
    wait_until,
    without_engined_vars,
)

POLL_SLEEP_S = 50e-6  # between /proc reads of the polling fallback
SETTLE_S = 0.1  # after READY / respawn, before the next kill: the new child finishes starting


class ProcEvents:
    """Kernel process events from the netlink proc connector; `open()` is None where it is not
    available (it needs CAP_NET_ADMIN and the initial network namespace)."""

    FORK, EXEC, EXIT = 0x1, 0x2, 0x80000000
    _CONNECTOR, _IDX_PROC, _VAL_PROC, _LISTEN, _IGNORE = 11, 1, 1, 1, 2

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, self._CONNECTOR)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        self.sock.bind((0, self._IDX_PROC))
        self._control(self._LISTEN)
        self.overruns = 0

    def _control(self, op: int) -> None:
        payload = struct.pack("=I", op)
        cn = struct.pack("=IIIIHH", self._IDX_PROC, self._VAL_PROC, 0, 0, len(payload),
                         0) + payload
        self.sock.send(struct.pack("=IHHII", 16 + len(cn), 3, 0, 0, 0) + cn)  # NLMSG_DONE

    @classmethod
    def open(cls) -> ProcEvents | None:
        try:
            events = cls()
        except OSError:
            return None
        probe = subprocess.Popen(["/bin/true"])  # must show up as fork + exit
        probe.wait()
        deadline, seen = time.monotonic() + 1.0, []
        while time.monotonic() < deadline:
            seen += events.drain()
            if any(e[0] == cls.EXIT and e[3] == probe.pid for e in seen):
                return events
            time.sleep(0.01)
        events.close()
        return None

    def drain(self) -> list[tuple[int, int, int, int, int, int]]:
        """(what, ts_ns, a, b, c, d): fork (parent pid, parent tgid, child pid, child tgid),
        exec (pid, tgid, 0, 0), exit (pid, tgid, code, signal)."""
        out = []
        while True:
            try:
                data = self.sock.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return out
            except OSError:  # ENOBUFS: the kernel dropped events; callers see missing ones
                self.overruns += 1
                continue
            if len(data) >= 52:
                what, _cpu, ts = struct.unpack_from("=IIQ", data, 36)
                a, b, c, d = struct.unpack_from("=IIII", data + bytes(16), 52)
                out.append((what, ts, a, b, c, d))

    def close(self) -> None:
        try:
            self._control(self._IGNORE)
        except OSError:
            pass
        self.sock.close()


@dataclass
class Kill:
    """One SIGKILL and what followed, in seconds after it."""

    victim: int
    t_wall: float
    t_mono_ns: int
    new_pid: int | None = None
    respawn_s: float | None = None  # the replacement exists (fork event, or first seen)
    exit_s: float | None = None  # the victim's last thread exited (kernel event)
    detect_s: float | None = None  # the exit time the supervisor itself recorded

    def after(self, ts_ns: int) -> float:
        return (ts_ns - self.t_mono_ns) / 1e9


def send_kill(victim: int) -> Kill:
    t_mono_ns, t_wall = time.monotonic_ns(), time.time()
    os.kill(victim, signal.SIGKILL)
    return Kill(victim, t_wall, t_mono_ns)


def kill_once(supervisor: int, victim: int, events: ProcEvents | None,
              timeout_s: float = 5.0) -> Kill:
    """SIGKILL `victim` and find its replacement, a new child of `supervisor`: from the kernel's
    events read after a quiet 50 ms, or by polling the supervisor's child list."""
    before = read_children(supervisor) | {victim}
    if events is not None:
        events.drain()  # older events
    k = send_kill(victim)
    deadline = time.monotonic() + timeout_s
    if events is None:
        while not (new := read_children(supervisor) - before):
            if time.monotonic() > deadline:
                raise BenchError(f"no replacement child of {supervisor} within {timeout_s:g}s")
            time.sleep(POLL_SLEEP_S)
        k.new_pid, k.respawn_s = min(new), time.time() - k.t_wall
        return k
    time.sleep(0.05)
    seen: list = []
    while True:
        seen += events.drain()
        forks = [e for e in seen if e[0] == ProcEvents.FORK and e[3] == supervisor
                 and e[4] == e[5] and e[1] >= k.t_mono_ns]  # a new process, not a thread
        exits = [e[1] for e in seen if e[0] == ProcEvents.EXIT and e[3] == victim]
        if forks and exits:
            break
        if time.monotonic() > deadline:
            raise BenchError(f"no fork/exit events for {victim} -> child of {supervisor} "
                             f"(event overruns: {events.overruns})")
        time.sleep(0.01)
    fork = min(forks, key=lambda e: e[1])
    k.new_pid, k.respawn_s, k.exit_s = fork[4], k.after(fork[1]), k.after(max(exits))
    return k


# --- engined ------------------------------------------------------------------------------------
class Engined(BenchDaemon):
    """engined with `replicas` echo engines (`echo-0` ...) started by exec, like the floor's (the
    fork server's restarts are bench.recovery's subject); immediate restarts, 1 s heartbeats."""

    def __init__(self, replicas: int, tracker: Tracker, http: str = "off") -> None:
        super().__init__("eb", tracker, [{"name": "echo", "replicas": replicas,
                                          "model": "builtin:echo", "launcher": "exec"}], http)


def engined_kill(daemon: Engined, events: ProcEvents | None) -> Kill:
    """Kill echo-0; its exit time from `last_exit.at`, read once it has respawned."""
    e = daemon.wait_ready(1)
    k = kill_once(daemon.pid, e["pid"], events)
    daemon.tracker.add(k.new_pid)

    def recorded() -> dict | None:
        x = daemon.engine()
        return x if x["last_exit"] and x["last_exit"]["at"] >= k.t_wall else None
    after = wait_until(recorded, 5.0, "last_exit of the killed incarnation")
    k.detect_s = after["last_exit"]["at"] - k.t_wall
    daemon.wait_ready(e["incarnation"] + 1)  # the next kill never meets a starting engine
    return k


def engined_kill_to_ready(daemon: Engined) -> float:
    """SIGKILL echo-0, sleep through the restart, then SIGKILL → READY from the daemon's own
    `since` of the new incarnation."""
    e = daemon.wait_ready(1)
    k = send_kill(e["pid"])
    time.sleep(0.4)
    new = daemon.wait_ready(e["incarnation"] + 1, interval_s=0.05)
    return new["since"] - k.t_wall


# --- the floor ----------------------------------------------------------------------------------
class Floor:
    """bench/core/floor.py as a separate process; its stdout lines are read by a thread."""

    def __init__(self, n: int, tracker: Tracker, listener: ReadyListener | None = None) -> None:
        self.n, self.tracker, self.listener = n, tracker, listener
        self.exits: dict[int, float] = {}
        self.spawns: dict[int, float] = {}
        self.ready = threading.Event()
        self.proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        argv, env = [], None
        if self.listener is not None:  # engined's echo engine child instead of a sleeper
            argv, env = [sys.executable, "-m", "engined.engine"], self.listener.child_env()
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.core.floor", str(self.n),
                                      *argv], cwd=ROOT, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, env=env)
        self.tracker.add(self.proc.pid)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        if not self.ready.wait(30):
            raise BenchError("the floor supervisor did not start")

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            parts = raw.decode().split()
            if parts[:1] == ["ready"]:
                self.ready.set()
            elif len(parts) == 3 and parts[0] in ("exit", "spawn"):
                pid, t = int(parts[1]), float(parts[2])
                (self.exits if parts[0] == "exit" else self.spawns)[pid] = t
                if parts[0] == "spawn":
                    self.tracker.add(pid)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def child(self) -> int:
        children = read_children(self.pid)
        if len(children) != 1:
            raise BenchError(f"the floor has children {children}, expected one")
        return children.pop()

    def kill(self, events: ProcEvents | None) -> Kill:
        victim = self.child()
        k = kill_once(self.pid, victim, events)
        wait_until(lambda: victim in self.exits and k.new_pid in self.spawns, 5.0,
                   "the floor's exit and spawn lines")
        k.detect_s = self.exits[victim] - k.t_wall
        return k

    def kill_to_ready(self) -> float:
        """SIGKILL the echo child → its replacement's READY arrives at the listener."""
        assert self.listener is not None
        self.listener.drain()
        k = send_kill(self.child())
        return self.listener.wait_ready(30) - k.t_wall

    def stop(self) -> None:
        terminate(self.proc, 10)
        if self._thread is not None:
            self._thread.join(5)


class ReadyListener:
    """The daemon's side of an echo engine's two channels, bound in a short scratch directory
    (`engined.engine.contract`'s endpoints): a PULL for control messages and a ROUTER on which
    the child sends READY. The floor respawns the child with the same config, so every
    incarnation has the same routing identity: ROUTER_HANDOVER gives it to the replacement."""

    def __init__(self, cleanup: Cleanup) -> None:
        import zmq

        from engined.engine.contract import control_endpoint, request_endpoint
        self.scratch = cleanup.scratch("ebf")
        self.control_endpoint = control_endpoint(self.scratch)
        self.request_endpoint = request_endpoint(self.scratch)
        self.ctx = zmq.Context()
        self.control = self.ctx.socket(zmq.PULL)
        self.requests = self.ctx.socket(zmq.ROUTER)
        self.requests.setsockopt(zmq.ROUTER_HANDOVER, 1)
        for sock, endpoint in ((self.control, self.control_endpoint),
                               (self.requests, self.request_endpoint)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.requests, zmq.POLLIN)
        cleanup.closers.append(self.close)

    def child_env(self) -> dict[str, str]:
        """A real echo engine's environment against these channels; like engined's children it
        finds the engine package, and nothing else of ours, on its PYTHONPATH."""
        from engined.engine.contract import ENV_CONFIG
        from engined.engine.protocol import EngineConfig, encode_config
        config = EngineConfig(
            name="floor-0", group="floor", rank=0, replicas=1, incarnation=1,
            model="builtin:echo", dtype=None, gpus=[], data_parallel=False, max_batch_size=8,
            threads=1, control_endpoint=self.control_endpoint,
            request_endpoint=self.request_endpoint, heartbeat_interval_s=1.0)
        env = without_engined_vars()  # ENGINED_PARENT_PID included: the parent is not engined
        env.update({ENV_CONFIG: encode_config(config),
                    "PYTHONPATH": expose_engine_package(self.scratch / "python"),
                    "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
        return env

    def drain(self) -> None:
        import zmq
        for sock in (self.control, self.requests):
            while sock.poll(0):
                sock.recv_multipart(zmq.NOBLOCK)

    def wait_ready(self, timeout_s: float) -> float:
        """Block (no spinning) until a READY arrives; its arrival time (time.time())."""
        from engined.engine.protocol import Ready, decode_request
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self.poller.poll(left * 1000):
                frames = self.requests.recv_multipart()
                now = time.time()
                if len(frames) == 2 and isinstance(decode_request(frames[1]), Ready):
                    return now
        raise BenchError("the floor's echo engine sent no READY")

    def close(self) -> None:
        self.control.close(0)
        self.requests.close(0)
        self.ctx.term()
