"""End to end: operating the fleet through enginectl, and hostile input on every channel."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess

import msgspec
import pytest
import zmq

from engined.engine import protocol as proto
from testkit.driver import process_gone, read_until, stream_lines

ECHO2 = {"name": "echo", "replicas": 2, "model": "builtin:echo"}


def _pids(d) -> dict[str, int]:
    return {name: e["pid"] for name, e in d.engines().items()}


# --- stop / start / restart -------------------------------------------------------------------


@pytest.mark.smoke
def test_stop_start_restart_through_enginectl(engined):
    d = engined([ECHO2])
    first = _pids(d)

    out = d.ctl("stop", "echo-0")
    assert out.returncode == 0, out
    assert out.stdout.strip() == "echo-0: STOPPED"
    e0 = d.engine("echo-0")
    assert (e0["state"], e0["pid"], e0["desired"]) == ("STOPPED", None, "stopped")
    assert process_gone(first["echo-0"])
    assert d.engine("echo-1")["pid"] == first["echo-1"]  # the other replica is left alone
    d.holds(lambda: d.engine("echo-0")["state"] == "STOPPED", 0.6, "a stopped engine stays down")

    out = d.ctl("start", "echo-0")
    assert out.returncode == 0, out
    e0 = d.engine("echo-0")
    assert e0["state"] == "READY" and e0["desired"] == "run"
    assert e0["pid"] not in (None, first["echo-0"])
    assert out.stdout.strip() == f"echo-0: READY (pid {e0['pid']})"
    assert e0["last_exit"] is None  # an operator's stop is not a failure
    started = _pids(d)

    out = d.ctl("restart", "echo")
    assert out.returncode == 0, out
    assert len(out.stdout.strip().splitlines()) == 2
    engines = d.engines()
    for name in ("echo-0", "echo-1"):
        e = engines[name]
        assert e["state"] == "READY", e
        assert e["pid"] != started[name] and process_gone(started[name])
        assert e["restarts_by_reason"].get("manual") == 1, e
    restarted = _pids(d)

    out = d.ctl("restart", "all")
    assert out.returncode == 0, out
    engines = d.engines()
    for name in ("echo-0", "echo-1"):
        assert engines[name]["state"] == "READY"
        assert engines[name]["pid"] != restarted[name]
        assert engines[name]["restarts_by_reason"].get("manual") == 2
    assert d.ctl("generate", "ok").stdout.strip() == "ok"

    out = d.ctl("stop", "all")
    assert out.returncode == 0, out
    assert all(e["state"] == "STOPPED" and e["pid"] is None for e in d.engines().values())
    out = d.ctl("generate", "nobody home")
    assert out.returncode == 1 and "no READY engine" in out.stderr, out
    assert d.ctl("start", "all").returncode == 0
    d.wait_all_ready()


def test_restart_no_wait_returns_before_ready(engined):
    slow = {"name": "slow", "replicas": 1, "model": "builtin:echo",
            "env": {"ENGINED_ECHO_LOAD_S": "2"}}
    d = engined([slow], defaults={"startup_timeout": "60s"})
    old = d.engine("slow-0")["pid"]
    out = d.ctl("restart", "slow", "--no-wait")
    assert out.returncode == 0, out
    # It answered before the replacement (2 s to load) was READY, saying what was asked and the
    # state of the moment: the old engine, or one on its way down or up, never "READY (pid
    # <old pid>)" as if the restart were done.
    m = re.fullmatch(r"slow-0: restart requested \(was (\w+)(?:, pid (\d+))?\)\n", out.stdout)
    assert m, out.stdout
    state, pid = m.group(1), int(m.group(2) or 0)
    assert state in ("READY", "STOPPING", "STARTING"), out.stdout
    assert state != "READY" or pid == old, out.stdout
    new = d.wait_restarted("slow-0", old)
    assert new["restarts_by_reason"] == {"manual": 1}

    # Waiting (the default), it answers READY with the new pid.
    out = d.ctl("restart", "slow-0")
    assert out.returncode == 0, out
    after = d.engine("slow-0")
    assert after["state"] == "READY" and after["pid"] != new["pid"]
    assert out.stdout.strip() == f"slow-0: READY (pid {after['pid']})"


# --- bad input --------------------------------------------------------------------------------


def _assert_json_error(d, method: str, path: str, body: bytes | None = None,
                       status: int | None = None, headers: dict[str, str] | None = None) -> None:
    code, hdrs, raw = d.http(method, path, body,
                             {"Content-Type": "application/json", **(headers or {})})
    where = f"{method} {path} {body!r:.60}"
    assert 400 <= code < 500, (where, code, raw)
    if status is not None:
        assert code == status, (where, code, raw)
    assert hdrs.get("content-type", "").startswith("application/json"), (where, hdrs)
    data = json.loads(raw)
    assert isinstance(data, dict) and isinstance(data.get("error"), str) and data["error"], data


@pytest.mark.smoke
def test_bad_control_requests_leave_the_fleet_alone(engined):
    d = engined([ECHO2])
    before = d.engines()

    out = d.ctl("status", "nosuch")
    assert out.returncode == 1, out
    assert "nosuch" in out.stderr
    out = d.ctl("restart", "nosuch")
    assert out.returncode == 1, out
    assert "nosuch" in out.stderr
    out = d.ctl("logs", "nosuch")
    assert out.returncode == 1 and "nosuch" in out.stderr, out
    out = d.ctl("generate", "--engine", "nosuch", "x")
    assert out.returncode == 1 and "nosuch" in out.stderr, out
    assert d.ctl("frobnicate").returncode == 2

    _assert_json_error(d, "POST", "/v1/generate", b"{not json", 400)
    _assert_json_error(d, "POST", "/v1/generate", b"\xff\xfe\x00garbage", 400)
    _assert_json_error(d, "POST", "/v1/generate", b"[1, 2, 3]", 400)
    _assert_json_error(d, "POST", "/v1/generate", b'"a string"', 400)
    _assert_json_error(d, "POST", "/v1/generate", b'{"prompt": 5}', 400)
    _assert_json_error(d, "POST", "/v1/generate", b'{"prompt": "x", "max_tokens": -1}', 400)
    _assert_json_error(d, "POST", "/v1/generate", b'{"prompt": "x", "engine": ["echo-0"]}', 400)
    _assert_json_error(d, "POST", "/v1/generate", b'{"prompt": "' + b"x" * 100_000 + b'"}', 413)
    _assert_json_error(d, "GET", "/v1/nosuch", None, 404)
    _assert_json_error(d, "GET", "/", None, 404)
    _assert_json_error(d, "GET", "/v1/generate", None, 405)
    _assert_json_error(d, "DELETE", "/v1/status", None, 405)
    _assert_json_error(d, "POST", "/v1/engines/echo-0/explode", b"{}", 404)
    _assert_json_error(d, "POST", "/v1/engines/nosuch/restart", b"{}", 404)
    # Malformed bodies on lifecycle routes are refused before anything is done.
    _assert_json_error(d, "POST", "/v1/engines/echo-0/restart", b"nope", 400)
    _assert_json_error(d, "POST", "/v1/engines/echo-0/stop", b"[]", 400)
    _assert_json_error(d, "POST", "/v1/engines/all/stop", b'{"wait": "yes"}', 400)
    _assert_json_error(d, "POST", "/v1/engines/all/restart", b'{"timeout_s": "soon"}', 400)
    _assert_json_error(d, "GET", "/v1/engines/nope/logs", None, 404)  # (a group is fine now)
    _assert_json_error(d, "GET", "/v1/events?lines=some", None, 400)
    _assert_json_error(d, "GET", "/v1/engines/echo-0/logs?lines=many", None, 400)

    # Not HTTP at all: the server answers 4xx (or hangs up) and keeps serving.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.settimeout(10)
        raw.connect(d.socket)
        raw.sendall(b"\x00\x01GARBAGE \xff\r\n\r\n")
        reply = raw.recv(4096)
        assert reply == b"" or re.match(rb"HTTP/1\.[01] 4\d\d ", reply), reply

    after = d.engines()
    for name, e in before.items():
        assert after[name]["state"] == "READY"
        assert (after[name]["pid"], after[name]["incarnation"]) == (e["pid"], e["incarnation"])
        assert after[name]["restarts"] == 0
    assert d.ctl("generate", "still fine").stdout.strip() == "still fine"


def _heartbeat(engine: str, incarnation: int) -> bytes:
    return proto.encode(proto.Heartbeat(engine, incarnation, iteration=1,
                                        last_iteration_at=0.0, waiting=0, running=0))


def test_garbage_zmq_frames_are_counted_and_dropped(engined, rng: random.Random):
    d = engined([ECHO2])
    before = d.engines()
    assert d.status()["supervisor"]["ipc_dropped"] == {}
    inc = before["echo-0"]["incarnation"]

    control_frames: list[list[bytes]] = [
        [rng.randbytes(64)], [rng.randbytes(7)], [b"\xc1" * 16], [b""],
        [msgspec.msgpack.encode([1, 2, 3])],  # valid msgpack, wrong type
        [msgspec.msgpack.encode({"type": "nope", "engine": "echo-0", "incarnation": inc})],
        [proto.encode(proto.GenerateRequest("x", "hi"))],  # a request-channel type
        [b"two", b"parts"],
    ]
    bogus = [
        [_heartbeat("nosuch", 1)],  # unknown engine
        [_heartbeat("echo-0", inc - 1)],  # a stale incarnation
        [_heartbeat("echo-0", inc + 7)],  # not the current one either
    ]
    ready = proto.encode(proto.Ready("echo-1", inc + 1, 0.0, "cpu", "builtin:echo", "none"))
    request_frames: list[list[bytes]] = [
        [rng.randbytes(64)],
        [b"two", b"parts"],  # the ROUTER sees three frames
        [proto.encode(proto.GenerateRequest("y", "hi"))],  # unexpected direction
        [proto.encode(proto.GenerateResult("no-such-request", "echo-0", inc, text="x"))],
        [ready],  # READY travels here, but from another engine's routing identity: forged
    ]
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 5000)
        push.connect(f"ipc://{d.runtime_dir}/engines-control.sock")
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 5000)
        dealer.connect(f"ipc://{d.runtime_dir}/engines-requests.sock")
        for frames in [*control_frames, *bogus, [ready]]:  # READY on the wrong channel
            push.send_multipart(frames)
        for frames in request_frames:
            dealer.send_multipart(frames)
        push.close()
        dealer.close()
    finally:
        ctx.term()  # waits (bounded by LINGER) until everything is delivered

    expected = {"malformed": len(control_frames) + 3, "unknown_engine": 1, "stale": 3,
                "unexpected": 1, "forged": 1}
    d.wait_for(lambda: d.status()["supervisor"]["ipc_dropped"] == expected, 10,
               f"ipc_dropped == {expected} (now {d.status()['supervisor']['ipc_dropped']})")

    d.holds(lambda: all(e["state"] == "READY" for e in d.engines().values()), 1.0,
            "every engine READY")
    after = d.engines()
    for name, e in before.items():
        assert (after[name]["pid"], after[name]["incarnation"]) == (e["pid"], e["incarnation"])
        assert after[name]["restarts"] == 0 and after[name]["last_exit"] is None
    assert d.status()["supervisor"]["ipc_dropped"] == expected
    for name in before:
        assert d.ctl("generate", "--engine", name, "served").stdout.strip() == "served"


# --- logs -------------------------------------------------------------------------------------


def test_logs_of_a_group_interleave_its_replicas_with_their_names(engined):
    d = engined([{"name": "echo", "replicas": 2, "model": "builtin:echo"}])
    out = d.ctl("logs", "echo", "-n", "2")
    assert out.returncode == 0, out
    lines = out.stdout.splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["echo-0"] * 2 + ["echo-1"] * 2, lines
    assert [line.split(" | ", 1)[1] for line in lines[:2]] == \
        d.ctl("logs", "echo-0", "-n", "2").stdout.splitlines()  # one replica: no prefix
    follow = d.ctl_popen("logs", "echo", "-f", "-n", "1", stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        stream = stream_lines(follow.stdout)
        read_until(stream, lines[-1], 20)  # the head (echo-1's last line): following has begun
        pids = {n: e["pid"] for n, e in d.engines().items()}
        assert d.ctl("restart", "echo-1").returncode == 0
        assert d.ctl("restart", "echo-0").returncode == 0
        seen = read_until(stream, f"spawned pid {d.engine('echo-0')['pid']}", 20)
        assert any(line.startswith("echo-1 | ") and f"pid {pids['echo-1']} exited" in line
                   for line in seen), seen
        assert follow.poll() is None  # still following both
    finally:
        follow.terminate()
        follow.wait(timeout=10)


def test_logs_tail_follow_and_fd_level_output(engined):
    d = engined([{"name": "echo", "replicas": 1, "model": "builtin:echo",
                  "env": {"PYTHONFAULTHANDLER": "1"}}])
    full = d.ctl("logs", "echo-0", "-n", "1000")
    assert full.returncode == 0, full
    all_lines = full.stdout.splitlines()
    assert len(all_lines) > 3, all_lines
    tail = d.ctl("logs", "echo-0", "-n", "3")
    assert tail.returncode == 0, tail
    assert tail.stdout.splitlines() == all_lines[-3:]
    assert d.log_text("echo-0").splitlines()[-3:] == all_lines[-3:]
    assert "spawned pid" in all_lines[0]

    follow = d.ctl_popen("logs", "echo-0", "-f", "-n", "1", stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        lines = stream_lines(follow.stdout)
        read_until(lines, all_lines[-1], 20)  # the head: following has begun
        old = d.engine("echo-0")["pid"]
        assert d.ctl("restart", "echo-0").returncode == 0
        new = d.engine("echo-0")["pid"]
        seen = read_until(lines, f"spawned pid {new}", 20)
        assert any(f"pid {old} exited" in line for line in seen), seen
        assert follow.poll() is None  # still following
    finally:
        follow.terminate()
        follow.wait(timeout=10)

    # A Python traceback from the busy loop (the child's stderr)...
    out = d.ctl("generate", "--engine", "echo-0", "!raise")
    assert out.returncode == 1, out
    crashed = d.wait_restarted("echo-0", new)
    assert crashed["last_exit"]["code"] == 1
    logs = d.ctl("logs", "echo-0", "-n", "200").stdout
    assert "Traceback (most recent call last)" in logs and "RuntimeError" in logs, logs
    assert any("Traceback" in line for line in crashed["last_exit"]["log_tail"])

    # ...and output written straight to fd 2 from C: faulthandler's report of a SIGSEGV.
    pid = crashed["pid"]
    os.kill(pid, signal.SIGSEGV)
    segv = d.wait_restarted("echo-0", pid)
    assert segv["last_exit"]["signal"] == "SIGSEGV", segv["last_exit"]
    assert "Fatal Python error: Segmentation fault" in d.ctl("logs", "echo-0", "-n", "200").stdout
    assert any("Segmentation fault" in line for line in segv["last_exit"]["log_tail"])
