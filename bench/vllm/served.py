"""Section 4, measured: `vllm serve` as it is, under engined as a command engine (probes on its
`/health`, `progress: vllm` on its Prometheus counters): SIGKILL of its EngineCore or of its API
server → READY again; SIGSTOP of either, with a streamed request in flight or idle → engined's
verdict and the request's end. Beside it, a bare `vllm serve` (no supervisor) frozen the same way
under a Kubernetes-style liveness probe. Reported by bench/vllm/served_report.py.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import BenchDaemon, BenchError, Cleanup, Tracker, wait_until
from bench.vllm.engine import (
    MAX_TOKENS,
    PROMPTS,
    SERVE_ARGS,
    SERVE_MODULE,
    START_TIMEOUT_S,
    VLLM_ENV,
)
from bench.vllm.server import (
    FREEZE_MAX_TOKENS,
    VllmServe,
    descendants,
    engine_core_of,
    http_status,
    post_json,
    stream_in_flight,
)
from testkit.driver import free_port

SERVED = "served"  # the command engine's name, and its model name at the gateway
SERVED_ENGINE = f"{SERVED}-0"
# SERVE_ARGS without --disable-log-stats: `progress: vllm` reads vLLM's Prometheus counters,
# which vLLM does not keep when stats are disabled (see the README's method notes)
SERVED_ARGS = [a for a in SERVE_ARGS if a != "--disable-log-stats"]
SERVED_PROBE = {"path": "/health", "interval": "1s", "timeout": "2s", "failures": 3}
SERVED_STALL_TIMEOUT = "5s"
# serve_env()'s additions; CUDA_VISIBLE_DEVICES is engined's to set (empty: no GPUs)
SERVED_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
              "PYTHONUNBUFFERED": "1", **VLLM_ENV}
# a Kubernetes-style liveness probe on /health (httpGet): periodSeconds, timeoutSeconds,
# failureThreshold; success is 200-399
K8S_PERIOD_S, K8S_TIMEOUT_S, K8S_FAILURES = 10.0, 1.0, 3
K8S_FIRES_WITHIN = (K8S_PERIOD_S * (K8S_FAILURES - 1) + K8S_TIMEOUT_S,
                    K8S_PERIOD_S * K8S_FAILURES + K8S_TIMEOUT_S)  # after a stop: 21-31 s
HEALTH_WATCH_S = 0.25  # the /health poll of the freeze windows (each with a 2 s timeout)
FREEZES = (("core", True), ("api", True), ("api", False))  # (what is stopped, request in flight)
FREEZE_LABELS = {("core", True): "EngineCore SIGSTOP, request in flight",
                 ("api", True): "API server SIGSTOP, request in flight",
                 ("api", False): "API server SIGSTOP, idle"}


def served_spec(python: str, model: Path, cwd: Path, args: list[str] = SERVED_ARGS
                ) -> dict[str, Any]:
    """tests/vllm/test_vllm_serve.py's `serve_engine` with the bare server's arguments (`args`)
    and environment; restarts, backoff and stop_timeout are the benchmarks' defaults
    (immediate)."""
    return {"name": SERVED, "replicas": 1,
            "command": [python, "-m", SERVE_MODULE, "--model", str(model), "--host", "127.0.0.1",
                        "--port", "{port}", *args],
            "cwd": str(cwd), "port": "auto", "progress": "vllm", "probe": dict(SERVED_PROBE),
            "env": dict(SERVED_ENV), "startup_timeout": "5m",
            "stall_timeout": SERVED_STALL_TIMEOUT}


class ServeDaemon(BenchDaemon):
    """engined with one command engine (`served-0`: `vllm serve`) and the gateway on a free
    loopback port, in /tmp/esXXXXXXXX."""

    log_lines = 30
    log_engines = (SERVED_ENGINE,)

    def __init__(self, spec: dict[str, Any], tracker: Tracker) -> None:
        self.gateway_port = free_port()
        super().__init__("es", tracker, [spec], status_timeout_s=10.0,
                         supervisor={"gateway": f"127.0.0.1:{self.gateway_port}"})

    def start(self, timeout_s: float = START_TIMEOUT_S, interval_s: float = 0.05) -> None:
        super().start(timeout_s, interval_s)

    def wait_ready(self, min_incarnation: int, timeout_s: float = START_TIMEOUT_S,
                   interval_s: float = 0.02, name: str | None = None) -> dict[str, Any]:
        return super().wait_ready(min_incarnation, timeout_s, interval_s, name)

    def tree(self, pid: int) -> list[psutil.Process]:
        """The server and its descendants, each added to the tracker (killed by pid at the end
        if anything outlived the daemon)."""
        procs = [psutil.Process(pid), *descendants(pid)]
        for p in procs:
            self.tracker.add(p.pid)
        return procs


def core_in(tree: list[psutil.Process]) -> psutil.Process:
    for proc in tree[1:]:
        try:
            if "EngineCore" in proc.name():
                return proc
        except psutil.Error:
            pass
    raise BenchError(f"no VLLM::EngineCore among the server's descendants: {tree}")


def gone(proc: psutil.Process) -> bool:
    """Exited (or a zombie); psutil's handle guards against a reused pid."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def exit_text(last: dict[str, Any]) -> str:
    how = f"signal {last['signal']}" if last.get("signal") else f"code {last.get('code')}"
    return f"{last.get('reason')} ({how})"


def spawn_to_exit(new: dict[str, Any]) -> float:
    """exit recorded → respawn: the new incarnation's spawn is READY's `since` − `startup_s`."""
    return new["since"] - new["startup_s"] - new["last_exit"]["at"]


def served_kill(daemon: ServeDaemon, target: str) -> dict[str, Any]:
    """SIGKILL of the idle server's EngineCore (`core`) or of the API server itself (`api`) →
    READY again with a new incarnation (the daemon's `since`)."""
    e = daemon.wait_ready(1)
    time.sleep(0.5)  # settle (a few probes) before the kill
    tree = daemon.tree(e["pid"])
    victim = core_in(tree) if target == "core" else tree[0]
    t_kill = time.time()
    victim.kill()
    new = daemon.wait_ready(e["incarnation"] + 1)
    seen = time.time()
    left = [p.pid for p in tree if not gone(p)]
    daemon.tree(new["pid"])
    last = new["last_exit"]
    return {"target": target, "ready_s": new["since"] - t_kill, "seen_s": seen - t_kill,
            "detect_s": last["at"] - t_kill, "respawn_s": spawn_to_exit(new),
            "startup_s": new["startup_s"], "exit": exit_text(last), "left": left}


class HealthWatch(threading.Thread):
    """GET /health every 0.25 s (each on its own connection, 2 s timeout) until stopped:
    (start, end, status or None) per poll."""

    def __init__(self, port: int, interval_s: float = HEALTH_WATCH_S, timeout_s: float = 2.0
                 ) -> None:
        super().__init__(daemon=True)
        self.port, self.interval_s, self.timeout_s = port, interval_s, timeout_s
        self.polls: list[tuple[float, float, int | None]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            began = time.time()
            status = http_status(self.port, timeout_s=self.timeout_s)
            self.polls.append((began, time.time(), status))
            self.halt.wait(max(0.0, self.interval_s - (time.time() - began)))

    def stop(self) -> None:
        self.halt.set()
        self.join(self.timeout_s + 2)

    def summary(self, t0: float, until: float) -> dict[str, Any]:
        """The polls that ended by `until` (before the server was killed): how many, how many
        200, and when (after t0) the first one that was not began."""
        polls = [(b, s) for b, e, s in self.polls if e <= until]
        first_bad = next((b - t0 for b, s in polls if s != 200), None)
        return {"polls": len(polls), "ok": sum(1 for _, s in polls if s == 200),
                "first_bad_s": first_bad, "span_s": until - t0}


class KubeletProbe(threading.Thread):
    """A liveness probe as a kubelet runs an httpGet one: GET /health every period (a ticker: the
    next probe is due a period after the previous one was due), `timeout` per probe, success on
    200-399, `failureThreshold` failures in a row → the container would be restarted (recorded
    here; the count starts again, as it does after a restart)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.probes: list[tuple[float, float, int | None]] = []
        self.fired: list[float] = []  # end of the failure that reached the threshold
        self.halt = threading.Event()

    def run(self) -> None:
        due, failures = time.time(), 0
        while not self.halt.is_set():
            began = time.time()
            status = http_status(self.port, timeout_s=K8S_TIMEOUT_S)
            ended = time.time()
            self.probes.append((began, ended, status))
            failures = 0 if status is not None and 200 <= status < 400 else failures + 1
            if failures >= K8S_FAILURES:
                self.fired.append(ended)
                failures = 0
            due += K8S_PERIOD_S
            self.halt.wait(max(0.0, due - time.time()))

    def stop(self) -> None:
        self.halt.set()
        self.join(K8S_TIMEOUT_S + 2)

    def fired_after(self, t0: float) -> float | None:
        return next((t - t0 for t in self.fired if t >= t0), None)

    def between(self, t0: float, t1: float) -> tuple[int, int]:
        """(probes that began in [t0, t1], of which answered 2xx/3xx)."""
        inside = [s for b, _, s in self.probes if t0 <= b <= t1]
        return len(inside), sum(1 for s in inside if s is not None and 200 <= s < 400)


class BareFreezes(threading.Thread):
    """A bare `vllm serve` (no supervisor) under a k8s-style liveness probe, frozen twice: its
    EngineCore SIGSTOPped with a streamed completion in flight, for `window_s`; then its API
    server SIGSTOPped too (the whole server frozen) until the probe fires, at most
    `api_bound_s`. Left frozen: the caller stops it (SIGCONT, SIGTERM) once the daemon's runs
    are done, so nothing of it runs beside them."""

    def __init__(self, serve: VllmServe, core: psutil.Process, window_s: float,
                 api_bound_s: float) -> None:
        super().__init__(daemon=True)
        self.serve, self.core, self.window_s, self.api_bound_s = serve, core, window_s, api_bound_s
        self.result: dict[str, Any] | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            self.result = self._run()
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            self.error = f"{type(exc).__name__}: {exc}"

    def _run(self) -> dict[str, Any]:
        serve, prober = self.serve, KubeletProbe(self.serve.port)
        prober.start()  # a kubelet has probed since the container started
        try:
            wait_until(lambda: prober.probes, 5, "the k8s-style probe's first probe", 0.05)
            body = {"model": str(serve.model), "prompt": PROMPTS[0],
                    "max_tokens": FREEZE_MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            stream = stream_in_flight(serve.port, body, "the bare server's completion")
            health = HealthWatch(serve.port)
            t_core = time.time()
            self.core.send_signal(signal.SIGSTOP)
            health.start()
            time.sleep(self.window_s)
            t_end = time.time()
            health.stop()
            core = {"health": health.summary(t_core, t_end),
                    "probes": prober.between(t_core, t_end),
                    "fired_s": prober.fired_after(t_core), "window_s": t_end - t_core,
                    "tokens": stream.tokens_after(t_core + 0.2)}
            # the whole-server stop at a random point of the probe's period, as it would fall
            time.sleep(random.uniform(0.0, K8S_PERIOD_S))
            health = HealthWatch(serve.port)
            t_api = time.time()
            os.kill(serve.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
            health.start()
            deadline = t_api + self.api_bound_s
            while prober.fired_after(t_api) is None and time.time() < deadline:
                time.sleep(0.05)
            t_end = time.time()
            health.stop()
            api = {"health": health.summary(t_api, t_end),
                   "phase_s": t_api - max(b for b, _, _ in prober.probes if b <= t_api),
                   "probes": prober.between(t_api, t_end), "fired_s": prober.fired_after(t_api),
                   "window_s": t_end - t_api}
        finally:
            prober.stop()
        return {"core": core, "api": api}


def served_freeze(daemon: ServeDaemon, target: str, in_flight: bool) -> dict[str, Any]:
    """SIGSTOP of the server's EngineCore (`core`) or of the API server (`api`), with a streamed
    gateway completion in flight or idle; the server's own /health polled until engined kills
    it; then READY again, and the request's end."""
    e = daemon.wait_ready(1)
    wait_until(lambda: daemon.engine()["heartbeat_age_s"] is not None, 30, "a first probe", 0.05)
    time.sleep(0.5)
    old_inc = e["incarnation"]
    tree = daemon.tree(e["pid"])
    victim = core_in(tree) if target == "core" else tree[0]
    stream = None
    if in_flight:
        stream = stream_in_flight(daemon.gateway_port, {"model": SERVED, "prompt": PROMPTS[0],
                                                        "max_tokens": FREEZE_MAX_TOKENS,
                                                        "temperature": 0},
                                  "the gateway's completion")
    health = HealthWatch(e["port"])
    t_stop = time.time()
    victim.send_signal(signal.SIGSTOP)
    health.start()
    try:
        def replaced() -> dict[str, Any] | None:
            daemon.check_alive()
            if not health.halt.is_set() and gone(tree[0]):
                health.halt.set()  # the old server is gone: its port is no longer its
            now = daemon.engine()
            if now["state"] == "FAILED":
                raise BenchError(f"{SERVED_ENGINE} FAILED: {now.get('fail_reason')}")
            return now if now["state"] == "READY" and now["incarnation"] > old_inc else None
        try:
            new = wait_until(replaced, START_TIMEOUT_S,
                             f"{SERVED_ENGINE} READY after SIGSTOP of {target} "
                             f"({'a request in flight' if in_flight else 'idle'})", 0.05)
        except BenchError as exc:
            raise BenchError(f"{exc}\nstatus: {daemon.engine()}\n{daemon.log_tail()}") from None
    finally:
        health.stop()
        left = [p.pid for p in tree if not gone(p)]
        for p in tree:  # the daemon kills them; never leave a stopped process
            if not gone(p):
                try:
                    p.kill()
                except psutil.Error:
                    pass
    assert new is not None
    daemon.tree(new["pid"])
    last = new["last_exit"]
    out: dict[str, Any] = {
        "target": target, "in_flight": in_flight, "detect_s": last["at"] - t_stop,
        "reason": last["reason"], "exit": exit_text(last), "ready_s": new["since"] - t_stop,
        "restart_s": new["since"] - last["at"], "health": health.summary(t_stop, last["at"]),
        "left": left}
    if stream is not None:
        stream.join(START_TIMEOUT_S)
        usage = stream.usage or {}
        out.update({
            "request": ("finished" if stream.ended_at and not stream.error else
                        f"error: {stream.error}" if stream.ended_at else "still open"),
            "request_finish": stream.finish, "request_tokens": usage.get("completion_tokens"),
            "request_done_s": (stream.ended_at - t_stop) if stream.ended_at else None,
            "tokens_before_stop": sum(1 for t in stream.token_times if t <= t_stop),
            "tokens_streamed": len(stream.token_times)})
    return out


def serve_section(python: str, model: Path, scratch: Path, cleanup: Cleanup, kills: int,
                  freezes: int, window_s: float) -> dict[str, Any]:
    """Section 4: a bare `vllm serve` cold start (timed alone), its freezes under a k8s-style
    probe (on a thread, frozen: it uses no CPU beside the daemon's runs), then engined with
    `vllm serve` as a command engine: kills, then freezes, each kind in turn."""
    tracker = cleanup.tracker
    bare = VllmServe(python, model, scratch, tracker, 99, SERVED_ARGS)
    cleanup.started.append(bare)  # stopped (SIGCONT first) by close() if anything fails
    t0 = bare.start()
    out: dict[str, Any] = {"bare_health_s": bare.wait_health() - t0}
    code, body = post_json(bare.port, "/v1/completions",
                           {"model": str(model), "prompt": PROMPTS[0],
                            "max_tokens": MAX_TOKENS[0], "temperature": 0})
    if code != 200:
        raise BenchError(f"bare vllm serve completion: HTTP {code}: {body}")
    out["bare_completion_s"] = time.time() - t0
    bare.track()
    core = engine_core_of(bare.proc.pid)  # type: ignore[union-attr]
    if core is None:
        raise BenchError(f"no EngineCore under the bare vllm serve: {bare.log_tail()}")
    api_bound = max(window_s, K8S_FIRES_WITHIN[1] + 5)
    frozen = BareFreezes(bare, core, window_s, api_bound)
    frozen.start()

    daemon = ServeDaemon(served_spec(python, model, scratch), tracker)
    cleanup.start(daemon)
    first = daemon.wait_ready(1)
    out["first_startup_s"] = first["startup_s"]
    daemon.tree(first["pid"])
    out["kills"] = [served_kill(daemon, target)
                    for _ in range(kills) for target in ("core", "api")]
    out["freezes"] = [served_freeze(daemon, target, in_flight)
                      for _ in range(freezes) for target, in_flight in FREEZES]
    daemon.tree(daemon.wait_ready(1)["pid"])
    cleanup.stop(daemon)
    daemon.remove_dir()
    frozen.join(api_bound + window_s + 30)
    if frozen.error or frozen.result is None:
        raise BenchError(f"the bare server's freezes: {frozen.error or 'did not end'}")
    out["bare"] = frozen.result
    out["tree"] = sorted({p.name() for p in descendants(bare.proc.pid)})  # type: ignore[union-attr]
    cleanup.stop(bare)
    out["window_s"], out["api_bound_s"] = window_s, api_bound
    return out
