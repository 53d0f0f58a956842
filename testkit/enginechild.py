"""An engine child driven the way the daemon drives one: ZeroMQ sockets bound here (a PULL for
control messages, a ROUTER for requests), the child started with `python -m engined.engine` and
an EngineConfig in its environment (under another interpreter too: a vLLM venv, with engine/
exposed to it as the daemon exposes it), and `Engine`, which sends requests to a READY child and
collects what comes back. Used by the process-level tests and the vLLM tier."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import zmq

from engined.engine import contract
from engined.engine import protocol as proto

REPO_ROOT = Path(__file__).resolve().parent.parent
LOAD_TIMEOUT_S = 120.0


class Channels:
    """The daemon's side: PULL for control messages, ROUTER for requests (bound here)."""

    def __init__(self, root: Path) -> None:
        self.ctx = zmq.Context()
        self.control_endpoint = f"ipc://{root}/control.sock"
        self.request_endpoint = f"ipc://{root}/requests.sock"
        self.control = self.ctx.socket(zmq.PULL)
        self.control.bind(self.control_endpoint)
        self.requests = self.ctx.socket(zmq.ROUTER)
        self.requests.bind(self.request_endpoint)
        for sock in (self.control, self.requests):
            sock.setsockopt(zmq.LINGER, 0)

    def next_control(self, timeout_s: float) -> proto.ControlMessage:
        if not self.control.poll(timeout_s * 1000):
            raise AssertionError(f"no control message within {timeout_s:g}s")
        return proto.decode_control(self.control.recv())

    def wait_ready(self, timeout_s: float) -> tuple[bytes, proto.Ready]:
        """The child's READY, which arrives on the request channel from its routing identity."""
        if not self.requests.poll(timeout_s * 1000):
            raise AssertionError(f"no READY within {timeout_s:g}s")
        identity, frame = self.requests.recv_multipart()
        ready = proto.decode_request(frame)
        assert isinstance(ready, proto.Ready), ready
        return identity, ready

    def queued_control(self) -> list[proto.ControlMessage]:
        """Control messages already queued (sent before what was just seen elsewhere)."""
        out = []
        while self.control.poll(200):
            out.append(proto.decode_control(self.control.recv()))
        return out

    def control_until(self, kind: type, timeout_s: float) -> list[proto.ControlMessage]:
        """Every control message up to and including the first of `kind`."""
        deadline = time.monotonic() + timeout_s
        seen = []
        while not seen or not isinstance(seen[-1], kind):
            seen.append(self.next_control(max(0.01, deadline - time.monotonic())))
        return seen

    def close(self) -> None:
        self.control.close()
        self.requests.close()
        self.ctx.term()


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINED_")}
    env.pop("PYTHONPATH", None)  # the installed engined package, not the source tree
    env.update({"ENGINED_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                "CUDA_VISIBLE_DEVICES": "",
                "HF_HUB_OFFLINE": "1", "ENGINED_FAULT_INJECTION": "1"})
    return env


def spawn_engine(channels: Channels, cache: Path, model: str, dtype: str | None = None,
                 extra_env: dict[str, str] | None = None, python: str | None = None,
                 log: Path | None = None, **config_fields: Any) -> subprocess.Popen[str]:
    """The child, its output piped (or in `log`: a chatty engine, vLLM, must not fill a pipe
    nobody reads), under `python` (another venv: engine/ is exposed to it on PYTHONPATH);
    `config_fields` go into its EngineConfig (backend, engine_args, adapters, ...)."""
    config = proto.EngineConfig(
        name="tiny-0", group="tiny", rank=0, replicas=1, incarnation=1, model=model, dtype=dtype,
        gpus=[], data_parallel=False, max_batch_size=8, threads=1,
        control_endpoint=channels.control_endpoint, request_endpoint=channels.request_endpoint,
        heartbeat_interval_s=0.2, **config_fields)
    env = {**_env(cache), contract.ENV_CONFIG: proto.encode_config(config),
           contract.ENV_PARENT_PID: str(os.getpid()), **(extra_env or {})}
    if python is not None:
        env["PYTHONPATH"] = str(_exposed_engine(cache.parent / "exposed-engine"))
    out = open(log, "w") if log is not None else None  # the child gets its own copy
    try:
        return subprocess.Popen([python or sys.executable, "-m", "engined.engine"],
                                cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=out or subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    finally:
        if out is not None:
            out.close()


def _exposed_engine(root: Path) -> Path:
    """A directory holding only engined/engine (a link to this tree's engine/), as the daemon
    gives another interpreter its engine package."""
    link = root / "engined" / "engine"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        try:
            link.symlink_to(REPO_ROOT / "engine", target_is_directory=True)
        except FileExistsError:  # another worker made it
            pass
    return root


def exit_of(proc: subprocess.Popen[str], timeout_s: float = LOAD_TIMEOUT_S) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out




class Engine:
    """One READY child and its sockets: send requests, collect what comes back per request id."""

    def __init__(self, channels: Channels, identity: bytes) -> None:
        self.channels, self.identity = channels, identity
        self.events: dict[str, list[tuple[float, Any]]] = {}

    def send(self, msg: proto.GenerateRequest | proto.Abort) -> None:
        self.channels.requests.send_multipart([self.identity, proto.encode(msg)])

    def pump(self, timeout_s: float) -> bool:
        """Read one message (False if none came within the timeout)."""
        if not self.channels.requests.poll(int(timeout_s * 1000)):
            return False
        _, frame = self.channels.requests.recv_multipart()
        for msg in proto.messages_of(proto.decode_request(frame)):
            self.events.setdefault(msg.id, []).append((time.monotonic(), msg))
        return True

    def result(self, request_id: str, timeout_s: float = 60.0) -> proto.GenerateResult:
        deadline = time.monotonic() + timeout_s
        while not self._final(request_id):
            assert time.monotonic() < deadline, f"no result for {request_id}"
            self.pump(max(0.01, deadline - time.monotonic()))
        return self._final(request_id)  # type: ignore[return-value]

    def ask(self, msg: proto.GenerateRequest, timeout_s: float = 60.0) -> proto.GenerateResult:
        """Send it and wait for its result."""
        self.send(msg)
        return self.result(msg.id, timeout_s)

    def _final(self, request_id: str) -> proto.GenerateResult | None:
        for _, msg in self.events.get(request_id, []):
            if isinstance(msg, proto.GenerateResult):
                return msg
        return None

    def chunks(self, request_id: str) -> list[tuple[float, proto.TokenChunk]]:
        return [(t, m) for t, m in self.events.get(request_id, [])
                if isinstance(m, proto.TokenChunk)]

    def text(self, request_id: str) -> str:
        """Everything delivered for a streamed request: the chunks, then the result's rest."""
        return "".join(c.text for _, c in self.chunks(request_id)) + self.result(request_id).text
