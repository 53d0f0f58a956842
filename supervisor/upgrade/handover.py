"""An in-place upgrade: the running engined hands its engines to the engined now installed.

systemd's `daemon-reexec`, for one fleet. The same process re-executes itself, so its pid does
not change: engines stay its children (their exits are still ours to reap, so their pids
cannot be reused meanwhile: the strongest identity a process can have), systemd's MAINPID
stays right, and the guard (which kills everything when engined dies) sees no EOF, because the
write end of its pipe survives the exec like the listening sockets and the runtime lock.

The old code (`capture`, `prepare_exec`): new work waits in the listening sockets' backlogs
(nothing more is accepted; nothing is refused), the gateway's requests in flight finish, the
fork servers are told to exit (the next spawn starts a new one), and the state goes to
`<runtime_dir>/state.json` (supervisor.snapshot) with the descriptors to keep. Then exec.

The new code (`restore`): reads the snapshot named by ENGINED_HANDOVER before anything is
built on it, takes each replica's counters, history and live process back (pid checked: our
child, and the same start time), watches it by a new pidfd, reads its output pipe again and
waits for it to be reachable on the engine channels (ZeroMQ reconnects by itself) or, for a
command engine, for its probe, before the sockets accept again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import msgspec

from engined.engine import protocol as proto
from engined.supervisor import __version__
from engined.supervisor.host.exits import ChildWatcher
from engined.supervisor.host.guard import close_fds, pidfd_exited
from engined.supervisor.host.launcher import Child
from engined.supervisor.host.reaper import descendants
from engined.supervisor.lifecycle.incarnation import Incarnation
from engined.supervisor.lifecycle.policy import FailureHistory
from engined.supervisor.lifecycle.replica import Desired, Replica
from engined.supervisor.lifecycle.state import EngineState, Reason
from engined.supervisor.lifecycle.view import LastExit
from engined.supervisor.logs import PipeReader
from engined.supervisor.upgrade import snapshot

log = logging.getLogger("engined")

ENV_HANDOVER = "ENGINED_HANDOVER"  # the snapshot an exec'd engined resumes from
REATTACH_TIMEOUT_S = 5.0  # adopted engines not reachable by then are left to their liveness


class HandoverRejected(Exception):
    """The upgrade cannot go ahead; nothing changed."""


def capture(replicas: Iterable[Replica], now_mono: float,
            pidfds: dict[int, int] | None = None, **fields: Any) -> snapshot.Snapshot:
    """The replicas' state as a snapshot (their live processes with their output pipes and,
    for an exec, `pidfds`: the pidfds of those that are not our children, adopted after a
    crash, which are the only proof of them across the exec)."""
    out = []
    for replica in replicas:
        history = replica.history
        out.append(snapshot.Replica(
            name=replica.name, state=replica.state.value, desired=replica.desired.value,
            incarnation=replica.incarnation, since=replica.since,
            restarts={r.value: n for r, n in history.restarts.items()},
            requests=dict(history.requests),
            last_exit=history.last_exit.to_json() if history.last_exit else None,
            startup_s=history.startup_s, cpu_seconds_exited=history.cpu_seconds_exited,
            oom_exited=history.oom_exited,
            fail_reason=replica.fail_reason,
            restart_in_s=(replica.intent.spawn_due - now_mono
                          if replica.intent.spawn_due is not None else None),
            restart_reason=replica.intent.reason.value if replica.intent.reason else None,
            **_failures(replica.owner.failures(replica), now_mono),
            process=_process(replica.current, now_mono, spec_digest(replica.spec),
                             pidfds or {})))
    return snapshot.Snapshot(engined=__version__, pid=os.getpid(), written_at=time.time(),
                             replicas=out, **fields)


def _failures(history: FailureHistory, now: float) -> dict[str, Any]:
    return {"failures": [now - t for t in history.failure_times],
            "consecutive": history.consecutive, "shortages": history.shortages}


def spec_digest(spec: object) -> str:
    """What the spec an engine runs with is, in 16 hex digits: a new engined adopts a process
    only for the same spec (a changed one is started again, as a reload would)."""
    return hashlib.sha256(repr(spec).encode()).hexdigest()[:16]


def _process(inc: Incarnation | None, now: float, spec: str,
             pidfds: dict[int, int]) -> snapshot.Process | None:
    if inc is None or inc.child is None or not inc.alive or inc.vitals is None:
        return None
    child, vitals = inc.child, inc.vitals
    ticks = snapshot.start_ticks(child.pid)
    if ticks is None:
        return None
    ready = msgspec.structs.asdict(vitals.ready) if vitals.ready is not None else None
    return snapshot.Process(
        pid=child.pid, start_ticks=ticks, token=inc.token, address=inc.address,
        output_fd=inc.pipe.fd if inc.pipe is not None and not inc.pipe.closed else None,
        port=child.port, launcher=child.launcher, spawned_ago_s=now - child.spawned_at,
        ready_ago_s=now - vitals.ready_at if vitals.ready_at is not None else None,
        ready=ready, spec=spec, pidfd=pidfds.get(child.pid))


def check_handover(replicas: Iterable[Replica]) -> None:
    """An engine between states (spawning, stopping, a standby being promoted) is not handed
    over: the upgrade is refused until it settles."""
    busy = [f"{r.name} ({r.state.value})" for r in replicas
            if r.state in (EngineState.STARTING, EngineState.STOPPING)
            or (r.current is not None and not r.current.attached)]
    if busy:
        raise HandoverRejected(f"engines are starting or stopping: {', '.join(busy)}; "
                               f"nothing changed (try again once they settle)")


def keep_across_exec(fds: Iterable[int | None]) -> None:
    for fd in fds:
        if fd is not None:
            os.set_inheritable(fd, True)


# --- the new code's side ------------------------------------------------------------------------

def take(runtime_dir: Path) -> snapshot.Snapshot | None:
    """The hand-over this process was exec'd with (ENGINED_HANDOVER), once: the variable is
    removed so no engine inherits it."""
    path = os.environ.pop(ENV_HANDOVER, None)
    if path is None:
        return None
    found, why = snapshot.load(Path(path))
    try:
        Path(path).unlink()  # read once: a later start must not take it for its own
    except OSError:
        pass
    if found is None:
        log.error("[upgrade] the hand-over snapshot %s cannot be used (%s): starting fresh",
                  path, why)
        return None
    if found.pid != os.getpid():
        log.error("[upgrade] the hand-over snapshot %s is pid %d's, not ours: starting fresh",
                  path, found.pid)
        return None
    return found


class Claim(Protocol):
    """How a saved process is taken back: its pidfd (None: open one) and output pipe, or None
    if it is not provably the process saved."""

    def __call__(self, replica: Replica, process: snapshot.Process) -> \
            tuple[int | None, int] | None: ...


def exec_claim(replica: Replica, process: snapshot.Process) -> tuple[int | None, int] | None:
    """An upgrade in place: our child (its pid cannot have been reused) with the start time
    saved, and its output pipe kept across the exec."""
    if process.output_fd is None:
        close_fds(process.pidfd)
        return None
    if _ours(process):
        close_fds(process.pidfd)
        return None, process.output_fd
    if process.pidfd is not None and not pidfd_exited(process.pidfd) and \
            snapshot.start_ticks(process.pid) == process.start_ticks:
        return process.pidfd, process.output_fd  # adopted after a crash: its pidfd proves it
    log.warning("[upgrade] %s: pid %d is not the process handed over (gone, or not our "
                "child): starting it again", replica.name, process.pid)
    close_fds(process.output_fd, process.pidfd)
    return None


def restore(replica: Replica, saved: snapshot.Replica, watcher: ChildWatcher,
            now_mono: float, claim: Claim = exec_claim, how: str = "after an upgrade of "
            "engined in place") -> Incarnation | None:
    """The replica's record from `saved`; its live process adopted if `claim` proves it is the
    one saved. Returns the adopted incarnation (STARTING until it is reachable), or None (the
    replica spawns by its state, as at a start). `now_mono`: the snapshot's time."""
    restarts = {}
    for key, count in saved.restarts.items():
        try:
            restarts[Reason(key)] = count
        except ValueError:
            log.warning("[upgrade] %s: unknown restart reason %r ignored", replica.name, key)
    replica.history.restore(
        restarts, saved.requests, _last_exit(saved.last_exit) if saved.last_exit else None,
        saved.startup_s, saved.cpu_seconds_exited, saved.oom_exited)
    replica.owner.resume_failures(replica, FailureHistory(
        saved.consecutive, tuple(now_mono - ago for ago in saved.failures), saved.shortages))
    state, desired = EngineState(saved.state), Desired(saved.desired)
    process = saved.process
    taken = claim(replica, process) if process is not None else None
    if process is None or taken is None:
        if state is EngineState.FAILED:
            replica.restore(saved.incarnation, desired, state, fail_reason=saved.fail_reason)
        elif desired is not Desired.RUN:
            replica.restore(saved.incarnation, desired, EngineState.ASLEEP
                            if desired is Desired.ASLEEP else EngineState.STOPPED)
        elif saved.restart_in_s is not None:
            reason = Reason(saved.restart_reason) if saved.restart_reason is not None else None
            due = now_mono + max(0.0, saved.restart_in_s)
            replica.restore(saved.incarnation, desired, EngineState.BACKOFF, spawn_due=due,
                            reason=reason, restart_at=due if saved.restart_in_s > 0 else None)
        else:
            replica.restore(saved.incarnation, desired, replica.state)
        return None
    replica.restore(saved.incarnation, desired, replica.state)
    return _adopt(replica, process, taken, watcher, now_mono, saved.since, how)


def _adopt(replica: Replica, process: snapshot.Process, taken: tuple[int | None, int],
           watcher: ChildWatcher, now: float, since: float, how: str) -> Incarnation:
    deps = replica.deps
    pidfd, output_fd = taken
    inc = Incarnation(tuple(process.address),  # type: ignore[arg-type]
                      process.token, deps.liveness_for(replica.spec, lambda: inc))
    os.set_inheritable(output_fd, False)
    os.set_blocking(output_fd, False)
    exited = watcher.watch(process.pid, output_fd=output_fd, pidfd=pidfd)
    child = Child(process.pid, output_fd, exited,
                  spawned_at=now - process.spawned_ago_s, launcher=process.launcher,
                  port=process.port, descendant=process.pid in descendants(os.getpid()))
    inc.attach(child, PipeReader(deps.loop, output_fd, replica.log),
               replica.log.lines_total)
    vitals = inc.vitals
    assert vitals is not None
    if process.ready is not None:
        try:
            vitals.ready = msgspec.convert(process.ready, proto.Ready)
        except msgspec.ValidationError:
            vitals.ready = None  # what status shows of it (device, dtype) is lost, nothing else
    if process.ready_ago_s is not None:
        vitals.ready_at = now - process.ready_ago_s  # its READY run goes on (backoff reset)
    vitals.heartbeat_at = deps.clock.monotonic()  # judged by heartbeats from now; never by
    # its startup timeout
    # One that was READY is READY again once reachable; one still loading (adopted after a
    # crash) goes on loading: its own READY says when, its startup timeout still counts.
    inc.adopted_at, inc.reattaching = time.time(), process.ready_ago_s is not None
    inc.resumed_since = since if process.ready_ago_s is not None else None
    replica.adopt(inc)
    inc.liveness.begin(inc.address, child.port, replica.on_message, replica.intent.wakeup.set)
    replica.log.note(f"adopted pid {process.pid} (incarnation {inc.address[1]}) {how}")
    return inc


def _ours(process: snapshot.Process) -> bool:
    """Our child (so its pid cannot have been reused: we have not reaped it), born when the
    snapshot says."""
    return snapshot.parent_and_start(process.pid) == (os.getpid(), process.start_ticks)


def _last_exit(raw: dict[str, Any]) -> LastExit | None:
    try:
        return LastExit(raw.get("code"), raw.get("signal"), str(raw["reason"]),
                        float(raw["at"]), str(raw.get("description", "")),
                        tuple(str(line) for line in raw.get("log_tail") or ()))
    except (KeyError, TypeError, ValueError):
        return None


async def wait_reattached(pending: dict[Replica, Incarnation], reachable: Any,
                     timeout_s: float = REATTACH_TIMEOUT_S) -> list[str]:
    """Wait (bounded) until each adopted engine is READY again: an engine child once the
    engine channels can reach it (`reachable(address)`), a command engine once its probe
    passes (it delivers READY itself). Returns those still not READY at the bound."""
    deadline = time.monotonic() + timeout_s
    while True:
        for replica, inc in list(pending.items()):
            if replica.current is not inc or not inc.alive:
                del pending[replica]
            elif replica.state is EngineState.READY:
                del pending[replica]
            elif not replica.spec.is_command and reachable(inc.address):
                replica.reattached()
                del pending[replica]
        if not pending or time.monotonic() >= deadline:
            return sorted(r.name for r in pending)
        await asyncio.sleep(0.005)


def stop_orphan(process: snapshot.Process) -> None:
    """A handed-over process the new spec has no replica for: its group is told to stop (our
    child, so the reaper collects it)."""
    close_fds(process.output_fd)
    if _ours(process):
        for sig in (signal.SIGTERM, signal.SIGCONT):
            try:
                os.killpg(process.pid, sig)
            except OSError:
                pass


async def run_check(argv: list[str], watcher: ChildWatcher) -> tuple[int, str]:
    """Run `argv` (the new code's `engined --check`) as a child watched by its pidfd (the
    reaper leaves it alone); its exit code and output."""
    with tempfile.TemporaryFile() as out:
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "LISTEN_FDS",
                                                                 "LISTEN_PID", "WATCHDOG_USEC",
                                                                 "WATCHDOG_PID")}
        try:
            pid = os.posix_spawn(argv[0], argv, env, file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, out.fileno(), 1), (os.POSIX_SPAWN_DUP2, out.fileno(), 2)])
        except OSError as exc:
            raise HandoverRejected(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
        record = await watcher.watch(pid)
        out.seek(0)
        output = out.read(1 << 20).decode(errors="replace")
    status = record.status
    return (status.code if status.code is not None else 128 + (status.signal or 0)), output
