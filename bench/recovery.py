"""Fast recovery: engines forked from a preloaded fork server against engines started by exec.

    python -m bench.recovery [--quick] [--out FILE] [-n KILLS] [--vllm-python PATH]
                                       # default bench/results/recovery.md,
                                       # --quick: bench/results/recovery-quick.md

For tiny-llama (`builtin:tiny-llama`, transformers) and for the vLLM backend (`backend: vllm`
under its own interpreter), two daemons run side by side that differ only in the engines'
`launcher:` (exec | forkserver), each with one group of 2 replicas:

1. Crash → READY: SIGKILL of replica 0's engine → READY again with a higher incarnation (the
   daemon's own `since`, and when a 20 ms status poll saw it), and → the first token served: a
   `POST /v1/generate` (max_tokens 1, to that replica by name) sent over the control socket right
   after the kill and resent every 10 ms while it answers 503. Kills alternate between the two
   daemons (exec first on even rounds, forkserver first on odd ones), so load hits both alike.
2. Memory: RSS, USS and PSS (psutil `memory_full_info`) of every engine and of the fork server,
   after each replica has served a request: forked engines share the preloaded stack with the
   server and with each other copy-on-write.
3. Startup: daemon start → both replicas READY, each replica's `startup_s` (spawn → READY) at
   first start and after a kill, the fork server's own preload (`import_s`).
4. Warm standby promotion, in a third daemon per backend (1 serving replica, `standby: 1`,
   forkserver): SIGKILL of the serving replica → READY under its name (the standby's engine
   promoted) and → its first token, → a new standby READY; with a floor: the kernel's teardown
   of a bare process that maps as much memory as the victim did (SIGKILL → its pidfd readable).
   Only where the spec has a `standby` key (otherwise the row says it is not built yet).

A summary table holds the targets: tiny-llama through the fork server READY again ≤ 0.25 s
(median), the vLLM backend through the fork server ≤ 40 % of exec's crash → READY, and warm
standby promotion ≤ 20 ms.

The vLLM interpreter: --vllm-python, else $ENGINED_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python
(a worktree without its own: set ENGINED_VLLM_PYTHON); without one the vLLM part is skipped and
the report says so. Every process is tracked and stopped by pid (SIGTERM,
wait, SIGKILL); nothing is killed by name. Nothing here asserts wall-clock speed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psutil
from driver import is_engine_of

from bench.common import (
    HEARTBEATS,
    ROOT,
    BenchDaemon,
    BenchError,
    Cleanup,
    KeepAlive,
    Tracker,
    terminate,
)
from bench.models import build_checkpoint
from bench.report import (
    Report,
    cpu_busy_pct,
    default_out,
    engined_revision,
    machine_lines,
    med,
    table,
)
from bench.vllm.engine import engine_spec as vllm_engine_spec
from bench.vllm.engine import serve_env, vllm_versions

LAUNCHERS = ("exec", "forkserver")
REPLICAS = 2  # per daemon: sharing between forked siblings shows in their PSS
SETTLE_S = 0.5  # after READY (and the other daemon's restart) before a kill
POLL_S = 0.01  # generate retries; status every STATUS_EVERY-th round
STATUS_EVERY = 2  # → a 20 ms status poll
PROMPT = "recovery benchmark: the quick brown fox"
TINY_TARGET_S = 0.25  # tiny-llama through the fork server: crash → READY median
VLLM_TARGET_RATIO = 0.40  # the vLLM backend: forkserver / exec crash → READY medians
STANDBY_TARGET_S = 0.020  # warm standby promotion
VLLM_PYTHON_ENV = "ENGINED_VLLM_PYTHON"
MB = 1e6


# --- the two backends ---------------------------------------------------------------------------
@dataclass
class Backend:
    key: str  # "tiny" | "vllm"
    label: str
    spec: dict[str, Any]  # the engine group, without `launcher`
    start_timeout_s: float
    ready_timeout_s: float  # one restart

    @property
    def group(self) -> str:
        return str(self.spec["name"])


def tiny_backend(cache: Path) -> Backend:
    """bench/llm.py's replica (1 thread, max_batch_size 8), two of them."""
    return Backend("tiny", "tiny-llama (transformers)", {
        "name": "tiny", "replicas": REPLICAS, "model": "builtin:tiny-llama", "max_batch_size": 8,
        "threads": 1, "env": {"ENGINED_CACHE_DIR": str(cache)}}, 300.0, 120.0)


def vllm_backend(python: str, cache: Path) -> Backend:
    """bench/vllm.py's engine (etc/examples/vllm-cpu.yaml's: enforce_eager, max_model_len 1024,
    VLLM_CPU_KVCACHE_SPACE=1; 1 thread, max_batch_size 8), two replicas."""
    spec = {**vllm_engine_spec(python, cache), "replicas": REPLICAS}
    return Backend("vllm", "vLLM backend (`backend: vllm`)", spec, 600.0, 300.0)


def default_vllm_python() -> str:
    """Not resolved: a venv's python is a symlink, and the venv is only a venv through it."""
    if os.environ.get(VLLM_PYTHON_ENV):
        return os.path.abspath(os.environ[VLLM_PYTHON_ENV])
    return str(ROOT / ".venv-vllm" / "bin" / "python")


def warm_vllm_imports(python: str) -> float:
    """One untimed `import vllm` in a throwaway process: the page cache holds vLLM's files
    before either daemon starts (the first daemon would read them from disk otherwise)."""
    started = time.monotonic()
    done = subprocess.run([python, "-c", "import vllm.v1.engine.llm_engine"], cwd="/tmp",
                          env=serve_env(), capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise BenchError(f"`import vllm` failed in {python}:\n{done.stderr[-2000:]}")
    return time.monotonic() - started


# --- the daemon ---------------------------------------------------------------------------------
class Daemon(BenchDaemon):
    """engined with one group of 2 replicas of `backend`, every engine's `launcher:` pinned, in
    /tmp/erXXXXXXXX (tests/driver.py's Daemon through bench.common.BenchDaemon: immediate
    restarts, 1 s heartbeats)."""

    log_lines = 30

    def __init__(self, backend: Backend, launcher: str, tracker: Tracker,
                 standby: int = 0) -> None:
        """`standby`: 1 serving replica and that many warm standbys instead of 2 replicas."""
        self.backend, self.launcher = backend, launcher
        spec = {**backend.spec, "launcher": launcher}
        if standby:
            spec.update(replicas=1, standby=standby)
        super().__init__("er", tracker, [spec], status_timeout_s=10.0)
        self.replicas = spec["replicas"] + standby  # every engine, spares included
        self.log_engines = (f"{backend.group}-0",) + (
            ("forkserver",) if launcher == "forkserver" else ())
        self.server_pids: set[int] = set()
        self.start_wall_s: float | None = None

    def start(self, timeout_s: float | None = None, interval_s: float = 0.05) -> None:
        started = time.monotonic()
        super().start(timeout_s or self.backend.start_timeout_s, interval_s)
        self.start_wall_s = time.monotonic() - started
        self.fork_servers()

    def wait_ready(self, min_incarnation: int, timeout_s: float | None = None,
                   interval_s: float = 0.02, name: str | None = None) -> dict[str, Any]:
        return super().wait_ready(min_incarnation, timeout_s or self.backend.ready_timeout_s,
                                  interval_s, name)

    def fork_servers(self, status: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """`supervisor.fork_servers` (every pid seen goes to the tracker)."""
        servers = list((status or self.status())["supervisor"].get("fork_servers") or [])
        for s in servers:
            if s.get("pid"):
                self.server_pids.add(s["pid"])
                self.tracker.add(s["pid"])
        return servers

    def child_load_s(self, name: str, incarnation: int) -> float | None:
        """The child's own build → warm-up time, from its `[ready]` log line."""
        pattern = rf"^\[ready\] {re.escape(name)} incarnation (\d+) loaded in ([0-9.]+)s"
        for inc, load_s in re.findall(pattern, self.log_text(name), re.M):
            if int(inc) == incarnation:
                return float(load_s)
        return None


class Generate(KeepAlive):
    """`POST /v1/generate` on one keep-alive connection to the control socket."""

    def __init__(self, socket_path: str, timeout_s: float = 120.0) -> None:
        super().__init__(socket_path, timeout_s)

    def once(self, engine: str, max_tokens: int = 1) -> tuple[int, dict[str, Any]]:
        body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "engine": engine,
                           "timeout_s": self.timeout_s - 10}).encode()
        status, data = self.round_trip("POST", "/v1/generate", body,
                                       {"Content-Type": "application/json"})
        try:
            parsed = json.loads(data or b"{}")
        except ValueError:
            parsed = {"raw": data[:200].decode(errors="replace")}
        return status, parsed if isinstance(parsed, dict) else {"raw": parsed}


# --- 1. crash → READY, → first token ------------------------------------------------------------
@dataclass
class Kill:
    ready_s: float  # SIGKILL → the daemon's READY (`since`)
    seen_s: float  # → a status poll saw it
    served_s: float  # → the first generate answered (max_tokens 1)
    detect_s: float | None  # → exit recorded (`last_exit.at`)
    startup_s: float | None  # the new incarnation's spawn → READY
    load_s: float | None  # the child's own build → warm-up (`[ready]` line)
    launcher: str  # what started the new incarnation
    attempts: int  # generate requests sent until one was served
    answer_s: float | None  # the answered request's time in the daemon (`total_s`)
    server_pid: int | None = None  # forkserver: the server that forked it (unchanged?)


def victim_of(d: Daemon, name: str) -> tuple[dict[str, Any], psutil.Process]:
    """`name` READY, settled, its pid checked to be an engine of `d` and no fork server (its
    USS, MB, in the returned status as `uss_mb`: what the kernel frees when it dies)."""
    old = d.wait_ready(1, name=name)
    time.sleep(SETTLE_S)
    old = d.engine(name)
    if old["state"] != "READY":
        old = d.wait_ready(old["incarnation"], name=name)
    pid = old["pid"]
    if pid in d.server_pids or not is_engine_of(pid, d.pid):
        raise BenchError(f"{name} pid {pid} is not an engine of daemon {d.pid}")
    victim = psutil.Process(pid)
    info = victim.memory_full_info()
    old["uss_mb"], old["rss_mb"] = info.uss / MB, info.rss / MB
    old["huge_mb"] = huge_pages_mb(pid)
    return old, victim


def huge_pages_mb(pid: int) -> float | None:
    """Anonymous memory in transparent huge pages (cheaper to free than 4 KiB pages)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024 / MB
    except OSError:
        pass
    return None


def recover(d: Daemon, gen: Generate, name: str, old: dict[str, Any], t_kill: float
            ) -> tuple[float, float, int, dict[str, Any], float | None]:
    """After the kill: generate (max_tokens 1) to `name` every POLL_S while it answers 503, and
    read status every STATUS_EVERY-th round, until a token was served and a poll saw `name`
    READY with a higher incarnation: (served at, seen at, generate requests, its status, the
    answered request's own time in the daemon, `total_s`)."""
    deadline = time.monotonic() + d.backend.ready_timeout_s
    served = seen = None
    new: dict[str, Any] | None = None
    attempts = rounds = 0
    total_s = None
    while served is None or seen is None:
        if served is None:
            attempts += 1
            code, body = gen.once(name)
            if code == 200:
                served, total_s = time.time(), body.get("total_s")
            elif code != 503:
                raise BenchError(f"POST /v1/generate to {name}: HTTP {code}: {body}")
        if seen is None and rounds % STATUS_EVERY == 0:
            e = d.engine(name)
            if e["state"] == "FAILED":
                raise BenchError(f"{name} FAILED: {e.get('fail_reason')}\n{d.log_tail()}")
            if e["state"] == "READY" and e["incarnation"] > old["incarnation"]:
                seen, new = time.time(), e
        rounds += 1
        if time.monotonic() > deadline:
            raise BenchError(f"{name} not READY and serving {d.backend.ready_timeout_s:g}s "
                             f"after its SIGKILL\n{d.log_tail()}")
        time.sleep(POLL_S)
    assert new is not None
    d.tracker.add(new["pid"])
    return served, seen, attempts, new, total_s


def kill_once(d: Daemon, gen: Generate) -> Kill:
    """SIGKILL replica 0's engine, then generate-and-poll until it served a token and a poll saw
    it READY again."""
    name = d.watched
    old, victim = victim_of(d, name)
    servers_before = {s["pid"] for s in d.fork_servers() if s["state"] == "ready"}
    gen.once(name)  # the connection is open before the kill (and the route warm)
    t_kill = time.time()
    victim.send_signal(signal.SIGKILL)
    served, seen, attempts, new, total_s = recover(d, gen, name, old, t_kill)
    last_exit = new.get("last_exit") or {}
    servers_after = {s["pid"] for s in d.fork_servers() if s["state"] == "ready"}
    return Kill(ready_s=new["since"] - t_kill, seen_s=seen - t_kill, served_s=served - t_kill,
                detect_s=last_exit["at"] - t_kill if last_exit.get("at") else None,
                startup_s=new.get("startup_s"),
                load_s=d.child_load_s(name, new["incarnation"]),
                launcher=str(new.get("launcher")), attempts=attempts, answer_s=total_s,
                server_pid=(next(iter(servers_after)) if servers_after == servers_before
                            and len(servers_after) == 1 else None))


@dataclass
class Promotion:
    ready_s: float  # SIGKILL of the serving replica → READY under its name (`since`)
    seen_s: float
    served_s: float
    detect_s: float | None
    promoted: bool  # the replica's new pid is the standby's (not a restart)
    spare_s: float  # → a new standby READY again (its `since`)
    spare_startup_s: float | None  # the new standby's spawn → READY
    spare_launcher: str
    attempts: int
    victim_uss_mb: float  # the killed engine's private memory
    victim_rss_mb: float  # … and all it mapped
    victim_huge_mb: float | None  # … of which anonymous huge pages
    answer_s: float | None

    @property
    def promote_s(self) -> float | None:
        return None if self.detect_s is None else self.ready_s - self.detect_s


def standby_kill(d: Daemon, gen: Generate) -> Promotion:
    """SIGKILL the serving replica with a READY standby beside it: the standby's engine is
    promoted under the dead one's name; then the standby builds a new spare."""
    name = d.watched
    spare_name = f"{d.backend.group}-standby-0"
    spare = d.wait_ready(1, name=spare_name)
    old, victim = victim_of(d, name)
    spare = d.engine(spare_name)
    if spare["state"] != "READY" or spare.get("role") != "standby":
        raise BenchError(f"{spare_name} is not a READY standby: {spare}")
    gen.once(name)
    t_kill = time.time()
    victim.send_signal(signal.SIGKILL)
    served, seen, attempts, new, total_s = recover(d, gen, name, old, t_kill)
    last_exit = new.get("last_exit") or {}
    rebuilt = d.wait_ready(spare["incarnation"] + 1, name=spare_name)
    return Promotion(ready_s=new["since"] - t_kill, seen_s=seen - t_kill,
                     served_s=served - t_kill,
                     detect_s=last_exit["at"] - t_kill if last_exit.get("at") else None,
                     promoted=new["pid"] == spare["pid"], spare_s=rebuilt["since"] - t_kill,
                     spare_startup_s=rebuilt.get("startup_s"),
                     spare_launcher=str(rebuilt.get("launcher")), attempts=attempts,
                     victim_uss_mb=old["uss_mb"], victim_rss_mb=old["rss_mb"],
                     victim_huge_mb=old["huge_mb"],
                     answer_s=total_s)


# The floor's victim: a process that maps `argv[2]` MB its parent holds too (copy-on-write, as a
# forked engine maps the fork server's pages) and `argv[1]` MB of its own, all of it touched,
# anonymous and private (malloc's kind, not shmem). It prints its pid; its parent reaps it.
HOLD_MEMORY = """\
import mmap, os, sys, time
def touch(mb):
    size = max(4096, int(float(mb) * 1e6))
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(0, size, 4096):
        m[i] = 1
    return m
shared = touch(sys.argv[2])
pid = os.fork()
if pid == 0:
    own = touch(sys.argv[1])
    print(os.getpid(), flush=True)
    time.sleep(600)
    os._exit(0)
os.waitpid(pid, 0)
"""


def teardown_floor(own_mb: float, shared_mb: float, tracker: Tracker, n: int = 3
                   ) -> list[float]:
    """SIGKILL → its pidfd readable (what the daemon waits on) of a process mapping `own_mb` MB
    of private memory and `shared_mb` MB shared with its parent: the kernel tears an address
    space down before it reports the exit, so no supervisor can learn of a death sooner."""
    times = []
    for _ in range(n):
        proc = subprocess.Popen([sys.executable, "-c", HOLD_MEMORY, f"{own_mb:.1f}",
                                 f"{shared_mb:.1f}"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, text=True)
        tracker.add(proc.pid)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            if not line.isdigit():
                raise BenchError(f"the memory holder exited with {proc.wait()}")
            victim = int(line)
            tracker.add(victim)
            pidfd = os.pidfd_open(victim)
            try:
                time.sleep(0.2)
                poller = select.poll()
                poller.register(pidfd, select.POLLIN)
                started = time.perf_counter()
                os.kill(victim, signal.SIGKILL)  # our child's child, alive until this kill
                if not poller.poll(30_000):
                    raise BenchError("the floor's victim did not exit within 30 s")
                times.append(time.perf_counter() - started)
            finally:
                os.close(pidfd)
            proc.wait(30)
        finally:
            terminate(proc, 5)
            if proc.stdout is not None:
                proc.stdout.close()
    return times


def standby_exists() -> bool:
    """Whether this engined has warm standbys (`standby:` in the spec): the lead builds it."""
    from engined.supervisor.spec import resolve

    return '"standby"' in Path(resolve.__file__).read_text()


# --- 2. memory ----------------------------------------------------------------------------------
@dataclass
class Mem:
    rss: float
    uss: float
    pss: float
    procs: int = 1  # the process and its descendants


def memory_of(pid: int) -> Mem | None:
    """RSS/USS/PSS (MB) of `pid` and its descendants (vLLM's backend has none: it runs LLMEngine
    in-process), None if it is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    total = Mem(0.0, 0.0, 0.0, 0)
    for p in procs:
        try:
            info = p.memory_full_info()
        except psutil.NoSuchProcess:
            continue
        total.rss += info.rss / MB
        total.uss += info.uss / MB
        total.pss += info.pss / MB
        total.procs += 1
    return total


@dataclass
class Memory:
    engines: dict[str, Mem] = field(default_factory=dict)
    servers: list[tuple[dict[str, Any], Mem]] = field(default_factory=list)


def measure_memory(d: Daemon, gen: Generate) -> Memory:
    """After each replica served one request (max_tokens 8) and a 1 s pause."""
    names = [f"{d.backend.group}-{i}" for i in range(REPLICAS)]
    for name in names:
        d.wait_ready(1, name=name)
        code, body = gen.once(name, max_tokens=8)
        if code != 200:
            raise BenchError(f"POST /v1/generate to {name}: HTTP {code}: {body}")
    time.sleep(1.0)
    status = d.status()
    out = Memory()
    for e in status["engines"]:
        m = memory_of(e["pid"]) if e.get("pid") else None
        if m is not None:
            out.engines[e["name"]] = m
    for s in d.fork_servers(status):
        m = memory_of(s["pid"]) if s.get("pid") and s["state"] == "ready" else None
        if m is not None:
            out.servers.append((s, m))
    return out


# --- one backend, both launchers ----------------------------------------------------------------
@dataclass
class Run:
    backend: Backend
    daemons: dict[str, Daemon]
    kills: dict[str, list[Kill]]
    memory: dict[str, Memory]
    first: dict[str, list[dict[str, Any]]]  # engines' status at first READY
    servers: list[dict[str, Any]]  # the forkserver daemon's fork servers after start
    daemon_pids: dict[str, int]
    promotions: list[Promotion] = field(default_factory=list)
    standby: str | None = None  # why standby promotion was not measured
    floor: list[float] = field(default_factory=list)  # kernel teardown of a like process


def run_backend(backend: Backend, n: int, cleanup: Cleanup, tracker: Tracker) -> Run:
    daemons: dict[str, Daemon] = {}
    first: dict[str, list[dict[str, Any]]] = {}
    for launcher in LAUNCHERS:  # one after the other: each start has the machine to itself
        d = cleanup.start(Daemon(backend, launcher, tracker))
        daemons[launcher] = d
        first[launcher] = d.status()["engines"]
    servers = daemons["forkserver"].fork_servers()
    gens = {launcher: Generate(d.socket) for launcher, d in daemons.items()}
    cleanup.closers.extend(g.close for g in gens.values())
    kills: dict[str, list[Kill]] = {launcher: [] for launcher in LAUNCHERS}
    for i in range(n):
        order = LAUNCHERS if i % 2 == 0 else LAUNCHERS[::-1]
        for launcher in order:
            kills[launcher].append(kill_once(daemons[launcher], gens[launcher]))
    memory = {launcher: measure_memory(daemons[launcher], gens[launcher])
              for launcher in LAUNCHERS}
    pids = {launcher: d.pid for launcher, d in daemons.items()}
    for launcher in LAUNCHERS:
        gens[launcher].close()
        cleanup.stop(daemons[launcher])  # its memory back before the next daemon starts
        daemons[launcher].remove_dir()
    run = Run(backend, daemons, kills, memory, first, servers, pids)
    if not standby_exists():
        run.standby = "not measured (standby not built yet)"
        return run
    # Warm standby: its own daemon (1 serving replica + 1 standby, forkserver), after the others
    d = Daemon(backend, "forkserver", tracker, standby=1)
    daemons["standby"] = d
    gen = Generate(d.socket)
    try:
        cleanup.start(d)
        d.fork_servers()
        run.promotions = [standby_kill(d, gen) for _ in range(n)]
        # the floor under the same conditions as the kills (this daemon idle beside it)
        own = med([p.victim_uss_mb for p in run.promotions]) or 1.0
        mapped = med([p.victim_rss_mb for p in run.promotions]) or own
        time.sleep(1.0)
        run.floor = teardown_floor(own, max(0.0, mapped - own), tracker)
    except BenchError as exc:  # the rest of the report stands; the row says what went wrong
        run.standby = f"error: {str(exc).splitlines()[0][:300]}"
        print(f"standby: {exc}", file=sys.stderr)
    finally:
        gen.close()
        if d.proc is not None:
            pids["standby"] = d.proc.pid
        if d in cleanup.started:
            cleanup.stop(d)
        d.remove_dir()
    return run


# --- report -------------------------------------------------------------------------------------
def sec(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f} s"


def span(values: list[float]) -> str:
    return f"{min(values):.3f}–{max(values):.3f} s" if values else "–"


def vals(kills: list[Kill], attr: str) -> list[float]:
    return [v for v in (getattr(k, attr) for k in kills) if v is not None]


def ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or not b else f"{a / b:.2f}"


def counted(items: list[str]) -> str:
    seen: dict[str, int] = {}
    for item in items:
        seen[item] = seen.get(item, 0) + 1
    return ", ".join(f"{k} ×{v}" for k, v in seen.items()) or "–"


CRASH_ROWS = (
    ("ready_s", "SIGKILL → READY (daemon's `since`)"),
    ("seen_s", "SIGKILL → READY seen by a 20 ms status poll"),
    ("served_s", "SIGKILL → first token served (`POST /v1/generate`, max_tokens 1)"),
    ("answer_s", "… the answered request's own time in the daemon (`total_s`)"),
    ("detect_s", "… of which SIGKILL → exit recorded (`last_exit.at`)"),
    ("startup_s", "… of which spawn → READY (`startup_s`)"),
    ("load_s", "… of which the child's build → warm-up (its `[ready]` line)"),
)


def report_crash(r: Report, runs: list[Run], skipped: str | None) -> None:
    r("## 1. Crash → READY and → first token (SIGKILL of replica 0, idle)", "",
      *table("backend", "measure", "exec median", "exec min–max", "forkserver median",
             "forkserver min–max", "forkserver/exec", "n"))
    for run in runs:
        ex, fk = run.kills["exec"], run.kills["forkserver"]
        for attr, label in CRASH_ROWS:
            e, f = vals(ex, attr), vals(fk, attr)
            r(f"| {run.backend.label} | {label} | {sec(med(e))} | {span(e)} | {sec(med(f))} | "
              f"{span(f)} | {ratio(med(f), med(e))} | {len(e)}/{len(f)} |")
        r(f"| {run.backend.label} | launcher of the new incarnations | "
          f"{counted([k.launcher for k in ex])} | | {counted([k.launcher for k in fk])} | | | "
          f"{len(ex)}/{len(fk)} |",
          f"| {run.backend.label} | generate requests sent until one was served (503 before) | "
          f"{med([float(k.attempts) for k in ex]) or 0:.0f} | | "
          f"{med([float(k.attempts) for k in fk]) or 0:.0f} | | | {len(ex)}/{len(fk)} |")
    if skipped:
        r(f"| vLLM backend | skipped: {skipped} | – | – | – | – | – | 0/0 |")
    r("", "Each daemon has one group of 2 replicas; replica 0 is SIGKILLed (through a psutil "
      "handle, after checking it is an engine of that daemon and no fork server), idle, "
      f"{SETTLE_S:g} s after it and the other daemon's last restart were READY. Kills alternate "
      "between the exec and the forkserver daemon (exec first on even rounds). Right after the "
      "kill the bench sends `POST /v1/generate` (max_tokens 1, `engine`: the victim by name) "
      f"on a keep-alive connection to the control socket and resends it every {POLL_S * 1e3:g} "
      "ms while the daemon answers 503 (the victim is dead or not READY yet; the control "
      "socket does not queue for a replica that is down); \"first token served\" is when one "
      f"answered 200. Every {STATUS_EVERY}nd round of that loop also reads `GET /v1/status`. "
      "`since` is the daemon's own READY transition; `startup_s` starts at the spawn (for "
      "the fork server: when the fork returned the engine's pid). Restarts are immediate "
      "(backoff 0). SIGKILL → exit recorded includes the kernel's teardown of the victim "
      "(it frees the address space before the process is a zombie; section 4 has its floor), "
      "so an engine with less private memory (a forked one) is seen dead sooner.", "")
    for run in runs:
        fk = run.kills["forkserver"]
        same = [k.server_pid for k in fk]
        if fk and all(same) and len(set(same)) == 1:
            r(f"- {run.backend.label}: every forkserver restart was forked by the same fork "
              f"server (pid {same[0]}), unaffected by the kills.")
        elif fk:
            r(f"- {run.backend.label}: **the fork server changed or was not ready during the "
              f"kills** (servers: {same}); launchers: {counted([k.launcher for k in fk])}.")
    r("")


def mem_row(backend: str, launcher: str, what: str, m: Mem) -> str:
    desc = f" (+{m.procs - 1} descendants)" if m.procs > 1 else ""
    return (f"| {backend} | {launcher} | {what}{desc} | {m.rss:.0f} | {m.uss:.0f} | "
            f"{m.pss:.0f} |")


def report_memory(r: Report, runs: list[Run], skipped: str | None) -> dict[str, dict]:
    r("## 2. Memory (MB = 10^6 bytes; after each replica served one request)", "",
      *table("backend", "launcher", "process", "RSS", "USS", "PSS"))
    totals: dict[str, dict] = {}
    for run in runs:
        label = run.backend.label
        t: dict[str, Any] = {}
        for launcher in LAUNCHERS:
            mem = run.memory[launcher]
            for name, m in sorted(mem.engines.items()):
                r(mem_row(label, launcher, f"engine {name}", m))
            for s, m in mem.servers:
                r(mem_row(label, launcher, f"fork server ({s['kind']}, pid {s['pid']}, idle)", m))
            engines = list(mem.engines.values())
            servers = [m for _, m in mem.servers]
            t[launcher] = {
                "engine_uss": med([m.uss for m in engines]),
                "engine_pss": med([m.pss for m in engines]),
                "engine_rss": med([m.rss for m in engines]),
                "pss_total": sum(m.pss for m in engines + servers),
                "uss_total": sum(m.uss for m in engines + servers),
                "server_rss": sum(m.rss for m in servers) if servers else None,
                "server_uss": sum(m.uss for m in servers) if servers else None,
                "server_pss": sum(m.pss for m in servers) if servers else None,
            }
        totals[run.backend.key] = t
    if skipped:
        r(f"| vLLM backend | – | skipped: {skipped} | – | – | – |")
    r("", *table("backend", "measure", "exec", "forkserver", "forkserver − exec"))
    for run in runs:
        t = totals[run.backend.key]
        ex, fk = t["exec"], t["forkserver"]
        for key, what in (("engine_rss", "RSS per engine (median)"),
                          ("engine_uss", "USS per engine (median): its private pages"),
                          ("engine_pss", "PSS per engine (median)"),
                          ("pss_total", f"PSS of the fleet: {REPLICAS} engines (+ the fork "
                                        f"server): the memory it really costs"),
                          ("uss_total", f"USS of the fleet: {REPLICAS} engines (+ the fork "
                                        f"server)")):
            r(f"| {run.backend.label} | {what} | {ex[key]:.0f} MB | {fk[key]:.0f} MB | "
              f"{fk[key] - ex[key]:+.0f} MB |")
    r("", "psutil's `memory_full_info()` (from /proc/PID/smaps_rollup): USS counts the pages only "
      "this process maps, PSS splits every shared page among the processes that map it, so "
      "PSS sums to the memory a group of processes really uses. A forked engine shares the "
      "server's preloaded interpreter and imports copy-on-write with the server and its "
      "siblings; an exec'd engine shares only file-backed pages (libraries, page cache). The "
      "fork server's PSS goes down as more children share its pages.", "")
    return totals


def report_startup(r: Report, runs: list[Run], skipped: str | None) -> None:
    r("## 3. Startup: spawn → READY", "",
      *table("backend", "measure", "exec", "forkserver", "forkserver/exec"))
    for run in runs:
        label = run.backend.label
        walls = {x: run.daemons[x].start_wall_s for x in LAUNCHERS}
        r(f"| {label} | daemon start → both replicas READY (the bench's clock) | "
          f"{sec(walls['exec'])} | {sec(walls['forkserver'])} | "
          f"{ratio(walls['forkserver'], walls['exec'])} |")
        for e_first, f_first in zip(run.first["exec"], run.first["forkserver"]):
            r(f"| {label} | first start of {e_first['name']}: `startup_s` | "
              f"{sec(e_first.get('startup_s'))} | {sec(f_first.get('startup_s'))} | "
              f"{ratio(f_first.get('startup_s'), e_first.get('startup_s'))} |")
        e, f = (med(vals(run.kills[x], "startup_s")) for x in LAUNCHERS)
        r(f"| {label} | restart after a kill: `startup_s` (median) | {sec(e)} | {sec(f)} | "
          f"{ratio(f, e)} |")
        e, f = (med(vals(run.kills[x], "load_s")) for x in LAUNCHERS)
        r(f"| {label} | … of which the child's build → warm-up (`[ready]` line, median) | "
          f"{sec(e)} | {sec(f)} | {ratio(f, e)} |")
        first_launchers = {x: counted([str(e.get("launcher")) for e in run.first[x]])
                           for x in LAUNCHERS}
        r(f"| {label} | launcher at first start | {first_launchers['exec']} | "
          f"{first_launchers['forkserver']} | |")
        for s in run.servers:
            r(f"| {label} | fork server ({s['kind']}): preload (`import_s`), threads at fork "
              f"(`tasks`), state | – | {sec(s.get('import_s'))}, {s.get('tasks')} thread(s), "
              f"{s.get('state')} | |")
        if not run.servers:
            r(f"| {label} | fork server | – | **none** | |")
    if skipped:
        r(f"| vLLM backend | skipped: {skipped} | – | – | – |")
    r("", "`startup_s` runs from the spawn to READY: for an exec'd engine that is the "
      "interpreter's start, its imports (torch, transformers or vLLM), the model build and the "
      "warm-up; for a forked engine the fork server has done the imports already (`import_s`, "
      "once per server), so what is left is the model build and the warm-up. The first "
      "forked engines also wait for the server's preload, which `startup_s` does not count "
      "(the fork has not happened yet) and the daemon start → READY row does. The replicas "
      "of one daemon start at once and share the CPUs.", "")


def report_summary(r: Report, runs: list[Run], skipped: str | None,
                   totals: dict[str, dict]) -> None:
    r("## Summary", "", *table("target / measure", "exec", "forkserver", "forkserver/exec",
                               "target", "result"))
    by_key = {run.backend.key: run for run in runs}
    for run in runs:
        key, label = run.backend.key, run.backend.label
        e_ready, f_ready = (med(vals(run.kills[x], "ready_s")) for x in LAUNCHERS)
        e_served, f_served = (med(vals(run.kills[x], "served_s")) for x in LAUNCHERS)
        if key == "tiny":
            target = f"forkserver ≤ {TINY_TARGET_S:g} s"
            ok = f_ready is not None and f_ready <= TINY_TARGET_S
            miss = f"MISS by {(f_ready or 0) - TINY_TARGET_S:.3f} s"
        else:
            target = f"forkserver ≤ {VLLM_TARGET_RATIO * 100:.0f} % of exec"
            rr = f_ready / e_ready if f_ready is not None and e_ready else None
            ok = rr is not None and rr <= VLLM_TARGET_RATIO
            miss = f"MISS by {((rr or 0) - VLLM_TARGET_RATIO) * 100:.0f} points"
        r(f"| {label}: crash → READY (median `since`) | {sec(e_ready)} | {sec(f_ready)} | "
          f"{ratio(f_ready, e_ready)} | {target} | {'PASS' if ok else miss} |",
          f"| {label}: crash → first token served (median) | {sec(e_served)} | "
          f"{sec(f_served)} | {ratio(f_served, e_served)} | – | report only |")
        t = totals[key]
        r(f"| {label}: PSS of {REPLICAS} engines (+ fork server) | "
          f"{t['exec']['pss_total']:.0f} MB | {t['forkserver']['pss_total']:.0f} MB | "
          f"{t['forkserver']['pss_total'] / t['exec']['pss_total']:.2f} | – | report only |")
    if "vllm" not in by_key:
        r(f"| vLLM backend: crash → READY | – | – | – | forkserver ≤ "
          f"{VLLM_TARGET_RATIO * 100:.0f} % of exec | skipped: {skipped} |")
    for run in runs:
        label = run.backend.label
        ready = med([p.ready_s for p in run.promotions])
        if run.standby is not None or ready is None:
            verdict = run.standby or "not measured"
        else:
            ok = ready <= STANDBY_TARGET_S and all(p.promoted for p in run.promotions)
            floor = med(run.floor)
            verdict = ("PASS" if ok else
                       f"MISS by {(ready - STANDBY_TARGET_S) * 1e3:.1f} ms"
                       if ready > STANDBY_TARGET_S else "MISS: not promoted")
            if floor is not None and not ok:
                verdict += (f" (the kernel's teardown of the victim alone: "
                            f"{floor * 1e3:.0f} ms)")
        r(f"| {label}: warm standby promotion: SIGKILL of the serving replica → READY under its "
          f"name (median `since`) | – | {sec(ready)} | – | ≤ {STANDBY_TARGET_S * 1e3:g} ms | "
          f"{verdict} |")
    r("")


def report_standby(r: Report, runs: list[Run], skipped: str | None) -> None:
    r("## 4. Warm standby promotion (1 serving replica + 1 standby, forkserver)", "",
      *table("backend", "measure", "median", "min–max", "n"))
    for run in runs:
        label, ps = run.backend.label, run.promotions
        if run.standby is not None:
            r(f"| {label} | {run.standby} | – | – | 0 |")
            continue
        for attr, what in (("ready_s", "SIGKILL of the serving replica → READY under its name "
                                       "(daemon's `since`)"),
                           ("seen_s", "SIGKILL → READY seen by a 20 ms status poll"),
                           ("served_s", "SIGKILL → first token served under its name "
                                        "(`POST /v1/generate`, max_tokens 1)"),
                           ("answer_s", "… the answered request's own time in the daemon "
                                        "(`total_s`)"),
                           ("detect_s", "… of which SIGKILL → exit recorded (`last_exit.at`)"),
                           ("promote_s", "… of which exit recorded → READY under its name (the "
                                         "promotion itself)"),
                           ("spare_s", "SIGKILL → a new standby READY again (its `since`)"),
                           ("spare_startup_s", "… the new standby's spawn → READY "
                                               "(`startup_s`)")):
            v = [x for x in (getattr(p, attr) for p in ps) if x is not None]
            r(f"| {label} | {what} | {sec(med(v))} | {span(v)} | {len(v)} |")
        uss = med([p.victim_uss_mb for p in ps]) or 0.0
        rss = med([p.victim_rss_mb for p in ps]) or 0.0
        huge = med([p.victim_huge_mb for p in ps])
        r(f"| {label} | floor: SIGKILL → exit seen (pidfd) of a process mapping what the victim "
          f"mapped ({uss:.0f} MB private, its median USS, of which {huge or 0:.0f} MB in huge "
          f"pages; {rss - uss:.0f} MB shared, RSS − USS): the kernel's teardown alone | "
          f"{sec(med(run.floor))} | {span(run.floor)} | {len(run.floor)} |")
        r(f"| {label} | the standby's engine took over (same pid), not a restart | "
          f"{sum(p.promoted for p in ps)} of {len(ps)} | | {len(ps)} |",
          f"| {label} | launcher of the new standbys | "
          f"{counted([p.spare_launcher for p in ps])} | | {len(ps)} |")
    if skipped:
        r(f"| vLLM backend | skipped: {skipped} | – | – | 0 |")
    r("", "A daemon of its own per backend (after the exec and forkserver daemons stopped): the "
      "group has 1 serving replica and `standby: 1`. Before each kill both are READY (the "
      f"standby with `\"role\": \"standby\"`) and settled {SETTLE_S:g} s; the serving "
      "replica's engine is SIGKILLed and the same generate-and-poll loop as in section 1 runs "
      "against its name. The daemon promotes the READY standby's engine under the dead one's "
      "name (a new incarnation, the same pid) and the standby builds a new spare, which the "
      "bench waits for before the next kill. The daemon learns of a death when the process "
      "exits, and the kernel tears its address space down before it reports that: the floor "
      "row is that teardown alone, SIGKILL → its pidfd readable (what the daemon waits on) "
      "for a bare process that maps as much as the victim did (its USS in pages of its own, "
      "its RSS − USS in pages its parent holds too, all anonymous, touched, 4 KiB pages): the "
      "share of a promotion no supervisor can remove.", "")


# --- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 tiny-llama kills per launcher, 1 vLLM kill (if its interpreter "
                             "exists)")
    parser.add_argument("--out", default=None, help="default bench/results/recovery.md "
                        "(--quick: bench/results/recovery-quick.md)")
    parser.add_argument("-n", type=int, default=None,
                        help="kills per launcher per backend (default 5; --quick: 2 tiny-llama, "
                             "1 vLLM)")
    parser.add_argument("--vllm-python", default=None,
                        help=f"the vLLM venv's interpreter (default ${VLLM_PYTHON_ENV}, else "
                             f"<repo>/.venv-vllm/bin/python)")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM backend")
    parser.add_argument("--cache-dir", default=None,
                        help="ENGINED_CACHE_DIR for the model (default: a fresh temporary one)")
    args = parser.parse_args(argv)
    n_tiny = args.n or (2 if args.quick else 5)
    n_vllm = args.n or (1 if args.quick else 5)
    out = Path(args.out) if args.out else default_out("recovery", args.quick)

    python = args.vllm_python or default_vllm_python()
    skipped: str | None = None
    versions = ""
    if args.no_vllm:
        skipped = "--no-vllm"
    elif not (os.path.isfile(python) and os.access(python, os.X_OK)):
        skipped = (f"no vLLM interpreter at {python} (--vllm-python, or set "
                   f"{VLLM_PYTHON_ENV})")
    else:
        try:
            versions = vllm_versions(python)
        except BenchError as exc:
            skipped = f"the vLLM interpreter does not run: {str(exc)[:200]}"

    r, tracker = Report(), Tracker()
    cleanup = Cleanup(tracker)
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="engined-bench-cache-"))
    if args.cache_dir is None:
        cleanup.dirs.append(cache)
    runs: list[Run] = []
    cpu_start = psutil.cpu_times()
    try:
        r(f"# engined fast-recovery benchmark: fork server vs exec"
          f"{' (--quick)' if args.quick else ''}", "", *machine_lines(), engined_revision(),
          f"- load average at start: {os.getloadavg()[0]:.2f} (1 min)",
          f"- kills per launcher: tiny-llama {n_tiny}"
          + (f", vLLM {n_vllm}" if skipped is None else "")
          + f"; {REPLICAS} replicas per daemon; heartbeats every "
          f"{HEARTBEATS['heartbeat_interval']}, restarts immediate (backoff 0)")
        checkpoint = build_checkpoint(cache)  # untimed, exactly as an engine would on first use
        r(f"- tiny-llama: torch {version('torch')}, transformers {version('transformers')}; "
          f"builtin:tiny-llama ({checkpoint.name}), float32, CPU, threads 1, max_batch_size 8")
        if skipped is None:
            r(f"- vLLM backend: {python} ({versions}); the same checkpoint, engine_args "
              f"{{enforce_eager: true, max_model_len: 1024}}, VLLM_CPU_KVCACHE_SPACE=1, "
              f"threads 1, max_batch_size 8")
        else:
            r(f"- vLLM backend: **skipped**: {skipped}")
        r("")
        runs.append(run_backend(tiny_backend(cache), n_tiny, cleanup, tracker))
        if skipped is None:
            warm_s = warm_vllm_imports(python)
            print(f"(page cache warmed: `import vllm` took {warm_s:.1f} s, untimed)",
                  file=sys.stderr, flush=True)
            runs.append(run_backend(vllm_backend(python, cache), n_vllm, cleanup, tracker))
    finally:
        leftovers = cleanup.close()

    busy = cpu_busy_pct(cpu_start)
    pids = ", ".join(f"{run.backend.key} {kind} {pid}" for run in runs
                     for kind, pid in run.daemon_pids.items())
    report_crash(r, runs, skipped)
    totals = report_memory(r, runs, skipped)
    report_startup(r, runs, skipped)
    report_standby(r, runs, skipped)
    report_summary(r, runs, skipped, totals)
    notes = [f"{run.backend.label} {x}: {d.stop_note}" for run in runs
             for x, d in run.daemons.items() if d.stop_note]
    r(f"- daemon pids: {pids}",
      f"- load average at end: {os.getloadavg()[0]:.2f} (1 min); all CPUs {busy:.0f} % busy "
      f"during the run; processes left over and killed by pid: {leftovers or 'none'}"
      + (f"; {'; '.join(notes)}" if notes else ""))
    r.write(out)
    return 0  # a report, not a gate: the verdicts are in the summary


if __name__ == "__main__":
    sys.exit(main())
