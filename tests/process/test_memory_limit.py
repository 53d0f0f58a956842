"""Process level: memory_limit on a CPU (engine.memory) is RLIMIT_AS = the address space when the
limit is applied + the headroom the limit leaves over resident memory then. What the engine maps
after that comes out of the headroom, so its own threads start before: the heartbeat thread,
started after READY, used to take its stack (8 MiB) and, where the headroom had room, its malloc
arena (64 MiB reserved) from the headroom, nearly none of either ever resident (issue 43: a
memory test's window moved by those 8 MiB)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from engined.engine import contract
from engined.engine import protocol as proto
from testkit.enginechild import REPO_ROOT, Channels, _env, exit_of

MiB = 1 << 20
LIMIT = 512 * MiB  # far over an echo engine's need: room for a 64 MiB arena after the limit
# what an idle engine may still map after the limit (Python's own small arenas); a thread's
# stack is 8 MiB (2 MiB where RLIMIT_STACK is unlimited)
SLACK = 1 * MiB


def _vm_size(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize")


def _spawn(channels: Channels, cache: Path) -> subprocess.Popen[str]:
    config = proto.EngineConfig(
        name="mem-0", group="mem", rank=0, replicas=1, incarnation=1, model="builtin:echo",
        dtype=None, gpus=[], data_parallel=False, max_batch_size=8, threads=1,
        control_endpoint=channels.control_endpoint, request_endpoint=channels.request_endpoint,
        heartbeat_interval_s=0.05, memory_limit=LIMIT)
    env = {**_env(cache), contract.ENV_CONFIG: proto.encode_config(config),
           contract.ENV_PARENT_PID: str(os.getpid())}
    return subprocess.Popen([sys.executable, "-m", "engined.engine"], cwd=REPO_ROOT, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_nothing_the_engine_starts_after_its_memory_limit_takes_from_the_headroom(
        channels: Channels, tmp_path: Path, children):
    proc = _spawn(channels, tmp_path)
    children.append(proc)
    _, ready = channels.wait_ready(60)
    plan = ready.memory
    assert plan["memory_limit_bytes"] == LIMIT, plan
    at_limit = plan["address_space_limit_bytes"] - (LIMIT - plan["resident_at_limit_bytes"])
    beats = 0
    deadline = time.monotonic() + 30
    while beats < 10:  # the heartbeat thread runs (each beat allocates in it)
        beat = channels.next_control(max(0.01, deadline - time.monotonic()))
        if isinstance(beat, proto.Heartbeat):
            assert beat.memory_headroom is not None and beat.memory_headroom > 0, beat
            beats += 1
    grown = _vm_size(proc.pid) - at_limit
    headroom = LIMIT - plan["resident_at_limit_bytes"]
    assert grown <= SLACK, (f"{grown / MiB:.1f} MiB of address space mapped after the limit was "
                            f"applied, out of its headroom of {headroom / MiB:.0f} MiB")
    os.kill(proc.pid, signal.SIGTERM)
    code, out = exit_of(proc, 30)
    assert code == contract.EXIT_SIGNAL_BASE + signal.SIGTERM, (code, out[-2000:])
