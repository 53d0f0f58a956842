"""Core supervision benchmark: engined against the pidfd floor (bench/floor.py).

    python -m bench.core [--quick] [--out FILE]   # default bench/results/core.md,
                                                  # --quick: bench/results/core-quick.md

Scenarios (see bench/README.md): 1 detection latency, 2 respawn latency, 3 kill -> READY,
4 idle overhead. Prints markdown tables and writes the same markdown to --out.
Every process started here is tracked by pid and cleaned up by pid (never by name).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import psutil

from bench.common import (
    ROOT,
    BenchDaemon,
    BenchError,
    Cleanup,
    Tracker,
    cpu_s,
    engine_processes,
    expose_engine_package,
    read_children,
    terminate,
    wait_until,
    without_engined_vars,
)
from bench.report import (
    Report,
    add_out_option,
    dist_row,
    machine_lines,
    machine_load,
    med,
    ms,
    out_path,
    table,
    title,
)

TARGETS = {  # the targets: (label, limit, unit)
    "detect": ("detection median", 2.0, "ms"),
    "respawn": ("respawn median", 5.0, "ms"),
    "ready": ("kill → READY median", 100.0, "ms"),
    "cpu": ("idle CPU (20 engines)", 1.0, "% of one core"),
    "rss": ("idle RSS peak (20 engines)", 60.0, "MB"),
}
POLL_SLEEP_S = 50e-6  # between /proc reads of the polling fallback
SETTLE_S = 0.1  # after READY / respawn, before the next kill: let the new child finish starting


def stats_row(name: str, samples: list[float]) -> str:
    """`| name | median | min–max | n |` in milliseconds."""
    return dist_row(name, samples, 2, "ms", 1e3)


# --- engined ------------------------------------------------------------------------------------
class Engined(BenchDaemon):
    """engined with `replicas` echo engines (`echo-0` ...), in /tmp/ebXXXXXXXX (testkit/driver.py's
    Daemon through bench.common.BenchDaemon: immediate restarts, 1 s heartbeats)."""

    def __init__(self, replicas: int, tracker: Tracker, http: str = "off") -> None:
        super().__init__("eb", tracker,
                         # exec, like the floor: each restart is a fresh interpreter (the fork
                         # server's restarts are bench.recovery's subject)
                         [{"name": "echo", "replicas": replicas, "model": "builtin:echo",
                           "launcher": "exec"}], http)


# --- floor --------------------------------------------------------------------------------------
class Floor:
    """bench/floor.py as a separate process; its stdout lines are collected by a reader thread."""

    def __init__(self, n: int, tracker: Tracker, argv: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.n = n
        self.tracker = tracker
        self.argv = argv or []  # empty: floor.py's default sleeping interpreter
        self.env = env
        self.exits: dict[int, float] = {}
        self.spawns: dict[int, float] = {}
        self.ready = threading.Event()
        self.proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.floor", str(self.n), *self.argv],
                                     cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     env=self.env)
        self.tracker.add(self.proc.pid)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        if not self.ready.wait(30):
            raise BenchError("floor supervisor did not start")

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

    def stop(self) -> None:
        terminate(self.proc, 10)
        if self._thread is not None:
            self._thread.join(5)


# --- measurements -------------------------------------------------------------------------------
class ProcEvents:
    """Kernel process events from the netlink proc connector: exact and passive.

    The kernel stamps every fork, exec and exit with CLOCK_MONOTONIC (ns) and queues it on this
    socket, so the bench can sleep through a kill and read afterwards what happened when: nothing
    spins or polls while the supervisor detects and respawns. Needs CAP_NET_ADMIN (root) and the
    initial network namespace; `open()` returns None where it is not available.
    """

    FORK, EXEC, EXIT = 0x1, 0x2, 0x80000000
    _NETLINK_CONNECTOR, _CN_IDX_PROC, _CN_VAL_PROC, _LISTEN, _IGNORE = 11, 1, 1, 1, 2

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, self._NETLINK_CONNECTOR)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        self.sock.bind((0, self._CN_IDX_PROC))
        self._control(self._LISTEN)
        self.overruns = 0

    def _control(self, op: int) -> None:
        payload = struct.pack("=I", op)
        cn = struct.pack("=IIIIHH", self._CN_IDX_PROC, self._CN_VAL_PROC, 0, 0, len(payload),
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
        deadline = time.monotonic() + 1.0
        seen = []
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
    respawn_s: float | None = None  # the replacement exists (fork; or first seen by the poller)
    exec_s: float | None = None  # the replacement exec'd (kernel event)
    exit_s: float | None = None  # the victim's last thread exited (kernel event)
    detect_s: float | None = None  # the exit time the supervisor itself recorded
    notify_s: float | None = None  # a listener outside the supervisor was told (bench.compare)
    polls: int = 0

    def after(self, ts_ns: int) -> float:
        return (ts_ns - self.t_mono_ns) / 1e9


def send_kill(victim: int) -> Kill:
    t_mono_ns, t_wall = time.monotonic_ns(), time.time()
    os.kill(victim, signal.SIGKILL)
    return Kill(victim, t_wall, t_mono_ns)


def kill_and_read_events(supervisor_pid: int, victim: int, events: ProcEvents,
                         quiet_s: float = 0.05, timeout_s: float = 5.0) -> Kill:
    """SIGKILL, sleep through the supervisor's reaction, then read the kernel's account of it."""
    events.drain()  # older events
    k = send_kill(victim)
    time.sleep(quiet_s)
    seen: list = []
    deadline = time.monotonic() + timeout_s
    while True:
        seen += events.drain()
        forks = [e for e in seen if e[0] == ProcEvents.FORK and e[3] == supervisor_pid
                 and e[4] == e[5] and e[1] >= k.t_mono_ns]  # a new process, not a thread
        exits = [e[1] for e in seen if e[0] == ProcEvents.EXIT and e[3] == victim]
        if forks and exits:
            break
        if time.monotonic() > deadline:
            raise BenchError(f"no fork/exit events for {victim} -> child of {supervisor_pid} "
                             f"(event overruns: {events.overruns})")
        time.sleep(0.01)
    fork = min(forks, key=lambda e: e[1])
    k.new_pid, k.respawn_s, k.exit_s = fork[4], k.after(fork[1]), k.after(max(exits))
    execs = [e[1] for e in seen if e[0] == ProcEvents.EXEC and e[3] == k.new_pid]
    k.exec_s = k.after(min(execs)) if execs else None
    return k


def kill_and_poll(supervisor_pid: int, victim: int, timeout_s: float = 5.0) -> Kill:
    """Fallback without the proc connector: poll the supervisor's children list.

    A read, then a 50 µs sleep: a pure spin slows the very exit it watches on a small machine
    (os.kill() wakes the victim on the killer's CPU, behind the spinner), and SCHED_IDLE starves
    the observer when others load the machine; a short sleep avoids both at ~0.1 ms resolution.
    """
    before = read_children(supervisor_pid) | {victim}
    k = send_kill(victim)
    deadline = k.t_wall + timeout_s
    while True:
        k.polls += 1
        new = read_children(supervisor_pid) - before
        now = time.time()
        if new:
            k.new_pid, k.respawn_s = min(new), now - k.t_wall
            return k
        if now > deadline:
            raise BenchError(f"no replacement child of {supervisor_pid} within {timeout_s:g}s")
        time.sleep(POLL_SLEEP_S)


def poll_cost_s() -> float:
    """One read_children() plus the sleep: the resolution of the polling fallback."""
    pid = os.getpid()
    n, started = 500, time.perf_counter()
    for _ in range(n):
        read_children(pid)
        time.sleep(POLL_SLEEP_S)
    return (time.perf_counter() - started) / n


def kill_once(supervisor_pid: int, victim: int, events: ProcEvents | None,
              timeout_s: float = 5.0) -> Kill:
    return (kill_and_read_events(supervisor_pid, victim, events, timeout_s=timeout_s)
            if events is not None else kill_and_poll(supervisor_pid, victim, timeout_s))


def engined_kill_once(daemon: Engined, tracker: Tracker, events: ProcEvents | None) -> Kill:
    """Scenarios 1 and 2 for engined: kill echo-0; read last_exit.at once it has respawned."""
    e = daemon.wait_ready(1)
    k = kill_once(daemon.pid, e["pid"], events)
    tracker.add(k.new_pid)

    # last_exit is recorded before the respawn, so it is there by now: nothing talked to the
    # daemon while it detected and respawned.
    def recorded():
        x = daemon.engine()
        return x if x["last_exit"] and x["last_exit"]["at"] >= k.t_wall else None
    after = recorded() or wait_until(recorded, 5.0, "last_exit of the killed incarnation")
    if after["last_exit"]["signal"] != "SIGKILL":
        raise BenchError(f"unexpected last_exit {after['last_exit']}")
    k.detect_s = after["last_exit"]["at"] - k.t_wall
    daemon.wait_ready(e["incarnation"] + 1)  # so the next kill never meets a starting engine
    return k


def floor_kill_once(floor: Floor, events: ProcEvents | None) -> Kill:
    children = read_children(floor.pid)
    if len(children) != 1:
        raise BenchError(f"floor has children {children}, expected one")
    victim = children.pop()
    k = kill_once(floor.pid, victim, events)
    wait_until(lambda: victim in floor.exits and k.new_pid in floor.spawns, 5.0,
               "floor exit/spawn lines")
    k.detect_s = floor.exits[victim] - k.t_wall
    return k


class ReadyListener:
    """The floor's stand-in for engined's two engine channels, bound in its own short scratch
    directory as the daemon binds them (`engined.engine.contract`'s endpoints): a PULL for the
    control channel (Hello, Progress, Heartbeat, Goodbye) and a ROUTER for the request channel,
    on which an echo engine child sends its READY. The floor's child thus runs against a live
    peer, and the bench sees its READY arrive.

    The floor respawns the child with the same config, so every incarnation has the same routing
    identity: ROUTER_HANDOVER lets the replacement's connection take it over from the dead one.
    """

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

    def drain(self) -> None:
        """Drop what has arrived on both channels so far."""
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


def floor_kill_to_ready(floor: Floor, listener: ReadyListener) -> dict:
    children = read_children(floor.pid)
    if len(children) != 1:
        raise BenchError(f"floor has children {children}, expected one")
    listener.drain()
    k = send_kill(children.pop())
    return {"since_s": listener.wait_ready(30) - k.t_wall}


def engine_child_env(listener: ReadyListener) -> dict[str, str]:
    """Environment for running a real echo engine (`python -m engined.engine`) outside engined,
    against `listener`'s channels. Like engined's own children it gets the engine package, and
    nothing else of ours, through `expose_engine_package`'s directory on PYTHONPATH."""
    from engined.engine.contract import ENV_CONFIG
    from engined.engine.protocol import EngineConfig, encode_config
    config = EngineConfig(
        name="floor-0", group="floor", rank=0, replicas=1, incarnation=1, model="builtin:echo",
        dtype=None, gpus=[], data_parallel=False, max_batch_size=8, threads=1,
        control_endpoint=listener.control_endpoint, request_endpoint=listener.request_endpoint,
        heartbeat_interval_s=1.0)
    env = without_engined_vars()  # ENGINED_PARENT_PID included: the parent is not engined
    env.update({ENV_CONFIG: encode_config(config),
                "PYTHONPATH": expose_engine_package(listener.scratch / "python"),
                "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    return env


def engined_kill_to_ready(daemon: Engined, tracker: Tracker, poll_s: float | None) -> dict:
    """Scenario 3: kill echo-0 and wait for READY with a new incarnation.

    poll_s None: quiet; sleep through the restart, then read the daemon's READY time (`since`).
    Otherwise GET /v1/status every poll_s and note when READY is first seen.
    """
    e = daemon.wait_ready(1)
    old_inc = e["incarnation"]
    k = send_kill(e["pid"])
    deadline = k.t_wall + 30
    if poll_s is None:
        time.sleep(0.4)
    while True:
        e = daemon.engine()
        if e["state"] == "READY" and e["incarnation"] > old_inc:
            seen = time.time()
            break
        if e["state"] == "FAILED" or time.time() > deadline:
            raise BenchError(f"echo-0 not READY after kill: {e}\n{daemon.log_tail()}")
        time.sleep(poll_s or 0.05)
    tracker.add(e["pid"])
    return {"since_s": e["since"] - k.t_wall, "seen_s": seen - k.t_wall,
            "startup_s": e["startup_s"], "incarnations": e["incarnation"] - old_inc}


def idle(daemon: Engined, floor: Floor, duration_s: float) -> dict:
    """Scenario 4: nobody talks to the daemon; sample its CPU times and RSS once a second."""
    time.sleep(2.0)  # let the last engine's READY and first heartbeats pass
    d, f = psutil.Process(daemon.pid), psutil.Process(floor.pid)
    rss = [d.memory_info().rss]
    c0, f0, w0 = cpu_s(d), cpu_s(f), time.monotonic()
    deadline = w0 + duration_s
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(1.0, left))
        rss.append(d.memory_info().rss)
    c1, f1, w1 = cpu_s(d), cpu_s(f), time.monotonic()
    children = engine_processes(d)
    return {"wall_s": w1 - w0, "cpu_s": c1 - c0, "cpu_pct": 100 * (c1 - c0) / (w1 - w0),
            "rss_peak": max(rss), "rss_first": rss[0], "rss_last": rss[-1], "samples": len(rss),
            "floor_cpu_pct": 100 * (f1 - f0) / (w1 - w0), "floor_rss": f.memory_info().rss,
            "engine_rss_median": statistics.median(c.memory_info().rss for c in children),
            "engines": len(children)}


# --- report -------------------------------------------------------------------------------------
def verdict(key: str, value: float) -> str:
    return "PASS" if value < TARGETS[key][1] else "MISS"


def breakdown_rows(name: str, kills: list[Kill]) -> str:
    """Split one supervisor's kills at the kernel's exit event of the victim."""
    def between(a, b):
        return [getattr(k, b) - getattr(k, a) for k in kills
                if getattr(k, a) is not None and getattr(k, b) is not None]
    return (f"| {name} | {ms(med([k.exit_s for k in kills]))} | "
            f"{ms(med(between('exit_s', 'detect_s')))} | "
            f"{ms(med(between('exit_s', 'respawn_s')))} | "
            f"{ms(med(between('respawn_s', 'exec_s')))} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.core",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="n=5 kills, 10 s idle")
    add_out_option(parser, "core")
    parser.add_argument("-n", type=int, default=None, help="kills per latency scenario")
    parser.add_argument("--idle", type=float, default=None, help="idle window in seconds")
    parser.add_argument("--no-proc-events", action="store_true",
                        help="use the polling /proc observer even where the proc connector works")
    args = parser.parse_args(argv)
    n = args.n or (5 if args.quick else 30)
    idle_s = args.idle or (10.0 if args.quick else 60.0)
    out = out_path(args, "core")

    r = Report()
    tracker = Tracker()
    cleanup = Cleanup(tracker)
    res: dict = {}
    events = None if args.no_proc_events else ProcEvents.open()
    if events is not None:
        cleanup.closers.append(events.close)
    r(title("engined core benchmark", args.quick), "", *machine_lines(),
      f"- kills per latency scenario: n={n}; idle window: {idle_s:g} s",
      "- observer: " + ("kernel proc events (netlink proc connector), passive" if events else
                        "polling /proc/<pid>/task/<pid>/children (no proc connector here)"),
      "")
    load_start, cpu_start = os.getloadavg(), psutil.cpu_times()
    try:
        spin_s = poll_cost_s()

        # Scenarios 1-2: the three supervisors run side by side and are killed in turn, so slow
        # phases of the machine hit them alike.
        listener = ReadyListener(cleanup)
        floor = Floor(1, tracker)
        floor_engine = Floor(1, tracker, [sys.executable, "-m", "engined.engine"],
                             engine_child_env(listener))
        daemon = Engined(1, tracker)
        for thing in (floor, floor_engine, daemon):
            cleanup.start(thing)
        fs, fe, en = [], [], []
        for _ in range(n):
            for target, samples in ((floor, fs), (floor_engine, fe), (daemon, en)):
                time.sleep(SETTLE_S)
                samples.append(engined_kill_once(daemon, tracker, events) if target is daemon
                               else floor_kill_once(target, events))
        res.update(floor=fs, floor_engine=fe, engined=en)
        cleanup.stop(floor)

        # Scenario 3: quiet kills (engined and the floor's echo engine in turn), then kills
        # watched by a 1 ms status poller.
        quiet, polled, floor_ready = [], [], []
        for _ in range(n):
            time.sleep(SETTLE_S)
            quiet.append(engined_kill_to_ready(daemon, tracker, None))
            time.sleep(SETTLE_S)
            floor_ready.append(floor_kill_to_ready(floor_engine, listener))
        cleanup.stop(floor_engine)
        daemon.status_times.clear()
        for _ in range(n):
            time.sleep(SETTLE_S)
            polled.append(engined_kill_to_ready(daemon, tracker, 0.001))
        status_1 = statistics.median(daemon.status_times)
        res.update(ready_quiet=quiet, ready_polled=polled, ready_floor=floor_ready)
        cleanup.stop(daemon)
        if daemon.stop_note:
            r(f"> {daemon.stop_note}")
        daemon.remove_dir()

        # Scenario 4.
        big = Engined(20, tracker)
        floor20 = Floor(20, tracker)
        t0 = time.monotonic()
        cleanup.start(big)
        fleet_start_s = time.monotonic() - t0
        cleanup.start(floor20)
        res["idle"] = idle(big, floor20, idle_s)
        big.status_times.clear()
        for _ in range(20):
            big.status()
        status_20 = statistics.median(big.status_times)
        cleanup.stop(floor20)
        cleanup.stop(big)
        if big.stop_note:
            r(f"> {big.stop_note}")
        big.remove_dir()
        leftovers = tracker.kill_leftovers()
    finally:
        cleanup.close()
    overruns = events.overruns if events is not None else 0

    r(machine_load(load_start, cpu_start) + " Other work on a shared machine inflates the "
      "latencies; compare engined with the floor rows, which ran side by side with it.", "")
    fl, fe, en = res["floor"], res["floor_engine"], res["engined"]
    quiet, polled, idl = res["ready_quiet"], res["ready_polled"], res["idle"]
    floor_ready = res["ready_floor"]
    respawn_how = ("the kernel's fork event of the replacement (parent = the supervisor)"
                   if events else "the first time the polling observer saw the new pid")
    r("## 1. Detection latency (SIGKILL → exit recorded by the supervisor)", "",
      *table("supervisor", "median", "min–max", "n"),
      stats_row("engined, echo engine (`last_exit.at`)", [k.detect_s for k in en]),
      stats_row("floor, echo engine child (`exit` line)", [k.detect_s for k in fe]),
      stats_row("floor, sleeping child (`exit` line)", [k.detect_s for k in fl]), "",
      "The floor running the very same `python -m engined.engine` child shows what the kernel's "
      "teardown of the killed process (threads, sockets, memory) costs before any supervisor "
      "can see the exit.", "")
    r("## 2. Respawn latency (SIGKILL → replacement process exists)", "",
      *table("supervisor", "median", "min–max", "n"),
      stats_row("engined, echo engine", [k.respawn_s for k in en]),
      stats_row("floor, echo engine child", [k.respawn_s for k in fe]),
      stats_row("floor, sleeping child", [k.respawn_s for k in fl]), "",
      f"\"Exists\" = {respawn_how}. psutil's create_time has 10 ms resolution, so it is not "
      "used." + ("" if events else
                 f" One poll (a /proc read and a {POLL_SLEEP_S * 1e6:.0f} µs sleep) takes "
                 f"{spin_s * 1e6:.0f} µs (the resolution); median "
                 f"{med([k.polls for k in en]):.0f} reads per engined respawn."), "")
    if events:
        r("### Where the time goes (medians, from the kernel's exit event of the victim)", "",
          "| supervisor | SIGKILL → victim gone (kernel) | gone → exit recorded | "
          "gone → replacement forked | forked → exec'd |", "| --- | --- | --- | --- | --- |",
          breakdown_rows("engined, echo engine", en),
          breakdown_rows("floor, echo engine child", fe),
          breakdown_rows("floor, sleeping child", fl), "")
    r("## 3. Kill → READY (echo engine)", "",
      *table("measure", "median", "min–max", "n"),
      stats_row("engined, quiet observer: SIGKILL → READY (daemon's `since`)",
                [x["since_s"] for x in quiet]),
      stats_row("  of which spawn → READY (`startup_s`)", [x["startup_s"] for x in quiet]),
      stats_row("engined, status polled every 1 ms: SIGKILL → READY (`since`)",
                [x["since_s"] for x in polled]),
      stats_row("engined, status polled every 1 ms: READY first seen by the poller",
                [x["seen_s"] for x in polled]),
      stats_row("floor, echo engine child: SIGKILL → its READY received by the bench",
                [x["since_s"] for x in floor_ready]), "",
      f"One `GET /v1/status` round trip: median {status_1 * 1e3:.2f} ms while polling "
      f"(1 engine), {status_20 * 1e3:.2f} ms with 20 engines (after scenario 4).", "")
    r(f"## 4. Idle overhead ({idl['engines']} echo engines, 1 s heartbeats, "
      f"{idl['wall_s']:.0f} s idle)", "",
      *table("measure", "engined daemon", "floor (20 sleeping children)"),
      f"| CPU (user+sys) | {idl['cpu_pct']:.3f} % of one core ({idl['cpu_s']:.3f} s) | "
      f"{idl['floor_cpu_pct']:.3f} % |",
      f"| RSS peak ({idl['samples']} samples, 1/s) | {idl['rss_peak'] / 1e6:.1f} MB "
      f"({idl['rss_peak'] / 2**20:.1f} MiB; first {idl['rss_first'] / 1e6:.1f}, last "
      f"{idl['rss_last'] / 1e6:.1f} MB) | {idl['floor_rss'] / 1e6:.1f} MB |",
      f"| per engine child RSS (median) | {idl['engine_rss_median'] / 1e6:.1f} MB | |", "",
      f"20-engine fleet start (spawn → all READY, as seen by polling): {fleet_start_s:.2f} s.",
      "")

    values = {"detect": med([k.detect_s for k in en]) * 1e3,
              "respawn": med([k.respawn_s for k in en]) * 1e3,
              "ready": med([x["since_s"] for x in quiet]) * 1e3,
              "cpu": idl["cpu_pct"], "rss": idl["rss_peak"] / 1e6}
    floor_values = {"detect": f"{med([k.detect_s for k in fe]) * 1e3:.2f} ms",
                    "respawn": f"{med([k.respawn_s for k in fe]) * 1e3:.2f} ms",
                    "ready": f"{med([x['since_s'] for x in floor_ready]) * 1e3:.2f} ms",
                    "cpu": f"{idl['floor_cpu_pct']:.3f} %",
                    "rss": f"{idl['floor_rss'] / 1e6:.1f} MB"}
    r("## Summary", "", "Floor column: the floor supervising the same echo engine child "
      "(latencies) or 20 sleeping children (idle).", "",
      *table("metric", "target", "engined", "floor", "result"))
    for key, (label, limit, unit) in TARGETS.items():
        shown = f"{values[key]:.3f} %" if key == "cpu" else (
            f"{values[key]:.1f} MB" if key == "rss" else f"{values[key]:.2f} ms")
        r(f"| {label} | < {limit:g} {unit} | {shown} | {floor_values[key]} | "
          f"{verdict(key, values[key])} |")
    r("", "## Method", "",
      "- engined runs as `python -m engined.supervisor.daemon -c SPEC` (log level INFO, stderr "
      "to a file) with `http: off`, a runtime dir `/tmp/ebXXXXXXXX/rt`, `builtin:echo` engines "
      "started by exec (`launcher: exec`, like the floor's; bench.recovery measures the fork "
      "server), "
      "1 s heartbeats, and `backoff: {initial: 0s, max: 0s, reset_after: 0s}`, "
      "`start_limit.burst: 1000000`, so every restart is immediate (no backoff, never FAILED).",
      "- The floor is `bench/floor.py` (~40 lines: asyncio, pidfd, posix_spawn; respawns at "
      "once), run as its own process, once with a sleeping Python child and once with a real "
      "`python -m engined.engine` echo child whose engine channels the bench binds as engined "
      "does (a ZeroMQ PULL for its control messages, a ROUTER on which its READY arrives).",
      f"- Each kill: wait until READY (floor: respawned) plus {SETTLE_S * 1e3:.0f} ms; take "
      "`t_kill` (time.time() and CLOCK_MONOTONIC) just before `os.kill(pid, SIGKILL)`. In "
      "scenarios 1-2 engined and both floors run side by side and are killed in turn.",
      "- Observer: " + (
          "the kernel's proc connector (netlink) records fork/exec/exit with CLOCK_MONOTONIC "
          "stamps; the bench sleeps through each kill and reads them afterwards, so nothing "
          "polls or spins while a supervisor detects and respawns. (A spinning observer "
          "measurably slows the victim's exit on a small machine: wake-affine scheduling puts "
          "the killed task on the spinner's CPU.)" if events else
          "no proc connector (it needs root): the bench polls the supervisor's kernel "
          "children list (`/proc/<pid>/task/<pid>/children`, a read then a 50 µs sleep) and "
          "takes the first time it sees the new pid."),
      "- Detection = the supervisor's own recorded exit time minus t_kill (engined: "
      "`last_exit.at` from `GET /v1/status`, read after the respawn; floor: its `exit` line). "
      "It includes the kernel's teardown of the killed process.",
      "- Kill → READY: the value is the daemon's own READY transition time (`since` of the new "
      "incarnation) minus t_kill; the quiet series reads it once after 0.4 s, the polled "
      "series asks `GET /v1/status` every ~1 ms and also shows when the poller saw READY.",
      "- Idle: after all 20 engines are READY and 2 s of settling, nobody calls the daemon; "
      "CPU = its `cpu_times()` user+sys delta / wall time; RSS sampled every second "
      "(MB = 10^6 bytes). The floor with 20 children runs alongside for reference.",
      f"- Cleanup: SIGTERM to each supervisor, wait, SIGKILL leftovers by pid; leftover "
      f"processes after the clean shutdowns: {leftovers or 'none'}"
      + (f"; proc-event overruns: {overruns}." if events else "."))

    r.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
