"""IPC abuse: hostile frames on the daemon's engine sockets are ignored, counted and logged.

Frames go to `ipc://<runtime_dir>/engines-control.sock` (the daemon's PULL, where children send
Hello/Progress/Heartbeat/Goodbye) from a PUSH socket, and to `engines-requests.sock` (the
daemon's ROUTER, where children send Ready and results) from a DEALER: random and truncated
frames, multi-part frames, valid messages of the wrong type or with wrong field types, stale
incarnations and unknown engines for every message type, frames past the size bound, and a
flood. Each is dropped and counted by kind (status `supervisor.ipc_dropped`, metric
`engined_ipc_dropped_messages_total`) and logged (`[ipc]`, rate-limited); no engine changes
state, pid, incarnation or restart count because of them.

The expected drop kind of every frame is computed here with the same decoder the daemon uses, so
the counts must match exactly. tests/e2e/test_control.py sends a fixed handful of such frames; this
file generates them.
"""

from __future__ import annotations

import os
import random
import re
import socket
import threading
import time
import urllib.request
from collections import Counter
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engined.engine import protocol as proto
from testkit.driver import Daemon

ECHO2 = {"name": "echo", "replicas": 2, "model": "builtin:echo"}
NAMES = ("echo-0", "echo-1")
HEARTBEAT_AGE_MAX_S = 1.0  # the fixture's heartbeat interval is 0.2 s, its timeout 1.5 s
FLOOD_FRAMES = 20_000


# --- sending ------------------------------------------------------------------------------------


class Sender:
    """A PUSH to the control channel and a DEALER to the request channel, like a child's."""

    def __init__(self, d: Daemon) -> None:
        self.ctx = zmq.Context()
        self.push = self._socket(zmq.PUSH, f"ipc://{d.runtime_dir}/engines-control.sock")
        self.dealer = self._socket(zmq.DEALER, f"ipc://{d.runtime_dir}/engines-requests.sock")

    def _socket(self, kind: int, endpoint: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 10_000)
        sock.setsockopt(zmq.SNDHWM, 0)  # queue everything: nothing may be dropped on our side
        sock.connect(endpoint)
        return sock

    def close(self) -> None:
        self.push.close()
        self.dealer.close()
        self.ctx.term()  # returns once everything queued was delivered (bounded by LINGER)


def _dropped(d: Daemon) -> Counter[str]:
    return Counter(d.status()["supervisor"]["ipc_dropped"])


def _state(d: Daemon) -> dict[str, tuple[Any, ...]]:
    return {n: (e["pid"], e["incarnation"], e["restarts"], e["state"], e["last_exit"])
            for n, e in d.engines().items()}


def _incarnations(d: Daemon) -> dict[str, int]:
    return {n: e["incarnation"] for n, e in d.engines().items()}


# --- what the daemon must make of each frame ---------------------------------------------------


def expected_control(frames: list[bytes], current: dict[str, int]) -> str | None:
    """The drop kind for a control-channel message, or None if the daemon would accept it."""
    if len(frames) != 1:
        return "malformed"
    try:
        msg = proto.decode_control(frames[0])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return "malformed"
    if msg.engine not in current:
        return "unknown_engine"
    if isinstance(msg, proto.Goodbye) and 0 < msg.incarnation <= current[msg.engine]:
        return None  # a late cleanup report is kept on purpose (it changes no state)
    if msg.incarnation != current[msg.engine]:
        return "stale"
    return None  # the current incarnation: a real engine's message (never generated here)


def expected_request(frames: list[bytes]) -> list[str]:
    """The drop kinds for frames a DEALER sends (the ROUTER prepends our identity, which is
    ZeroMQ's generated one: never an engine's `name:incarnation`): one per message carried."""
    if len(frames) != 1:
        return ["malformed"]
    try:
        msg = proto.decode_request(frames[0])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ["malformed"]
    if isinstance(msg, proto.Ready):
        return ["forged"]  # a READY must come from the engine's own routing identity
    if isinstance(msg, proto.Results):
        return ["stale"] * len(msg.items) if msg.items else ["malformed"]
    return ["stale" if isinstance(msg, (proto.GenerateResult, proto.TokenChunk))
            else "unexpected"]


# --- generated frames ----------------------------------------------------------------------------

_ENGINE_NAMES = st.sampled_from([*NAMES, "echo", "echo-2", "", "all", "ECHO-0", "echo-0 "]) \
    | st.text(max_size=12)
_INTS = st.integers(-(2**63), 2**63 - 1)
_FLOATS = st.floats(allow_nan=True, allow_infinity=True)


def _messages(incarnation: st.SearchStrategy[int]) -> st.SearchStrategy[msgspec.Struct]:
    gpu = st.builds(proto.GpuMemory, gpu=_INTS, allocated_bytes=_INTS, reserved_bytes=_INTS)
    return st.one_of(
        st.builds(proto.Hello, _ENGINE_NAMES, incarnation, _INTS),
        st.builds(proto.Progress, _ENGINE_NAMES, incarnation, st.text(max_size=8),
                  st.text(max_size=8)),
        st.builds(proto.Ready, _ENGINE_NAMES, incarnation, _FLOATS, st.text(max_size=5),
                  st.text(max_size=5), st.text(max_size=5), st.lists(gpu, max_size=2)),
        st.builds(proto.Heartbeat, _ENGINE_NAMES, incarnation, _INTS, _FLOATS, _INTS,
                  _INTS, _INTS, _INTS, st.lists(gpu, max_size=2), st.booleans()),
        st.builds(proto.Goodbye, _ENGINE_NAMES, incarnation, st.text(max_size=8),
                  st.dictionaries(st.text(max_size=5), _FLOATS, max_size=3)),
        st.builds(proto.GenerateRequest, st.text(max_size=8), st.text(max_size=8), _INTS),
        st.builds(proto.GenerateResult, st.text(max_size=8), _ENGINE_NAMES, incarnation,
                  st.text(max_size=8)),
        st.builds(proto.Wake),
        st.builds(proto.Results, st.lists(st.one_of(
            st.builds(proto.GenerateResult, st.text(max_size=8), _ENGINE_NAMES, incarnation),
            st.builds(proto.TokenChunk, st.text(max_size=8), _ENGINE_NAMES, incarnation,
                      st.lists(_INTS, max_size=3), st.text(max_size=4))), max_size=3)),
    )


def _raw_maps() -> st.SearchStrategy[bytes]:
    """msgpack maps close to real messages: a real tag with wrong, missing or extra fields."""
    tags = st.sampled_from(["hello", "progress", "ready", "hb", "bye", "gen", "result", "wake",
                            "tok", "results", "nope", ""])
    values = st.one_of(st.none(), st.booleans(), _INTS, _FLOATS, st.text(max_size=8),
                       st.binary(max_size=8), st.lists(_INTS, max_size=3))
    fields = st.dictionaries(st.sampled_from(["engine", "incarnation", "iteration", "pid",
                                              "waiting", "running", "id", "prompt", "phase",
                                              "cleanup", "gpu_memory", "x"]), values, max_size=8)
    return st.builds(lambda tag, f: msgspec.msgpack.encode({"type": tag, **f}), tags, fields)


@st.composite
def frames(draw: st.DrawFn, incarnation: st.SearchStrategy[int]) -> list[bytes]:
    kind = draw(st.sampled_from(["random", "truncated", "message", "raw map", "multipart"]))
    if kind == "random":
        return [draw(st.binary(max_size=300))]
    if kind == "raw map":
        return [draw(_raw_maps())]
    encoded = proto.encode(draw(_messages(incarnation)))
    if kind == "message":
        return [encoded]
    if kind == "truncated":
        return [encoded[:draw(st.integers(0, max(0, len(encoded) - 1)))]]
    parts = draw(st.lists(st.binary(max_size=40) | st.just(encoded), min_size=2, max_size=8))
    return parts


# --- tests ---------------------------------------------------------------------------------------


def test_generated_frames_are_dropped_and_counted_exactly(engined):
    d = engined([ECHO2])
    before = _state(d)
    current = _incarnations(d)
    # Stale or unknown: never the current incarnation of a real engine (that is an engine).
    incarnation = st.sampled_from([current[NAMES[0]] - 1, current[NAMES[0]] + 1, 0, -1, 2**63 - 1,
                                   -(2**63), 12345])
    sender = Sender(d)
    expected: Counter[str] = Counter()
    batches = 0

    @settings(max_examples=120, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(control=st.lists(frames(incarnation), max_size=6),
           requests=st.lists(frames(incarnation), max_size=4))
    def send(control: list[list[bytes]], requests: list[list[bytes]]) -> None:
        nonlocal batches
        batches += 1
        for parts in control:
            kind = expected_control(parts, current)
            assert kind is not None or _is_goodbye(parts), parts  # never a live engine's message
            if kind is not None:
                expected[kind] += 1
            sender.push.send_multipart(parts)
        for parts in requests:
            for kind in expected_request(parts):
                expected[kind] += 1
            sender.dealer.send_multipart(parts)

    try:
        send()
    finally:
        sender.close()
    assert batches >= 100
    d.wait_for(lambda: _dropped(d) == expected, 20,
               f"ipc_dropped == {dict(expected)} (now {dict(_dropped(d))})")
    d.holds(lambda: all(e["state"] == "READY" for e in d.engines().values()), 1.0, "READY")
    assert _state(d) == before
    assert re.search(r"WARNING \[ipc\] dropped (malformed|stale|unknown_engine|unexpected|forged) ",
                     d.stderr_text()), d.stderr_text()[-3000:]
    for name in NAMES:
        assert d.ctl("generate", "--engine", name, "served").stdout.strip() == "served"


def _is_goodbye(parts: list[bytes]) -> bool:
    try:
        return isinstance(proto.decode_control(parts[0]), proto.Goodbye)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False


@pytest.mark.smoke
def test_every_message_type_from_stale_and_unknown_engines(engined):
    """A deterministic sweep: each control message type, for a stale incarnation, a future one and
    an unknown engine; every truncation of a valid heartbeat; request-channel types."""
    d = engined([ECHO2])
    before = _state(d)
    inc = _incarnations(d)["echo-0"]
    sender = Sender(d)
    expected: Counter[str] = Counter()

    def messages(engine: str, incarnation: int) -> list[msgspec.Struct]:
        return [proto.Hello(engine, incarnation, os.getpid()),
                proto.Progress(engine, incarnation, "weights", "x"),
                proto.Ready(engine, incarnation, 1.0, "cpu", "builtin:echo", "none"),
                proto.Heartbeat(engine, incarnation, 1, 0.0, 5, 5),  # "busy", frozen loop
                proto.Goodbye(engine, incarnation, "forged", {"x": 1.0})]

    try:
        for engine, incarnation in (("echo-0", inc + 1), ("echo-1", inc + 100),
                                    ("nosuch", inc), ("", 1), ("echo", inc)):
            for msg in messages(engine, incarnation):
                frame = proto.encode(msg)
                expected[expected_control([frame], {n: inc for n in NAMES})] += 1
                sender.push.send(frame)
        # A stale heartbeat that, if applied, would look hung (seq 0, last iteration long ago)
        # and busy: applied, it would get a live engine killed for a stall.
        stale = proto.encode(proto.Heartbeat("echo-0", inc - 1, 0, 0.0, 9, 9))
        for _ in range(50):
            sender.push.send(stale)
        expected["stale"] += 50
        valid = proto.encode(proto.Heartbeat("echo-1", inc + 1, 7, time.monotonic(), 0, 0))
        for cut in range(len(valid)):  # every proper prefix
            sender.push.send(valid[:cut])
        expected["malformed"] += len(valid)
        for msg in (proto.GenerateRequest("r", "hi"), proto.Wake(),
                    proto.GenerateResult("nosuch", "echo-0", inc, "x")):
            sender.push.send(proto.encode(msg))  # request-channel types on the control channel
            sender.dealer.send(proto.encode(msg))
        expected["malformed"] += 3
        expected["unexpected"] += 2
        expected["stale"] += 1
    finally:
        sender.close()
    expected.pop(None, None)  # late Goodbyes are kept, not dropped
    d.wait_for(lambda: _dropped(d) == expected, 20,
               f"ipc_dropped == {dict(expected)} (now {dict(_dropped(d))})")
    d.holds(lambda: all(e["state"] == "READY" for e in d.engines().values()), 2.0, "READY")
    assert _state(d) == before


def test_oversized_frames_cost_the_sender_its_connection_not_the_daemon(engined):
    d = engined([ECHO2])
    before = _state(d)
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 5000)
        push.connect(f"ipc://{d.runtime_dir}/engines-control.sock")
        for _ in range(3):
            push.send(b"\x00" * (proto.MAX_FRAME_BYTES + 1))
        push.close()
    finally:
        ctx.term()
    # ZeroMQ drops a peer that sends past MAXMSGSIZE before the frame reaches the daemon: nothing
    # to count, and the daemon never held the frame. A well-behaved sender is still heard.
    sender = Sender(d)
    try:
        sender.push.send(b"\xc1")
    finally:
        sender.close()
    d.wait_for(lambda: _dropped(d) == Counter(malformed=1), 10, "the small frame counted")
    assert _state(d) == before


def test_flood_is_counted_logged_once_per_interval_and_heartbeats_keep_flowing(engined,
                                                                              rng: random.Random):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = engined([ECHO2], supervisor={"http": f"127.0.0.1:{port}"})
    before = _state(d)
    worst_age = [0.0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            ages = [e["heartbeat_age_s"] or 0.0 for e in d.engines().values()]
            worst_age[0] = max(worst_age[0], *ages)
            stop.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    began = time.monotonic()
    sender = Sender(d)
    try:
        junk = [rng.randbytes(16) for _ in range(64)]
        for i in range(FLOOD_FRAMES):
            sender.push.send(junk[i % len(junk)])
    finally:
        sender.close()
    d.wait_for(lambda: _dropped(d)["malformed"] == FLOOD_FRAMES, 30, "the flood counted")
    stop.set()
    watcher.join(timeout=10)
    took_s = time.monotonic() - began
    assert worst_age[0] < HEARTBEAT_AGE_MAX_S, worst_age[0]
    assert _state(d) == before
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert re.search(rf'^engined_ipc_dropped_messages_total\{{kind="malformed"\}} '
                     rf'{FLOOD_FRAMES}(\.0)?$', metrics, re.M), \
        [line for line in metrics.splitlines() if "ipc_dropped" in line]
    logged = len(re.findall(r"\[ipc\] dropped", d.stderr_text()))
    assert 1 <= logged <= took_s / 5.0 + 2, logged  # rate-limited: one line per 5 s at most


@pytest.mark.parametrize("identity", [b"echo-0:1", b"echo-1:999", b"\x00\xff", b"x" * 255])
def test_dealers_with_forged_identities_change_nothing(engined, identity):
    """A DEALER claiming a live engine's routing identity (the ROUTER refuses a second peer with
    an identity in use: nothing arrives), a stale one, or junk, sending results and a READY."""
    d = engined([ECHO2])
    before = _state(d)
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 5000)
        dealer.setsockopt(zmq.IDENTITY, identity)
        dealer.connect(f"ipc://{d.runtime_dir}/engines-requests.sock")
        for i in range(20):
            dealer.send(proto.encode(proto.GenerateResult(f"forged-{i}", "echo-0", 1, "x")))
        dealer.send(proto.encode(proto.Ready("echo-0", 1, 0.0, "cpu", "builtin:echo", "none")))
        dealer.close()
    finally:
        ctx.term()
    live = identity in (b"echo-0:1", b"echo-1:1")
    expected = Counter() if live else Counter(stale=20, forged=1)
    d.wait_for(lambda: _dropped(d) == expected, 10, f"ipc_dropped == {dict(expected)}")
    assert _state(d) == before
    # The real engines are still reachable through their own identities.
    for name in NAMES:
        assert d.ctl("generate", "--engine", name, "mine").stdout.strip() == "mine"
