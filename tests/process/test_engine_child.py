"""Process level: a real tiny-llama engine child (`python -m engined.engine`), driven over ZeroMQ
sockets the test binds itself, as the daemon would: handshake, serving, SIGTERM cleanup, model
errors → 78."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from engined.engine import contract
from engined.engine import protocol as proto

REPO_ROOT = Path(__file__).resolve().parents[2]
LOAD_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def cache() -> Iterator[Path]:
    """A module-wide ENGINED_CACHE_DIR with the tiny-llama checkpoint built up front."""
    root = Path(tempfile.mkdtemp(prefix="engined-cache-"))
    done = subprocess.run([sys.executable, "-c", "from engined.engine.llm import tiny_llama_dir; "
                           "tiny_llama_dir(lambda phase, detail: None)"],
                          cwd=REPO_ROOT, env=_env(root), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    yield root
    shutil.rmtree(root, ignore_errors=True)


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


@pytest.fixture
def channels() -> Iterator[Channels]:
    root = Path(tempfile.mkdtemp(prefix="ec", dir="/tmp"))  # ipc:// paths must stay short
    chans = Channels(root)
    yield chans
    chans.close()
    shutil.rmtree(root, ignore_errors=True)


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINED_")}
    env.pop("PYTHONPATH", None)  # the installed engined package, not the source tree
    env.update({"ENGINED_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                "CUDA_VISIBLE_DEVICES": "",
                "HF_HUB_OFFLINE": "1", "ENGINED_FAULT_INJECTION": "1"})
    return env


def _spawn(channels: Channels, cache: Path, model: str, dtype: str | None = None,
           extra_env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    config = proto.EngineConfig(
        name="tiny-0", group="tiny", rank=0, replicas=1, incarnation=1, model=model, dtype=dtype,
        gpus=[], data_parallel=False, max_batch_size=8, threads=1,
        control_endpoint=channels.control_endpoint, request_endpoint=channels.request_endpoint,
        heartbeat_interval_s=0.2)
    env = {**_env(cache), contract.ENV_CONFIG: proto.encode_config(config),
           contract.ENV_PARENT_PID: str(os.getpid()), **(extra_env or {})}
    return subprocess.Popen([sys.executable, "-m", "engined.engine"], cwd=REPO_ROOT, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:  # by pid, only what this test started
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _exit(proc: subprocess.Popen[str], timeout_s: float = LOAD_TIMEOUT_S) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out


def test_handshake_serving_and_sigterm_cleanup(channels: Channels, cache: Path, children):
    proc = _spawn(channels, cache, "builtin:tiny-llama")
    children.append(proc)

    # READY comes where requests flow, from the child's routing identity: it is routable now.
    identity, ready = channels.wait_ready(LOAD_TIMEOUT_S)
    assert identity == b"tiny-0:1"
    assert (ready.device, ready.dtype, ready.model) == ("cpu", "float32", "builtin:tiny-llama")
    assert ready.load_s > 0 and ready.gpu_memory == []
    hello, *progress = channels.queued_control()
    assert isinstance(hello, proto.Hello) and hello.pid == proc.pid, (hello, progress)
    phases = [m.phase for m in progress if isinstance(m, proto.Progress)]
    assert [p for p in phases if p in ("import", "weights", "warmup")] == [
        "import", "weights", "warmup"], phases

    prompts = {f"r{i}": f"hello number {i}" for i in range(3)}
    for rid, prompt in prompts.items():
        channels.requests.send_multipart(
            [identity, proto.encode(proto.GenerateRequest(rid, prompt, max_tokens=16))])
    results = {}
    while len(results) < len(prompts):
        assert channels.requests.poll(60_000), results
        _, frame = channels.requests.recv_multipart()
        result = proto.decode_request(frame)
        assert isinstance(result, proto.GenerateResult) and result.error is None, result
        results[result.id] = result
    for rid, result in results.items():
        assert result.text and 0 < result.completion_tokens <= 16, result
        assert result.prompt_tokens == len(prompts[rid])  # byte-level tokenizer
        assert 1 <= result.batch_size <= len(prompts) and result.compute_s > 0, result

    # Heartbeats report the busy loop's progress: one soon counts the served requests.
    deadline = time.monotonic() + 30.0
    while True:
        beat = channels.next_control(max(0.01, deadline - time.monotonic()))
        if isinstance(beat, proto.Heartbeat) and beat.requests_ok == len(prompts):
            break
    assert beat.iteration > 0 and beat.requests_failed == 0 and beat.waiting == 0, beat

    os.kill(proc.pid, signal.SIGTERM)
    code, out = _exit(proc, 30)
    assert code == 128 + signal.SIGTERM, out
    goodbye = channels.control_until(proto.Goodbye, 5.0)[-1]
    assert goodbye.reason == "signal SIGTERM" and goodbye.cleanup.get("model_freed") == 1, goodbye
    assert "[cleanup] tiny-0 incarnation 1 reason=signal SIGTERM" in out, out


def test_exception_in_busy_loop_exits_1_after_cleanup(channels: Channels, cache: Path, children):
    proc = _spawn(channels, cache, "builtin:tiny-llama")
    children.append(proc)
    identity, _ = channels.wait_ready(LOAD_TIMEOUT_S)
    channels.requests.send_multipart([identity, proto.encode(proto.GenerateRequest("x", "!raise"))])
    code, out = _exit(proc, 30)
    assert code == 1, out
    assert "RuntimeError: fault injected by request x (!raise)" in out, out
    assert "[cleanup] tiny-0 incarnation 1 reason=exception" in out, out
    goodbye = channels.control_until(proto.Goodbye, 5.0)[-1]
    assert goodbye.reason == "exception" and goodbye.cleanup.get("model_freed") == 1, goodbye


def _model_case(case: str, cache: Path, tmp: Path) -> tuple[str, str | None]:
    (checkpoint,) = cache.glob("tiny-llama-*")
    if case == "missing":
        return str(tmp / "no-such-model"), None
    if case == "corrupt":
        broken = tmp / "corrupt"
        shutil.copytree(checkpoint, broken)
        (broken / "config.json").write_text("{not json")
        return str(broken), None
    return str(checkpoint), "float13"


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("corrupt", "corrupt"),
    ("dtype", "unknown dtype 'float13'"),
])
def test_model_error_exits_78(channels: Channels, cache: Path, children, tmp_path: Path,
                              case: str, message: str):
    model, dtype = _model_case(case, cache, tmp_path)
    proc = _spawn(channels, cache, model, dtype)
    children.append(proc)
    code, out = _exit(proc)
    assert code == contract.EXIT_CONFIG, out
    assert "[config] invalid engine config:" in out and message in out, out
    seen = channels.control_until(proto.Goodbye, 5.0)
    assert seen[-1].reason == "config", seen[-1]
    assert not channels.requests.poll(0), "no READY after a config error"


def test_loop_progress_is_stamped_from_ready_not_from_the_build(channels: Channels, cache: Path,
                                                                 children):
    """A heartbeat carries the busy loop's progress stamp. It used to start at the engine's
    construction, so after a load longer than stall_timeout the first heartbeat that saw the
    first request looked like "busy, no progress for load_s" and got the engine killed as
    stalled. Every heartbeat's stamp is now from after the load."""
    load_s = 1.5
    began = time.monotonic()
    proc = _spawn(channels, cache, "builtin:echo",
                  extra_env={"ENGINED_ECHO_LOAD_S": str(load_s), "ENGINED_ECHO_TOKEN_MS": "100"})
    children.append(proc)
    identity, ready = channels.wait_ready(60)
    channels.requests.send_multipart(  # the first request, at once (4 tokens of 100 ms)
        [identity, proto.encode(proto.GenerateRequest("first", "abcd", max_tokens=4))])
    beats: list[proto.Heartbeat] = []
    deadline = time.monotonic() + 30
    while len(beats) < 8:
        msg = channels.next_control(max(0.01, deadline - time.monotonic()))
        if isinstance(msg, proto.Heartbeat):
            beats.append(msg)
    assert any(b.running or b.waiting for b in beats), beats  # the request was seen busy
    assert min(b.last_iteration_at for b in beats) >= began + load_s, (began, beats)
    os.kill(proc.pid, signal.SIGTERM)
    assert _exit(proc, 30)[0] == 128 + signal.SIGTERM
