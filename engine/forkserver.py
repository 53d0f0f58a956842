"""`python -m engined.engine.forkserver`: a preloaded parent that forks engine children.

A cold engine spends most of its start importing its stack (torch and transformers: 1-2 s, vLLM:
8 s). The fork server imports it once; each engine is then a fork that goes straight to building
its model. It never builds a model, loads a tokenizer or touches CUDA: CUDA state must never
cross a fork, and a preloaded model would be copied into every child on write.

The channel is the socket on fd 3 (SOCK_SEQPACKET, one message per request: JSON, with the
engine's output pipe passed as SCM_RIGHTS). No ZeroMQ here: its I/O threads would be forked with
it. Messages:

    server -> daemon   {"ready": true, "pid", "preloaded", "import_s", "tasks", "tolerated"}
                       {"error": "..."}                   (preload failed: exit 78 follows)
    daemon -> server   {"env": {...}, "name": "tiny-0"}   + the output pipe's write end
    server -> daemon   {"pid": N} | {"error": "..."}      ("unsafe: ..." and the server exits)

Fork safety is checked before every fork: no `/dev/nvidia*` descriptor is open (CUDA or NVML
initialised), and the kernel tasks in /proc/self/task are the ones present when preloading ended
(`import torch` leaves a second task that `threading` does not see; vLLM a third). A task that
appeared since may hold a lock the child would inherit locked: the server refuses and exits, the
daemon starts engines by exec meanwhile and starts a new server.

Each engine is a grandchild: the server forks an intermediate that forks the engine and exits at
once, so the engine is re-parented to engined (a child subreaper) and a fork server's death costs
no engine. The engine waits until its parent is the daemon, then sets PR_SET_PDEATHSIG (set
before, the intermediate's exit would kill it), then applies its own configuration (session,
output, descriptors, environment, threads, RNG seeds) and enters
`EngineCoreProc.run_engine_core(config)` as an exec'd child does.
"""

from __future__ import annotations

import array
import ctypes
import importlib
import json
import os
import signal
import socket
import sys
import tempfile
import time
from typing import Any, NoReturn

from engined.engine import contract

CHANNEL_FD = 3
MAX_MESSAGE = 1 << 20
CUDA_DEVICE_PREFIX = "/dev/nvidia"
REPARENT_WAIT_S = 10.0
_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1
# what each kind of engine imports before its model (`engined.engine.core` always); a module
# with a `prepare_environment()` has it called right after its import (vLLM's settings must be
# in the environment before vLLM is imported)
PRELOADS = {
    "echo": (),
    # transformers imports lazily: the auto classes and the Llama modeling module (1.3 s of a
    # cold start by themselves) load only when first used, so they are named here
    "transformers": ("torch", "transformers", "transformers.models.auto.modeling_auto",
                     "transformers.models.auto.tokenization_auto",
                     "transformers.models.llama.modeling_llama", "transformers.generation.utils",
                     "safetensors.torch", "engined.engine.transformers_backend"),
    "vllm": ("engined.engine.vllm_backend", "torch", "vllm", "vllm.v1.engine.llm_engine"),
}


def tasks() -> set[int]:
    """This process's kernel tasks (threads), native ones included."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def task_names(ids: set[int]) -> list[str]:
    names = []
    for tid in sorted(ids):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            names.append(f"#{tid}")
    return names


def device_fds(prefix: str = CUDA_DEVICE_PREFIX) -> list[str]:
    """Open descriptors on GPU device files (/dev/nvidia0, /dev/nvidiactl, /dev/nvidia-uvm)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix):
            found.append(target)
    return sorted(set(found))


def unsafe(tolerated: set[int], prefix: str = CUDA_DEVICE_PREFIX) -> str | None:
    """Why forking now would be unsafe, or None."""
    held = device_fds(prefix)
    if held:
        return (f"the fork server has GPU devices open ({', '.join(held)}): CUDA must not "
                f"cross a fork")
    extra = tasks() - tolerated
    if extra:
        return (f"the fork server has {len(extra)} thread(s) it did not have after preloading "
                f"({', '.join(task_names(extra))}): a forked child could inherit a held lock")
    return None


class Server:
    def __init__(self, channel: socket.socket, preload: list[str]) -> None:
        self.channel = channel
        self.preload = preload
        self.tolerated: set[int] = set()

    def send(self, message: dict[str, Any]) -> None:
        self.channel.send(json.dumps(message).encode())

    def start(self) -> None:
        started = time.monotonic()
        kind = next((k for k, mods in PRELOADS.items() if list(mods) == self.preload), "engine")
        # before any fork: a forked engine's own title then works (see prepare_process_title)
        contract.prepare_process_title(f"{contract.FORK_SERVER_TITLE} ({kind})", "engined-fork")
        try:
            for name in ["engined.engine.core", *self.preload]:
                module = importlib.import_module(name)
                prepare = getattr(module, "prepare_environment", None)
                if callable(prepare):
                    prepare()
        except BaseException as exc:  # noqa: BLE001 - reported, then exit 78: no server here
            self.send({"error": f"preloading failed in {sys.executable}: "
                                f"{type(exc).__name__}: {exc}"})
            sys.exit(contract.EXIT_CONFIG)
        if os.environ.get("ENGINED_FAULT_FORKSERVER_THREAD") == "1":  # tests: an unsafe server
            import threading

            threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
            self.tolerated = tasks()
            threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
        else:
            self.tolerated = tasks()
        self.send({"ready": True, "pid": os.getpid(), "preloaded": self.preload,
                   "import_s": round(time.monotonic() - started, 3),
                   "tasks": len(self.tolerated), "tolerated": task_names(self.tolerated)})

    def serve(self) -> dict[str, Any] | None:
        """Answer spawn requests until the daemon closes the channel (None); in a forked engine,
        return its request instead."""
        while True:
            fds = array.array("i")
            try:
                data, ancdata, _flags, _addr = self.channel.recvmsg(
                    MAX_MESSAGE, socket.CMSG_SPACE(fds.itemsize))
            except InterruptedError:
                continue
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            if not data:
                return None
            request = _parse(data)
            if request is None or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                self.send({"error": "malformed spawn request"})
                continue
            out_fd = fds[0]
            why = unsafe(self.tolerated)
            if why is not None:
                self.send({"error": f"unsafe: {why}"})
                sys.exit(contract.EXIT_FAILURE)
            pid = self.fork(request, out_fd)
            if pid == 0:
                request["out_fd"] = out_fd
                return request
            os.close(out_fd)
            self.send({"pid": pid} if pid > 0 else {"error": "fork failed"})

    def fork(self, request: dict[str, Any], out_fd: int) -> int:
        """The engine's pid (>0), 0 in the engine itself, -1 if it could not be forked."""
        sys.stdout.flush()
        sys.stderr.flush()
        r, w = os.pipe()
        try:
            middle = os.fork()
        except OSError:
            os.close(r)
            os.close(w)
            return -1
        if middle == 0:  # the intermediate: fork the engine, tell its pid, exit
            os.close(r)
            try:
                engine = os.fork()
            except OSError:
                os._exit(1)
            if engine == 0:
                os.close(w)
                return 0
            os.write(w, str(engine).encode())
            os._exit(0)
        os.close(w)
        os.waitpid(middle, 0)  # the engine is the daemon's child from here on
        with os.fdopen(r, "rb") as f:
            text = f.read()
        return int(text) if text else -1


def _parse(data: bytes) -> dict[str, Any] | None:
    """A spawn request: {"env": {str: str, with the engine's config}, "name": str}."""
    try:
        request = json.loads(data)
    except ValueError:
        return None
    if not isinstance(request, dict) or not isinstance(request.get("name", ""), str):
        return None
    env = request.get("env")
    if not isinstance(env, dict) or contract.ENV_CONFIG not in env or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        return None
    return request


def become_engine(request: dict[str, Any], daemon: int) -> NoReturn:
    """In the forked engine: its own configuration first, then the engine core."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    out_fd = request["out_fd"]
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # no sibling's pipe, no server channel
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_DFL)
    env: dict[str, str] = request["env"]
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # found again from this child's TMPDIR (its own: supervisor/scratch)
    libc = ctypes.CDLL(None, use_errno=True)
    name = str(request.get("name", "engine"))[:15].encode()
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    deadline = time.monotonic() + REPARENT_WAIT_S
    while os.getppid() != daemon:  # until the intermediate has exited
        if time.monotonic() > deadline:
            os._exit(contract.EXIT_FAILURE)
        time.sleep(0.0002)
    if not contract.outlives_daemon(env):  # else the daemon's guard ends us, unadopted
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != daemon:
            os._exit(contract.EXIT_FAILURE)  # the daemon died in between
    _reseed(int(env.get("ENGINED_NUM_THREADS", "1")))
    from engined.engine.core import EngineCoreProc

    EngineCoreProc.run_engine_core(env[contract.ENV_CONFIG])


def _reseed(threads: int) -> None:
    """What an exec'd child gets for free: its own RNG streams, its own thread count."""
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(max(1, threads))  # OMP_NUM_THREADS was read when libgomp loaded
        torch.seed()


def main() -> None:
    daemon = int(os.environ.get(contract.ENV_PARENT_PID, "0"))
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # not inherited by forks
    if os.getppid() != daemon:
        sys.exit(contract.EXIT_FAILURE)  # the daemon is already gone
    channel = socket.socket(fileno=CHANNEL_FD)
    server = Server(channel, [m for m in sys.argv[1:] if m])
    server.start()
    request = server.serve()
    if request is None:
        sys.exit(0)
    channel.detach()  # closed with every other inherited descriptor in become_engine
    become_engine(request, daemon)


if __name__ == "__main__":
    main()
