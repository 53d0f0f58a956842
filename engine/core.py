"""The engine-core child process.

The daemon execs ``python -m engined.engine``, which calls the static entry point
``EngineCoreProc.run_engine_core(config)``. Everything heavy (torch, transformers, the model) is
built lazily here, inside the child, never in the daemon. The lifecycle:

    HELLO -> Progress(phase...) -> READY -> busy loop (+ heartbeat thread)
          -> finally: cleanup, GOODBYE

Exit codes (DESIGN): 0 clean, 78 invalid engine config/model, 128+N after signal N, 1 crash.
The busy loop is here; its parts live beside it: the channels to the daemon (engine.channels),
the request table (engine.requests), the heartbeat thread (engine.heartbeat), the batching
window (engine.batching), the process's own setup and CUDA release (engine.process).
"""

from __future__ import annotations

import copy
import gc
import os
import signal
import sys
import time
import traceback
from typing import Any, Callable, NoReturn

import msgspec
import zmq

from engined.engine import contract, memory
from engined.engine import protocol as proto
from engined.engine.backend import Backend, EngineConfigError
from engined.engine.batching import COALESCE_GAP_S, COALESCE_MAX_S, BurstWindow
from engined.engine.build import build_backend
from engined.engine.channels import Channels
from engined.engine.heartbeat import HeartbeatThread
from engined.engine.process import (
    StopFlag,
    die_with_parent,
    drain_fd,
    release_cuda,
    restore_nofile,
)
from engined.engine.requests import RequestTable

_IDLE_POLL_MS = 500  # idle wake-up; a signal wakes the loop at once through the wakeup fd
_DP_IDLE_POLL_MS = 500  # DP ranks idle here; each wake-up costs one collective
_DIST_TIMEOUT_S = 600  # collectives and rendezvous; the daemon's stall/startup limits act first


class StopRequested(Exception):
    """Raised inside model building when SIGTERM/SIGINT arrived: stop loading, clean up."""


class EngineCoreProc:
    """One engine core: builds its model lazily, serves requests, heartbeats, cleans up."""

    def __init__(self, config: proto.EngineConfig, stop: StopFlag | None = None) -> None:
        _validate(config)
        self.config = copy.deepcopy(config)
        self.stop = stop or StopFlag()
        self.model: Backend | None = None
        self.memory_plan: dict[str, float] = {}  # what memory_limit set (engine.memory)
        self.table: RequestTable | None = None
        self.channels = Channels(self.config)
        self.trimmer = memory.Trimmer()
        self.iteration = 0
        self.last_iteration_at = time.monotonic()
        self._heartbeat: HeartbeatThread | None = None
        self.idle_poll_ms = _IDLE_POLL_MS
        self.in_collective = False  # a DP rank waiting on its peers (stall detection counts it)
        self._cleanup_announced = False
        self.window = BurstWindow(False)  # set by run() once the backend says whether it waits

    # --- entry point -------------------------------------------------------------------------
    @staticmethod
    def run_engine_core(config: proto.EngineConfig | dict | str) -> NoReturn:
        """Process entry: never returns; exits with the DESIGN exit-code contract."""
        die_with_parent()
        restore_nofile()
        stop = StopFlag()
        stop.install()
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
        self.channels.send(proto.Hello(cfg.name, cfg.incarnation, os.getpid()))
        started = time.monotonic()
        # Started before the build applies memory_limit, so that its stack is part of the
        # address space the limit starts from, not taken from the headroom the limit leaves
        # (engine.memory); it beats once READY is out (heartbeats come only past READY).
        self._heartbeat = HeartbeatThread(self, self.channels.heartbeat_socket())
        self._heartbeat.start()
        self.build()
        assert self.model is not None
        self.table = RequestTable(self.model, cfg.name, cfg.incarnation, self.channels.reply)
        self.window = BurstWindow(self.model.burst_window)
        load_s = time.monotonic() - started
        # The loop's progress stamp starts now, not when this object was built: with the build's
        # time in it, the first request after a load longer than stall_timeout looked like
        # "busy, no progress for load_s" and got a healthy engine killed as stalled.
        self._stamp()
        # READY goes where requests flow: when the daemon reads it, it can route to us.
        self.channels.send_now(proto.Ready(
            cfg.name, cfg.incarnation, load_s, self.model.device, cfg.model, self.model.dtype,
            self.model.gpu_memory(), self.memory_plan, self.model.cache_info,
            self.model.adapters()))
        print(f"[ready] {cfg.name} incarnation {cfg.incarnation} loaded in {load_s:.3f}s "
              f"on {self.model.device}", file=sys.stderr, flush=True)
        self._heartbeat.begin()
        self.busy_loop()

    def build(self) -> None:
        """Lazy initialisation, inside the child: the model (and, for DP ranks, the group)."""
        self.model = build_backend(self.config, self._progress, lambda: self.stop.set)
        limit = self.config.memory_limit
        if limit is not None:
            try:
                done = memory.apply_memory_limit(limit, self.model.device,
                                                 sys.modules.get("torch"))
            except memory.MemoryLimitError as exc:
                raise EngineConfigError(str(exc)) from None
            done.update(self.model.sizing)  # vLLM's KV cache, as sized
            self.memory_plan = done
            print(f"[memory] {self.config.name} memory_limit {limit} bytes: "
                  + ", ".join(f"{k} {v:.0f}" if k.endswith("_bytes") else f"{k} {v:g}"
                              for k, v in done.items()), file=sys.stderr,
                  flush=True)

    # --- the busy loop -----------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.model is not None and self.model.has_work() or bool(
            self.table and self.table.active)

    def busy_loop(self) -> None:
        poller = zmq.Poller()
        requests = self.channels.requests
        poller.register(requests, zmq.POLLIN)
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
                    drain_fd(wake_r)
                if requests in ready:
                    self._admit(was_idle)
                    self.channels.flush()  # rejections
                elif not was_idle:
                    self.window.first_step_done(0)
                if not self.iterate():
                    break
                self.channels.flush()
                self.iteration += 1
                self.last_iteration_at = time.monotonic()
                idle = not self.busy
                self.trimmer.after(not was_idle and idle, idle, self.last_iteration_at)
            self.table.fail_all("engine stopping")
            self.channels.flush()
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
        requests keep coming (gaps under COALESCE_GAP_S), at most COALESCE_MAX_S, never past a
        full batch: a lone request pays one empty poll of the gap, until `BurstWindow` has seen
        enough of them to stop waiting.
        """
        assert self.table is not None
        deadline = time.monotonic() + COALESCE_MAX_S
        requests = self.channels.requests
        while len(self.table.active) < self.config.max_batch_size and not self.stop.set:
            left = deadline - time.monotonic()
            if left <= 0 or not requests.poll(int(min(COALESCE_GAP_S, left) * 1000) or 1):
                return
            self._take_requests()

    def iterate(self) -> bool:
        """One busy-loop iteration; False ends the loop (stop requested)."""
        if self.stop.set:
            return False
        if self.model is not None and self.model.has_work():
            self.run_step(self._stamp)
        return True

    def run_step(self, on_token: Callable[[], None]) -> None:
        """One backend step: new tokens go out as they come."""
        assert self.model is not None and self.table is not None
        self.table.started()
        self.model.step(self.table.on_event, on_token)

    def _stamp(self) -> None:
        """Progress inside a long step (per token), so only a really stuck loop looks stalled;
        what the token produced goes out now (a step of the transformers backend is a whole
        generation)."""
        self.last_iteration_at = time.monotonic()
        self.channels.flush()

    def announce_cleanup(self, reason: str) -> None:
        """Tell the daemon the silence that follows is a cleanup, not a hang (once)."""
        if not self._cleanup_announced:
            self._cleanup_announced = True
            cfg = self.config
            self.channels.send(proto.Progress(cfg.name, cfg.incarnation, proto.PHASE_CLEANUP,
                                              reason))

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
        report.update(release_cuda())
        cfg = self.config
        print(f"[cleanup] {cfg.name} incarnation {cfg.incarnation} reason={reason} "
              + " ".join(f"{k}={v:g}" for k, v in sorted(report.items())),
              file=sys.stderr, flush=True)
        self.channels.send(proto.Goodbye(cfg.name, cfg.incarnation, reason, report))
        self.channels.close()

    # --- helpers -----------------------------------------------------------------------------
    def _progress(self, phase: str, detail: str = "") -> None:
        if self.stop.set:
            raise StopRequested(phase)
        self.channels.send(proto.Progress(self.config.name, self.config.incarnation, phase,
                                          detail))
        print(f"[load] {self.config.name} {phase} {detail}".rstrip(), file=sys.stderr, flush=True)

    def _take_requests(self) -> None:
        assert self.table is not None
        for msg in self.channels.receive():
            if isinstance(msg, proto.GenerateRequest):
                self.table.admit(msg)
            elif isinstance(msg, proto.Abort):
                self.table.abort(msg.id)
            # proto.Wake only had to end the poll: a DP peer has work, join the next step.


class DPEngineCoreProc(EngineCoreProc):
    """One rank of a data-parallel group (torch.distributed: gloo on CPU, nccl on GPU).

    Ranks step in lockstep while any of them has work: each iteration they agree (one
    all_reduce) on the number of token steps to run and on whether anyone is stopping; ranks
    with a batch generate it with one collective per token, idle ranks run that many dummy
    steps. With no work anywhere they idle in the poll; a Wake from the daemon starts the next
    step at once. A rank blocked in a collective reports `in_collective`, so a peer that froze
    shows up as a stall on this side too.
    """

    def __init__(self, config: proto.EngineConfig, stop: StopFlag | None = None) -> None:
        if not config.rendezvous:
            raise EngineConfigError("data-parallel rank without a rendezvous address")
        super().__init__(config, stop)
        self.idle_poll_ms = _DP_IDLE_POLL_MS
        self.dist: Any = None
        self._flags: Any = None
        self._tokens_synced = 0

    def build(self) -> None:
        super().build()
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


def _exit_reason(code: int, stop: StopFlag) -> str:
    if stop.signum is not None:
        return f"signal {signal.Signals(stop.signum).name}"
    return {contract.EXIT_OK: "clean", contract.EXIT_CONFIG: "config"}.get(code, "exception")
