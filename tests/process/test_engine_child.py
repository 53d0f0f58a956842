"""Process level: a real tiny-llama engine child (`python -m engined.engine`), driven over ZeroMQ
sockets the test binds itself, as the daemon would: handshake, serving, SIGTERM cleanup, model
errors → 78."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from engined.engine import contract
from engined.engine import protocol as proto
from testkit.enginechild import LOAD_TIMEOUT_S, Channels, exit_of, spawn_engine


def test_handshake_serving_and_sigterm_cleanup(channels: Channels, tiny_cache: Path, children):
    proc = spawn_engine(channels, tiny_cache, "builtin:tiny-llama")
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
        request = proto.GenerateRequest(rid, prompt, sampling=proto.Sampling(max_tokens=16))
        channels.requests.send_multipart([identity, proto.encode(request)])
    results = {}
    while len(results) < len(prompts):
        assert channels.requests.poll(60_000), results
        _, frame = channels.requests.recv_multipart()
        for result in proto.messages_of(proto.decode_request(frame)):
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
    code, out = exit_of(proc, 30)
    assert code == 128 + signal.SIGTERM, out
    goodbye = channels.control_until(proto.Goodbye, 5.0)[-1]
    assert goodbye.reason == "signal SIGTERM" and goodbye.cleanup.get("model_freed") == 1, goodbye
    assert "[cleanup] tiny-0 incarnation 1 reason=signal SIGTERM" in out, out


def test_exception_in_busy_loop_exits_1_after_cleanup(channels: Channels, tiny_cache: Path,
                                                       children):
    proc = spawn_engine(channels, tiny_cache, "builtin:tiny-llama")
    children.append(proc)
    identity, _ = channels.wait_ready(LOAD_TIMEOUT_S)
    channels.requests.send_multipart([identity, proto.encode(proto.GenerateRequest("x", "!raise"))])
    code, out = exit_of(proc, 30)
    assert code == 1, out
    assert "RuntimeError: fault injected by request x (!raise)" in out, out
    assert "[cleanup] tiny-0 incarnation 1 reason=exception" in out, out
    goodbye = channels.control_until(proto.Goodbye, 5.0)[-1]
    assert goodbye.reason == "exception" and goodbye.cleanup.get("model_freed") == 1, goodbye


def test_faults_are_injected_only_where_the_tests_ask(channels: Channels, tiny_cache: Path,
                                                      children):
    """Fault injection is a backend the tests select (engine.faults): without
    ENGINED_FAULT_INJECTION=1 a model engine takes `!raise` as any other prompt."""
    proc = spawn_engine(channels, tiny_cache, "builtin:tiny-llama",
                        extra_env={"ENGINED_FAULT_INJECTION": "0"})
    children.append(proc)
    identity, _ = channels.wait_ready(LOAD_TIMEOUT_S)
    request = proto.GenerateRequest("x", "!raise", sampling=proto.Sampling(max_tokens=4))
    channels.requests.send_multipart([identity, proto.encode(request)])
    assert channels.requests.poll(60_000), "no answer to !raise"
    _, frame = channels.requests.recv_multipart()
    result = proto.decode_request(frame)
    assert isinstance(result, proto.GenerateResult) and result.error is None, result
    assert result.completion_tokens > 0 and proc.poll() is None, result
    os.kill(proc.pid, signal.SIGTERM)
    assert exit_of(proc, 30)[0] == 128 + signal.SIGTERM


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
def test_model_error_exits_78(channels: Channels, tiny_cache: Path, children, tmp_path: Path,
                              case: str, message: str):
    model, dtype = _model_case(case, tiny_cache, tmp_path)
    proc = spawn_engine(channels, tiny_cache, model, dtype)
    children.append(proc)
    code, out = exit_of(proc)
    assert code == contract.EXIT_CONFIG, out
    assert "[config] invalid engine config:" in out and message in out, out
    seen = channels.control_until(proto.Goodbye, 5.0)
    assert seen[-1].reason == "config", seen[-1]
    assert not channels.requests.poll(0), "no READY after a config error"


def test_loop_progress_is_stamped_from_ready_not_from_the_build(channels: Channels,
                                                                 tiny_cache: Path, children):
    """A heartbeat carries the busy loop's progress stamp. It used to start at the engine's
    construction, so after a load longer than stall_timeout the first heartbeat that saw the
    first request looked like "busy, no progress for load_s" and got the engine killed as
    stalled. Every heartbeat's stamp is now from after the load."""
    load_s = 1.5
    began = time.monotonic()
    proc = spawn_engine(channels, tiny_cache, "builtin:echo",
                        extra_env={"ENGINED_ECHO_LOAD_S": str(load_s),
                                   "ENGINED_ECHO_TOKEN_MS": "100"})
    children.append(proc)
    identity, ready = channels.wait_ready(60)
    first = proto.GenerateRequest("first", "abcd", sampling=proto.Sampling(max_tokens=4))
    channels.requests.send_multipart([identity, proto.encode(first)])  # at once: 4 x 100 ms
    beats: list[proto.Heartbeat] = []
    deadline = time.monotonic() + 30
    while len(beats) < 8:
        msg = channels.next_control(max(0.01, deadline - time.monotonic()))
        if isinstance(msg, proto.Heartbeat):
            beats.append(msg)
    assert any(b.running or b.waiting for b in beats), beats  # the request was seen busy
    assert min(b.last_iteration_at for b in beats) >= began + load_s, (began, beats)
    os.kill(proc.pid, signal.SIGTERM)
    assert exit_of(proc, 30)[0] == 128 + signal.SIGTERM


def _heartbeats(channels: Channels, count: int, timeout_s: float = 30.0) -> list[proto.Heartbeat]:
    beats: list[proto.Heartbeat] = []
    deadline = time.monotonic() + timeout_s
    while len(beats) < count:
        msg = channels.next_control(max(0.01, deadline - time.monotonic()))
        if isinstance(msg, proto.Heartbeat):
            beats.append(msg)
    return beats


def test_an_idle_loop_stamps_its_progress_and_a_wedged_one_stops_while_heartbeats_go_on(
        channels: Channels, tiny_cache: Path, children):
    """The engine side of the idle-loop stall (the daemon's verdict at max(stall_timeout, 15 s)
    is pinned on the jumping clock, tests/lifecycle/test_replica.py; the whole wait end to end
    is the slow tier's): an idle busy loop comes round every 0.5 s and its heartbeats say so;
    once `!wedge` stops it while idle, the heartbeats (a thread of their own) go on, idle, with
    the stamp of the loop's last round."""
    proc = spawn_engine(channels, tiny_cache, "builtin:echo")
    children.append(proc)
    identity, _ = channels.wait_ready(60)
    idle = _heartbeats(channels, 8)  # 1.6 s at 0.2 s: the 0.5 s idle rounds show
    assert len({b.last_iteration_at for b in idle}) >= 2, idle
    assert all(b.running == 0 and b.waiting == 0 for b in idle), idle

    wedge = proto.GenerateRequest("w", "!wedge", sampling=proto.Sampling(max_tokens=2))
    channels.requests.send_multipart([identity, proto.encode(wedge)])
    assert channels.requests.poll(30_000), "the !wedge request was not answered"
    _heartbeats(channels, 3)  # past the request's last step
    after = _heartbeats(channels, 10)  # 2 s: four idle rounds, had the loop gone on
    assert len({b.last_iteration_at for b in after}) == 1, after
    assert all(b.running == 0 and b.waiting == 0 for b in after), after
    assert after[-1].iteration == after[0].iteration, after
    os.kill(proc.pid, signal.SIGTERM)
    assert exit_of(proc, 30)[0] == 128 + signal.SIGTERM
