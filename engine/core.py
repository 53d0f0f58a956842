"""The engine-core child process.

The daemon execs ``python -m engined.engine``, which calls the static entry point
``EngineCoreProc.run_engine_core(config)``. Everything heavy (torch, transformers, the model) is
built lazily here, inside the child, never in the daemon. The lifecycle:

    HELLO -> Progress(phase...) -> READY -> busy loop (+ heartbeat thread)
          -> finally: cleanup, GOODBYE

Exit codes (DESIGN): 0 clean, 78 invalid engine config/model, 128+N after signal N, 1 crash.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import mmap
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, NoReturn

import msgspec
import zmq

from engined.engine import contract, memory
from engined.engine import protocol as proto
from engined.engine.backend import Backend, EngineConfigError
from engined.engine.build import build_backend
from engined.engine.requests import RequestTable

_PR_SET_PDEATHSIG = 1
_IDLE_POLL_MS = 500  # idle wake-up; a signal wakes the loop at once through the wakeup fd
_LINGER_MS = 500  # bounded linger: a dead daemon must not block our exit
_RECONNECT_MS = 10  # a lost connection to engined is tried again after this (ZeroMQ: 100),
_RECONNECT_MAX_MS = 500  # then doubling up to this
_COALESCE_GAP_S = 0.001  # batching window: requests arriving this close together share a batch
_COALESCE_MAX_S = 0.005
_LONE_STARTS = 4  # this many lone requests in a row on an idle engine turn the window off
_STALL_FAULT_S = 3600.0
_DP_IDLE_POLL_MS = 500  # DP ranks idle here; each wake-up costs one collective
TRIM_IDLE_S = 60.0  # an idle engine trims its heap this often (Trimmer)
_DIST_TIMEOUT_S = 600  # collectives and rendezvous; the daemon's stall/startup limits act first


class StopRequested(Exception):
    """Raised inside model building when SIGTERM/SIGINT arrived: stop loading, clean up."""


def _restore_nofile() -> None:
    """engined raised its own soft RLIMIT_NOFILE; an engine gets the limit engined started with."""
    wanted = os.environ.get(contract.ENV_NOFILE)
    if not wanted:
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if int(wanted) < soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (int(wanted), hard))
    except (ValueError, OSError):
        pass  # keep the raised one: more descriptors never hurt an engine


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when the daemon dies, then close the race where it already has.

    PR_SET_PDEATHSIG is tied to the daemon's thread that spawned us; engined spawns from its
    event-loop thread, which lives as long as the daemon does.
    """
    if contract.outlives_daemon():
        return  # the daemon's guard ends us if no engined adopts us in time
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    parent = os.environ.get(contract.ENV_PARENT_PID)
    if parent is not None and os.getppid() != int(parent):
        os._exit(1)  # the daemon died before the prctl took effect


class _StopFlag:
    """Set by SIGTERM/SIGINT; the handler does nothing else (the busy loop drains and exits)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def handler(self, signum: int, _frame: Any) -> None:
        self.signum = signum

    @property
    def set(self) -> bool:
        return self.signum is not None


class Trimmer:
    """Gives freed heap memory back to the kernel (engine.memory.trim: glibc's malloc_trim)
    when a burst ends and every TRIM_IDLE_S while idle: a long-running engine's RSS otherwise
    keeps the high-water mark of its largest burst. ENGINE_MALLOC_TRIM=0 turns it off (the
    benchmark's comparison)."""

    def __init__(self) -> None:
        self.enabled = os.environ.get("ENGINE_MALLOC_TRIM", "1") != "0"
        self.last = time.monotonic()

    def after(self, burst_ended: bool, idle: bool, now: float) -> None:
        if self.enabled and (burst_ended or idle and now - self.last >= TRIM_IDLE_S):
            memory.trim()
            self.last = now


class BurstWindow:
    """Whether work reaching an idle engine waits for the rest of its burst (`_coalesce`).

    The wait is worth it for bursts: a burst split over two steps pays one more step (vLLM) or
    one more whole `generate` (transformers). A lone request pays one empty gap for nothing. So
    the engine watches what its idle starts were: one that took a single request, with nothing
    more arriving during its first step, was lone. After `_LONE_STARTS` lone starts in a row the
    window is skipped. The first start that was not lone (with the window off, a burst whose
    late members arrived during its first step: a split) turns it back on. A workload that
    changes from lone requests to bursts pays one split.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.lone_in_a_row = 0
        self._first_step: int | None = None  # requests the start took, until its step is seen

    @property
    def wanted(self) -> bool:
        return self.enabled and self.lone_in_a_row < _LONE_STARTS

    def started(self, taken: int) -> None:
        """An idle engine took `taken` requests (after the window, if it waited) and steps."""
        if self.enabled:
            self._first_step = taken

    def first_step_done(self, arrived: int) -> None:
        """The loop turn after a start's first step: `arrived` requests came in during it."""
        if self._first_step is None:
            return
        lone = self._first_step + arrived <= 1
        self.lone_in_a_row = self.lone_in_a_row + 1 if lone else 0
        self._first_step = None


class EngineCoreProc:
    """One engine core: builds its model lazily, serves requests, heartbeats, cleans up."""

    def __init__(self, config: proto.EngineConfig, stop: _StopFlag | None = None) -> None:
        _validate(config)
        self.config = copy.deepcopy(config)
        self.stop = stop or _StopFlag()
        self.model: Backend | None = None
        self.memory_plan: dict[str, float] = {}  # what memory_limit set (engine.memory)
        self.table: RequestTable | None = None
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.control = self._socket(zmq.PUSH, config.control_endpoint)
        self.trimmer = Trimmer()
        self.requests = self._socket(zmq.DEALER, config.request_endpoint, identity=True)
        self.iteration = 0
        self.last_iteration_at = time.monotonic()
        self._faulty: list[proto.GenerateRequest] = []  # requests whose prompt injects a fault
        self._heartbeat: _HeartbeatThread | None = None
        self.idle_poll_ms = _IDLE_POLL_MS
        self.in_collective = False  # a DP rank waiting on its peers (stall detection counts it)
        self._outbox: list[proto.TokenChunk | proto.GenerateResult] = []
        self._cleanup_announced = False
        self.window = BurstWindow(False)  # set by run() once the backend says whether it waits
        # Test-only fault injection for any model (the echo engine always has it).
        self.faults = (os.environ.get("ENGINED_FAULT_INJECTION") == "1"
                       or config.model == "builtin:echo")

    # --- entry point -------------------------------------------------------------------------
    @staticmethod
    def run_engine_core(config: proto.EngineConfig | dict | str) -> NoReturn:
        """Process entry: never returns; exits with the DESIGN exit-code contract."""
        _die_with_parent()
        _restore_nofile()
        stop = _StopFlag()
        signal.signal(signal.SIGTERM, stop.handler)
        signal.signal(signal.SIGINT, stop.handler)
        code = contract.EXIT_OK
        core: EngineCoreProc | None = None
        try:
            cfg = _coerce_config(config)
            contract.set_process_title(f"engined: {cfg.name} (incarnation {cfg.incarnation})",
                                       cfg.name)
            core = _core_class(cfg)(cfg, stop)
            core.run()
        except (EngineConfigError, msgspec.ValidationError) as exc:
            reason = " ".join(str(exc).split())  # one line: the daemon reads it back
            print(f"{contract.CONFIG_LINE_PREFIX}{reason}", file=sys.stderr, flush=True)
            code = contract.EXIT_CONFIG
        except StopRequested:
            pass
        except BaseException:  # noqa: BLE001 - the crash is logged, then reported by exit code
            traceback.print_exc()
            code = contract.EXIT_FAILURE
        finally:
            if core is not None:
                core.shutdown(reason=_exit_reason(code, stop))
        if code == contract.EXIT_OK and stop.signum is not None:
            code = contract.EXIT_SIGNAL_BASE + stop.signum
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    # --- lifecycle ---------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.config
        self._send(proto.Hello(cfg.name, cfg.incarnation, os.getpid()))
        started = time.monotonic()
        # Started before the build applies memory_limit, so that its stack is part of the
        # address space the limit starts from, not taken from the headroom the limit leaves
        # (engine.memory); it beats once READY is out (heartbeats come only past READY).
        self._heartbeat = _HeartbeatThread(self)
        self._heartbeat.start()
        self.build()
        assert self.model is not None
        self.table = RequestTable(self.model, cfg.name, cfg.incarnation, self._send_requests)
        self.window = BurstWindow(self.model.burst_window)
        load_s = time.monotonic() - started
        # The loop's progress stamp starts now, not when this object was built: with the build's
        # time in it, the first request after a load longer than stall_timeout looked like
        # "busy, no progress for load_s" and got a healthy engine killed as stalled.
        self._stamp()
        # READY goes where requests flow: when the daemon reads it, it can route to us.
        self._send_now(proto.Ready(cfg.name, cfg.incarnation, load_s, self.model.device,
                                   cfg.model, self.model.dtype, self.model.gpu_memory(),
                                   self.memory_plan, getattr(self.model, "cache_info", {})))
        print(f"[ready] {cfg.name} incarnation {cfg.incarnation} loaded in {load_s:.3f}s "
              f"on {self.model.device}", file=sys.stderr, flush=True)
        self._heartbeat.begin()
        self.busy_loop()

    def build(self) -> None:
        """Lazy initialisation, inside the child: the model (and, for DP ranks, the group)."""
        self.model = build_backend(self.config, self._progress)
        limit = self.config.memory_limit
        if limit is not None:
            if self.faults:  # `!grow`: memory mapped before the limit, touched after it
                _BALLAST.append(mmap.mmap(-1, limit))
            try:
                done = memory.apply_memory_limit(limit, self.model.device,
                                                 sys.modules.get("torch"))
            except memory.MemoryLimitError as exc:
                raise EngineConfigError(str(exc)) from None
            done.update(getattr(self.model, "sizing", {}))  # vLLM's KV cache, as sized
            self.memory_plan = done
            print(f"[memory] {self.config.name} memory_limit {limit} bytes: "
                  + ", ".join(f"{k} {v:.0f}" if k.endswith("_bytes") else f"{k} {v:g}"
                              for k, v in done.items()), file=sys.stderr,
                  flush=True)

    # --- what the heartbeat thread reads ------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.model is not None and self.model.has_work() or bool(
            self.table and self.table.active)

    def busy_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.requests, zmq.POLLIN)
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        poller.register(wake_r, zmq.POLLIN)
        assert self.table is not None
        try:
            while True:
                was_idle = not self.busy
                if was_idle:
                    self.window.first_step_done(0)  # it finished before anything else came
                ready = dict(poller.poll(0 if self.busy else self.idle_poll_ms))
                if wake_r in ready:
                    _drain_fd(wake_r)
                if self.requests in ready:
                    self._admit(was_idle)
                    self._flush()  # rejections
                elif not was_idle:
                    self.window.first_step_done(0)
                if not self.iterate():
                    break
                self._flush()
                self.iteration += 1
                self.last_iteration_at = time.monotonic()
                idle = not self.busy
                self.trimmer.after(not was_idle and idle, idle, self.last_iteration_at)
            self.table.fail_all("engine stopping")
            self._flush()
        finally:
            signal.set_wakeup_fd(-1)
            os.close(wake_r)
            os.close(wake_w)

    def _admit(self, was_idle: bool) -> None:
        """Take what arrived; on an idle engine, maybe what arrives right behind it too."""
        assert self.table is not None
        before = len(self.table.active)
        self._take_requests()
        if was_idle and self.window.wanted:
            self._coalesce()
        taken = len(self.table.active) - before
        if not was_idle:
            self.window.first_step_done(taken)
        elif taken:
            self.window.started(taken)

    def _coalesce(self) -> None:
        """Work arrived on an idle engine: take what arrives right behind it into the same step.

        The transformers backend cannot add requests to a running `generate`, so a burst split
        as [7+1] costs two full generations; with vLLM a burst split as [1+7] costs one more
        step (measured on tiny-llama: 17 steps instead of 16, +9 % on the round, in 12 of 40
        bursts of 8 whose first step began before the other 7 reached the child). Wait while
        requests keep coming (gaps under _COALESCE_GAP_S), at most _COALESCE_MAX_S, never past a
        full batch: a lone request pays one empty poll of the gap, until `BurstWindow` has seen
        enough of them to stop waiting.
        """
        assert self.table is not None
        deadline = time.monotonic() + _COALESCE_MAX_S
        while len(self.table.active) < self.config.max_batch_size and not self.stop.set:
            left = deadline - time.monotonic()
            if left <= 0 or not self.requests.poll(int(min(_COALESCE_GAP_S, left) * 1000) or 1):
                return
            self._take_requests()

    def iterate(self) -> bool:
        """One busy-loop iteration; False ends the loop (stop requested)."""
        if self.stop.set:
            return False
        if _WEDGED_WHEN_IDLE and not self.busy:  # `!wedge` (fault injection)
            while not self.stop.set:
                time.sleep(0.1)
            return False
        if self.model is not None and self.model.has_work():
            self.run_step(self._stamp)
        return True

    def run_step(self, on_token: Callable[[], None]) -> None:
        """One backend step: new tokens go out as they come."""
        assert self.model is not None and self.table is not None
        if self._faulty:
            _inject_faults(self._faulty)
        self.table.started()
        self.model.step(self.table.on_event, on_token)

    def _stamp(self) -> None:
        """Progress inside a long step (per token), so only a really stuck loop looks stalled;
        what the token produced goes out now (a step of the transformers backend is a whole
        generation)."""
        self.last_iteration_at = time.monotonic()
        self._flush()

    def announce_cleanup(self, reason: str) -> None:
        """Tell the daemon the silence that follows is a cleanup, not a hang (once)."""
        if not self._cleanup_announced:
            self._cleanup_announced = True
            cfg = self.config
            self._send(proto.Progress(cfg.name, cfg.incarnation, proto.PHASE_CLEANUP, reason))

    def shutdown(self, reason: str) -> None:
        """The `finally`: stop heartbeats, free the model, report what was freed, close sockets."""
        self.announce_cleanup(reason)
        if self._heartbeat is not None:
            self._heartbeat.stop()
        report: dict[str, float] = {}
        if self.model is not None:
            report.update(self.model.close())
            self.model = None
        report["gc_collected"] = float(gc.collect())
        report.update(_release_cuda())
        cfg = self.config
        print(f"[cleanup] {cfg.name} incarnation {cfg.incarnation} reason={reason} "
              + " ".join(f"{k}={v:g}" for k, v in sorted(report.items())),
              file=sys.stderr, flush=True)
        self._send(proto.Goodbye(cfg.name, cfg.incarnation, reason, report))
        self.control.close(linger=_LINGER_MS)
        self.requests.close(linger=0)
        self.ctx.term()

    # --- helpers -----------------------------------------------------------------------------
    def _socket(self, kind: int, endpoint: str, identity: bool = False) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        sock.setsockopt(zmq.SNDTIMEO, 1000)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        # engined re-binds its sockets when it upgrades in place: be back within milliseconds
        sock.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_MAX_MS)
        if identity:
            sock.setsockopt(zmq.IDENTITY,
                            contract.routing_id(self.config.name, self.config.incarnation))
        sock.connect(endpoint)
        return sock

    def _send(self, message: msgspec.Struct) -> None:
        try:
            self.control.send(proto.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the daemon is not reading (gone or overloaded); heartbeats are best effort

    def _progress(self, phase: str, detail: str = "") -> None:
        if self.stop.set:
            raise StopRequested(phase)
        self._send(proto.Progress(self.config.name, self.config.incarnation, phase, detail))
        print(f"[load] {self.config.name} {phase} {detail}".rstrip(), file=sys.stderr, flush=True)

    def _take_requests(self) -> None:
        assert self.table is not None
        while True:
            try:
                frame = self.requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = proto.decode_request(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                print(f"[ipc] {self.config.name} dropped malformed request frame: {exc}",
                      file=sys.stderr, flush=True)
                continue
            if isinstance(msg, proto.GenerateRequest):
                if self.faults and msg.prompt.startswith(("!stall", "!raise", "!grow", "!wedge")):
                    self._faulty.append(msg)
                self.table.admit(msg)
            elif isinstance(msg, proto.Abort):
                self.table.abort(msg.id)
            # proto.Wake only had to end the poll: a DP peer has work, join the next step.

    def _send_requests(self, message: proto.TokenChunk | proto.GenerateResult) -> None:
        """Queued: what one step produced goes out together (`_flush`)."""
        self._outbox.append(message)

    def _flush(self) -> None:
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        self._send_now(items[0] if len(items) == 1 else proto.Results(items))

    def _send_now(self, message: msgspec.Struct) -> None:
        try:
            self.requests.send(proto.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the daemon is gone or not reading; it fails the request itself


class DPEngineCoreProc(EngineCoreProc):
    """One rank of a data-parallel group (torch.distributed: gloo on CPU, nccl on GPU).

    Ranks step in lockstep while any of them has work: each iteration they agree (one
    all_reduce) on the number of token steps to run and on whether anyone is stopping; ranks
    with a batch generate it with one collective per token, idle ranks run that many dummy
    steps. With no work anywhere they idle in the poll; a Wake from the daemon starts the next
    step at once. A rank blocked in a collective reports `in_collective`, so a peer that froze
    shows up as a stall on this side too.
    """

    def __init__(self, config: proto.EngineConfig, stop: _StopFlag | None = None) -> None:
        if not config.rendezvous:
            raise EngineConfigError("data-parallel rank without a rendezvous address")
        super().__init__(config, stop)
        self.idle_poll_ms = _DP_IDLE_POLL_MS
        self.dist: Any = None
        self._flags: Any = None
        self._tokens_synced = 0

    def build(self) -> None:
        super().build()
        if self.faults and os.environ.get("ENGINED_FAULT_BUILD_RANK") == str(self.config.rank):
            raise RuntimeError(f"fault injected: rank {self.config.rank} fails to build")
        self._join_group()

    def _join_group(self) -> None:
        cfg = self.config
        self._progress("rendezvous", f"rank {cfg.rank}/{cfg.replicas} at {cfg.rendezvous}")
        import datetime

        import torch
        import torch.distributed as dist

        backend = "nccl" if cfg.gpus else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{cfg.rendezvous}", rank=cfg.rank,
                                world_size=cfg.replicas,
                                timeout=datetime.timedelta(seconds=_DIST_TIMEOUT_S))
        self.dist = dist
        device = "cuda:0" if cfg.gpus else "cpu"
        check = torch.ones(1, device=device)
        dist.all_reduce(check)  # READY only once every peer answered a collective
        if int(check.item()) != cfg.replicas:
            raise RuntimeError(f"group check failed: {check.item()} != {cfg.replicas}")
        self._flags = torch.zeros(2, dtype=torch.int64, device=device)
        self._progress("group", f"{cfg.replicas} ranks joined ({backend})")

    def iterate(self) -> bool:
        assert self.model is not None
        local_steps = self.model.pending_tokens()
        steps, stopping = self._agree(local_steps, self.stop.set)
        if stopping:
            return False  # what is still queued is answered "engine stopping" by the loop
        if local_steps:
            self._tokens_synced = 0
            self.run_step(self._lockstep_token)
            remaining = steps - self._tokens_synced  # peers' batches may run longer than ours
        else:
            remaining = steps
        for _ in range(remaining):
            self._dummy_step()
        return True

    def _agree(self, local_steps: int, stopping: bool) -> tuple[int, bool]:
        self._flags[0], self._flags[1] = local_steps, int(stopping)
        self._collective(self._flags)
        return int(self._flags[0].item()), bool(self._flags[1].item())

    def _collective(self, tensor: Any) -> None:
        self.in_collective = True
        try:
            self.dist.all_reduce(tensor, op=self.dist.ReduceOp.MAX)
        finally:
            self.in_collective = False

    def _lockstep_token(self) -> None:
        self._sync_step()
        self._tokens_synced += 1

    def _dummy_step(self) -> None:
        assert self.model is not None
        self.model.dummy_step()
        self._sync_step()

    def _sync_step(self) -> None:
        """The collective every rank's forward takes part in (as an MoE all-to-all would)."""
        self._flags[0], self._flags[1] = 0, 0
        self._collective(self._flags)
        self._stamp()

    def shutdown(self, reason: str) -> None:
        self.announce_cleanup(reason)  # before a destroy that may wait on dead peers
        if self.dist is not None and self.dist.is_initialized():
            try:
                self.dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001 - a dead peer must not stop our cleanup
                print(f"[cleanup] {self.config.name} destroy_process_group: {exc}",
                      file=sys.stderr, flush=True)
        super().shutdown(reason)


class _HeartbeatThread(threading.Thread):
    """Sends heartbeats with the busy loop's progress stamp from its own socket.

    A thread, so that a long model step does not miss heartbeats; it reports the loop's stamp,
    so a stuck loop still shows as stalled. A GIL-holding hang or SIGSTOP silences it (hang).
    """

    def __init__(self, core: EngineCoreProc) -> None:
        super().__init__(name="engined-heartbeat", daemon=True)
        self.core = core
        self._stopped = threading.Event()
        self._begun = threading.Event()
        self._warned = False
        self.sock = core.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 4)  # a stale heartbeat is worthless: do not queue many
        self.sock.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_MS)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_MAX_MS)
        self.sock.connect(core.config.control_endpoint)

    def begin(self) -> None:
        """Beat from now on (the thread was started earlier, before memory_limit)."""
        self._begun.set()

    def run(self) -> None:
        interval_s = self.core.config.heartbeat_interval_s
        self._begun.wait()
        while not self._stopped.is_set():
            self._beat()
            if self._stopped.wait(interval_s):
                break
        self.sock.close(linger=0)

    def _beat(self) -> None:
        try:
            self._send_beat()
        except Exception as exc:  # noqa: BLE001 - a dead heartbeat thread would read as a hang
            if not self._warned:
                self._warned = True
                print(f"[heartbeat] {self.core.config.name}: cannot build a heartbeat: "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    def _send_beat(self) -> None:
        core, cfg = self.core, self.core.config
        model, table = core.model, core.table
        load = model.load() if model is not None else None
        hb = proto.Heartbeat(cfg.name, cfg.incarnation, core.iteration,
                             core.last_iteration_at, load.waiting if load else 0,
                             load.running if load else 0,
                             table.ok if table else 0, table.failed if table else 0,
                             model.gpu_memory() if model is not None else [],
                             core.in_collective, table.tokens if table else 0,
                             load.kv_cache_usage if load else None,
                             load.batch_limit if load else None,
                             load.oom_total if load else 0,
                             memory.headroom(cfg.memory_limit,
                                             model.device if model is not None else "cpu",
                                             sys.modules.get("torch")))
        try:
            self.sock.send(proto.encode(hb), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def stop(self) -> None:
        self._stopped.set()
        self._begun.set()
        self.join(timeout=2.0)


# --- module helpers ------------------------------------------------------------------------------
def _validate(config: proto.EngineConfig) -> None:
    if config.max_batch_size < 1:
        raise EngineConfigError(f"max_batch_size must be >= 1, got {config.max_batch_size}")
    if config.heartbeat_interval_s <= 0:
        raise EngineConfigError("heartbeat_interval_s must be > 0")
    if not 0 <= config.rank < max(config.replicas, 1):
        raise EngineConfigError(f"rank {config.rank} outside 0..{config.replicas - 1}")


def _coerce_config(config: proto.EngineConfig | dict | str) -> proto.EngineConfig:
    if isinstance(config, proto.EngineConfig):
        return config
    if isinstance(config, dict):
        return msgspec.convert(config, proto.EngineConfig)
    return proto.decode_config(config)


def _core_class(config: proto.EngineConfig) -> type[EngineCoreProc]:
    return DPEngineCoreProc if config.data_parallel else EngineCoreProc


def _exit_reason(code: int, stop: _StopFlag) -> str:
    if stop.signum is not None:
        return f"signal {signal.Signals(stop.signum).name}"
    return {contract.EXIT_OK: "clean", contract.EXIT_CONFIG: "config"}.get(code, "exception")


_BALLAST: list[mmap.mmap] = []  # `!grow`'s mapping (fault injection, under memory_limit)
_WEDGED_WHEN_IDLE: list[bool] = []  # `!wedge`: the busy loop stops once idle


def _inject_faults(requests: list[proto.GenerateRequest]) -> None:
    """`!stall`: the step wedges (the loop stops progressing, heartbeats go on); `!raise`: the
    busy loop raises; `!grow` (with a memory_limit): the engine's resident memory grows past its
    limit without an allocation failing, as memory mapped before the limit (weights paged in)
    would: every page of a mapping made before the limit is touched; `!wedge`: once the engine
    is idle again its busy loop stops (heartbeats go on), as a deadlock while idle would.
    Enabled for builtin:echo and wherever ENGINED_FAULT_INJECTION=1."""
    for req in requests:
        if req.prompt.startswith("!wedge") and not _WEDGED_WHEN_IDLE:
            _WEDGED_WHEN_IDLE.append(True)
        if req.prompt.startswith("!grow"):
            for ballast in _BALLAST:
                for offset in range(0, len(ballast), mmap.PAGESIZE):
                    ballast[offset] = 1
        if req.prompt.startswith("!stall"):
            while True:
                time.sleep(_STALL_FAULT_S)
        if req.prompt.startswith("!raise"):
            raise RuntimeError(f"fault injected by request {req.id} (!raise)")


def _drain_fd(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _release_cuda() -> dict[str, float]:
    """Release CUDA only if torch was imported and CUDA initialised; never import torch here."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return {}
    before_alloc = torch.cuda.memory_allocated()
    before_reserved = torch.cuda.memory_reserved()
    torch.cuda.synchronize()
    # cuBLAS keeps a workspace per handle and stream in torch's allocator (32 MiB on Hopper)
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()
    torch.cuda.ipc_collect()
    return {"cuda_allocated_before_bytes": float(before_alloc),
            "cuda_reserved_before_bytes": float(before_reserved),
            "cuda_allocated_after_bytes": float(torch.cuda.memory_allocated()),
            "cuda_reserved_after_bytes": float(torch.cuda.memory_reserved())}

