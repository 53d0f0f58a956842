"""Control API abuse on a real daemon: malformed HTTP and JSON, oversized bodies, unknown routes and
methods, slow clients that never finish a request, and hundreds of concurrent connections.

Every answer is a 4xx (never a 5xx) or a closed connection, nothing is written to the daemon's log
as a traceback, and the fleet does not notice: heartbeats keep arriving, engine pids and
incarnations stay the same, and a concurrent `enginectl status` answers within seconds.

tests/e2e/test_control.py already covers the basic bad requests (bad JSON bodies on each route,
a 100 kB body, unknown routes, wrong methods, bytes that are not HTTP); this file goes further.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import threading
import time
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testkit.driver import Daemon

ECHO2 = {"name": "echo", "replicas": 2, "model": "builtin:echo"}
CLIENT_TIMEOUT_S = 10.0  # supervisor.control.CLIENT_TIMEOUT_S: slow clients are cut off after it
MAX_BODY_BYTES = 64 * 1024
STATUS_WITHIN_S = 5.0
HEARTBEAT_AGE_MAX_S = 1.0  # the fixture's heartbeat interval is 0.2 s, its timeout 1.5 s
SLOW_CLIENTS = 50
MAX_CONTROL_CONNECTIONS = 256  # supervisor.daemon's caps
MAX_HTTP_CONNECTIONS = 64
CONCURRENT = 200

_STATUS_LINE = re.compile(rb"HTTP/[01]\.\d (\d{3}) ")


# --- raw HTTP over the unix socket ---------------------------------------------------------------


def _connect(path: str, timeout_s: float = 10.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.connect(path)
            return sock
        except BlockingIOError:  # the listen backlog is full for a moment: the daemon is busy
            if time.monotonic() > deadline:
                sock.close()
                raise
            time.sleep(0.01)


def _read_all(sock: socket.socket, limit: int = 1 << 20) -> bytes:
    """Until the server closes (or the socket's timeout: then socket.timeout propagates)."""
    out = b""
    while len(out) < limit:
        chunk = sock.recv(65536)
        if not chunk:
            break
        out += chunk
    return out


def _closed_by_peer(sock: socket.socket) -> bool:
    """The server closed it (what it reads is the end, or a reset), not still open."""
    sock.settimeout(0.05)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except (socket.timeout, BlockingIOError):
        return False


def exchange(path: str, data: bytes, timeout_s: float = 10.0) -> int | None:
    """Send raw bytes, read until the server closes; the HTTP status, or None if it just hung up."""
    with _connect(path, timeout_s) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it refused the rest: what it answered (if anything) is still readable
        try:
            reply = _read_all(sock)
        except ConnectionResetError:
            return None
    m = _STATUS_LINE.match(reply)
    assert reply == b"" or m, reply[:300]
    return int(m.group(1)) if m else None


def first_status(path: str, data: bytes, timeout_s: float = 10.0) -> int:
    """Send raw bytes and return the status of the first answer, without waiting for the close."""
    with _connect(path, timeout_s) as sock:
        sock.sendall(data)
        reply = b""
        while b"\r\n" not in reply:
            chunk = sock.recv(4096)
            assert chunk, reply
            reply += chunk
    m = _STATUS_LINE.match(reply)
    assert m, reply[:300]
    return int(m.group(1))


def request(method: str, target: str, body: bytes = b"", headers: dict[str, str] | None = None,
            ) -> bytes:
    hdrs = {"Host": "engined", "Connection": "close", **(headers or {})}
    if body and "Content-Length" not in hdrs and "Transfer-Encoding" not in hdrs:
        hdrs["Content-Length"] = str(len(body))
    head = f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
    return head.encode("latin-1") + b"\r\n" + body


# --- the fleet must not notice ------------------------------------------------------------------


def _identity(d: Daemon) -> dict[str, tuple[Any, ...]]:
    return {name: (e["pid"], e["incarnation"], e["restarts"], e["state"])
            for name, e in d.engines().items()}


def _assert_fleet_unaffected(d: Daemon, before: dict[str, tuple[Any, ...]]) -> None:
    engines = d.engines()
    assert {n: (e["pid"], e["incarnation"], e["restarts"], e["state"])
            for n, e in engines.items()} == before
    for e in engines.values():
        assert e["heartbeat_age_s"] is not None and e["heartbeat_age_s"] < HEARTBEAT_AGE_MAX_S, e
    assert d.ctl("generate", "--engine", "echo-1", "still fine").stdout.strip() == "still fine"
    log = d.stderr_text()
    assert "Traceback" not in log, log[-5000:]
    assert " ERROR " not in log, log[-5000:]


def _timed_status(d: Daemon) -> float:
    began = time.monotonic()
    out = d.ctl("status", timeout_s=30)
    took = time.monotonic() - began
    assert out.returncode == 0, out
    return took


class HeartbeatWatch:
    """Samples every engine's heartbeat age from a thread while the abuse goes on."""

    def __init__(self, d: Daemon) -> None:
        self.d = d
        self.worst_s = 0.0
        self.samples = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HeartbeatWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        assert not self.errors, self.errors
        assert self.samples > 0
        assert self.worst_s < HEARTBEAT_AGE_MAX_S, self.worst_s

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ages = [e["heartbeat_age_s"] for e in self.d.engines().values()]
                self.worst_s = max([self.worst_s, *(a for a in ages if a is not None)])
                self.samples += 1
            except Exception as exc:  # noqa: BLE001 - reported on exit
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(0.1)


# --- tests --------------------------------------------------------------------------------------


MALFORMED_HTTP = {
    "HTTP/9.9": b"GET /v1/status HTTP/9.9\r\nHost: e\r\n\r\n",
    "no Host": b"GET /v1/status HTTP/1.1\r\n\r\n",
    "header without colon": b"GET /v1/status HTTP/1.1\r\nHost: e\r\nBroken\r\n\r\n",
    "header line too long": request("GET", "/v1/status", headers={"X-Long": "a" * 20000}),
    "too many headers": b"GET /v1/status HTTP/1.1\r\nHost: e\r\n" + b"X-A: b\r\n" * 500 + b"\r\n",
    "URL too long": request("GET", "/v1/" + "a" * 20000),
    "bytes in the path": b"GET /v1/engines/\xff\xfe/logs HTTP/1.1\r\nHost: e\r\n\r\n",
    "NUL in the path": b"GET /v1/sta\x00tus HTTP/1.1\r\nHost: e\r\n\r\n",
    "bad Content-Length": request("POST", "/v1/generate", b"{}", {"Content-Length": "abc"}),
    "negative Content-Length": request("POST", "/v1/generate", b"{}", {"Content-Length": "-1"}),
    "two Content-Lengths": b"POST /v1/generate HTTP/1.1\r\nHost: e\r\nContent-Length: 2\r\n"
                           b"Content-Length: 3\r\n\r\n{}",
    "broken chunk size": request("POST", "/v1/generate", b"zz\r\n{}\r\n0\r\n\r\n",
                                 {"Transfer-Encoding": "chunked"}),
    "chunked and length": request("POST", "/v1/generate", b"2\r\n{}\r\n0\r\n\r\n",
                                  {"Transfer-Encoding": "chunked", "Content-Length": "12"}),
    "unknown method": request("FROB", "/v1/status"),
    "CONNECT": request("CONNECT", "engined:80"),
    "h2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "TLS hello": bytes.fromhex("16030100a5010000a10303") + bytes(160),
}

# Each is refused before anything is done (a body that parsed into a valid command would act).
BAD_GENERATE = {
    "nesting past the decoder's stack": b"[" * 60000,
    "integer past the digit limit": b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
    "lone surrogate in the prompt": b'{"prompt": "\\ud800 x"}',
    "NaN": b'{"prompt": "x", "max_tokens": NaN}',
    "Infinity timeout": b'{"prompt": "x", "timeout_s": Infinity}',
    "huge float": b'{"prompt": "x", "max_tokens": 1e999}',
    "tiny timeout": b'{"prompt": "x", "timeout_s": 1e-300}',
    "boolean tokens": b'{"prompt": "x", "max_tokens": true}',
    "object prompt": b'{"prompt": {"a": 1}}',
    "prompt too long": json.dumps({"prompt": "p" * 70000}).encode(),  # past the body limit
    "engine number": b'{"prompt": "x", "engine": 7}',
    "truncated": b'{"prompt": "x"',
    "trailing garbage": b'{"prompt": "x"} {}',
    "no prompt": b'{"": 1}',
    "not UTF-8": b'{"prompt": "\xff\xfe"}',
}
BAD_LIFECYCLE = {
    "nesting past the decoder's stack": b"{\"a\": " + b"[" * 60000,
    "integer past the digit limit": b'{"timeout_s": ' + b"9" * 5000 + b"}",
    "NaN timeout": b'{"timeout_s": NaN}',
    "Infinity timeout": b'{"timeout_s": Infinity}',
    "huge float": b'{"timeout_s": 1e999}',
    "negative timeout": b'{"timeout_s": -1}',
    "null wait": b'{"wait": null}',
    "truncated": b'{"wait": true',
    "trailing garbage": b'{"wait": true} x',
    "a list": b"[{}]",
}


@pytest.mark.smoke
def test_malformed_http_gets_4xx_or_a_closed_connection(engined):
    d = engined([ECHO2])
    before = _identity(d)
    with HeartbeatWatch(d):
        for name, data in MALFORMED_HTTP.items():
            status = exchange(d.socket, data)
            assert status is None or 400 <= status < 500, (name, status)
        # No version at all is HTTP/0.9: a read-only status is fine (and the idle connection is
        # then closed by the client timeout, not kept forever).
        assert first_status(d.socket, b"GET /v1/status\r\n\r\n") == 200
    _assert_fleet_unaffected(d, before)


@pytest.mark.parametrize("route", ["/v1/generate", "/v1/engines/echo-0/restart",
                                   "/v1/engines/all/stop", "/v1/engines/echo/start"])
def test_bad_json_and_values_are_4xx_never_5xx(engined, route):
    d = engined([ECHO2])
    before = _identity(d)
    bodies = BAD_GENERATE if route == "/v1/generate" else BAD_LIFECYCLE
    statuses = {name: exchange(d.socket, request("POST", route, body,
                                                 {"Content-Type": "application/json"}))
                for name, body in bodies.items()}
    bad = {n: s for n, s in statuses.items() if s is None or not 400 <= s < 500}
    assert not bad, bad
    _assert_fleet_unaffected(d, before)


def test_oversized_bodies_are_refused_with_413(engined):
    d = engined([ECHO2])
    before = _identity(d)
    big = b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'
    # (/v1/reload takes no body and never reads one.)
    for route in ("/v1/generate", "/v1/engines/echo-0/restart"):
        assert exchange(d.socket, request("POST", route, big)) == 413, route
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in [big[:40000], big[40000:]])
        chunked = request("POST", route, chunks + b"0\r\n\r\n", {"Transfer-Encoding": "chunked"})
        assert exchange(d.socket, chunked) == 413, route
    # A declared length far past the cap, with only a little of it sent: refused, not awaited.
    huge = request("POST", "/v1/generate", b"{", {"Content-Length": str(10**12)})
    began = time.monotonic()
    assert first_status(d.socket, huge) == 413
    assert time.monotonic() - began < CLIENT_TIMEOUT_S / 2
    # Right at the cap is accepted as a body (and then judged on its content).
    at_cap = json.dumps({"prompt": "y" * (MAX_BODY_BYTES - 100), "max_tokens": 4}).encode()
    assert len(at_cap) <= MAX_BODY_BYTES
    assert exchange(d.socket, request("POST", "/v1/generate", at_cap)) == 200
    _assert_fleet_unaffected(d, before)


def test_unknown_routes_and_methods(engined):
    d = engined([ECHO2])
    before = _identity(d)
    routes = ["/v1/status", "/v1/generate", "/v1/reload", "/v1/engines/echo-0/restart",
              "/v1/engines/echo-0/logs", "/v1/engines", "/v1/engines/echo-0", "/v2/status",
              "/v1/status/", "//v1/status", "/v1/./status", "/v1/engines/echo-0/restart/now",
              "/v1/engines/%2e%2e/logs", "/v1/engines/..%2f..%2fetc/logs", "/metrics",
              "/health", "/v1/engines/echo-0/logs?lines=" + "9" * 5000,
              "/v1/engines/echo-0/logs?lines=-3&follow=maybe", "/%00", "/v1/engines/%ff/logs",
              "/v1/engines/%ed%a0%80/restart", "*"]
    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "HEAD"]
    allowed = {("GET", "/v1/status"), ("HEAD", "/v1/status"), ("GET", "/v1/engines/echo-0/logs"),
               ("HEAD", "/v1/engines/echo-0/logs"),
               ("GET", "/v1/engines/echo-0/logs?lines=-3&follow=maybe"),
               ("HEAD", "/v1/engines/echo-0/logs?lines=-3&follow=maybe")}
    for method in methods:
        for route in routes:
            if method == "POST" and route in ("/v1/reload", "/v1/engines/echo-0/restart"):
                continue  # real commands: covered elsewhere, they change the fleet on purpose
            body = b"{}" if method in ("POST", "PUT", "PATCH") else b""
            status = exchange(d.socket, request(method, route, body))
            if (method, route) in allowed:
                assert status == 200, (method, route, status)
            else:
                assert status is None or 400 <= status < 500, (method, route, status)
    _assert_fleet_unaffected(d, before)


def test_slow_clients_are_cut_off_and_do_not_block_the_daemon(engined):
    """Unix-socket and TCP clients that never finish a request: the daemon serves everyone else
    meanwhile, and answers 408 or hangs up on each once CLIENT_TIMEOUT_S has passed."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = engined([ECHO2], supervisor={"http": f"127.0.0.1:{port}"})
    before = _identity(d)
    daemon = psutil.Process(d.pid)
    d.status()
    fds_before = daemon.num_fds()
    partial = [
        b"",  # connects, says nothing
        b"GET /v1/sta",  # half a request line
        b"\r\n\r\n",  # empty lines before a request line are allowed, and lead nowhere
        b"GET /v1/status HTTP/1.1\r\nHost: engined\r\n",  # headers never end
        b"POST /v1/generate HTTP/1.1\r\nHost: engined\r\nContent-Length: 100\r\n\r\n{\"pro",
        b"POST /v1/engines/echo-0/restart HTTP/1.1\r\nHost: engined\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"wai",  # a chunked body that stalls
    ]
    socks = []
    opened_at = time.monotonic()
    try:
        for i in range(SLOW_CLIENTS):
            sock = _connect(d.socket, timeout_s=CLIENT_TIMEOUT_S + 15)
            socks.append(sock)
            if partial[i % len(partial)]:
                sock.sendall(partial[i % len(partial)])
        for i in range(10):  # the TCP endpoint (/metrics for Prometheus) gets the same treatment
            sock = socket.create_connection(("127.0.0.1", port), timeout=CLIENT_TIMEOUT_S + 15)
            socks.append(sock)
            sock.sendall(b"GET /metr" if i % 2 else b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        d.wait_for(lambda: daemon.num_fds() >= fds_before + len(socks) - 3, 10,
                   "the daemon to accept every slow client")
        # While they hang there: status answers at once, the fleet is untouched.
        with HeartbeatWatch(d):
            assert _timed_status(d) < STATUS_WITHIN_S
            assert d.ctl("generate", "meanwhile").stdout.strip() == "meanwhile"
            # Every slow client is answered (408) or hung up on once its time is up.
            results: list[int | None] = []
            for sock in socks:
                reply = _read_all(sock)
                m = _STATUS_LINE.match(reply)
                results.append(int(m.group(1)) if m else None)
                assert reply == b"" or m, reply[:200]
            cut_after_s = time.monotonic() - opened_at
        assert all(r is None or r == 408 for r in results), results
        assert cut_after_s < CLIENT_TIMEOUT_S + 8, cut_after_s
    finally:
        for sock in socks:
            sock.close()
    d.wait_for(lambda: daemon.num_fds() <= fds_before + 2, 10,
               f"daemon fds back near {fds_before} (now {daemon.num_fds()})")
    _assert_fleet_unaffected(d, before)


def test_many_concurrent_connections(engined):
    d = engined([ECHO2])
    before = _identity(d)
    daemon = psutil.Process(d.pid)
    d.status()
    fds_before = daemon.num_fds()
    kinds = [
        request("GET", "/v1/status"),
        request("POST", "/v1/generate", b'{"prompt": "many", "max_tokens": 4}'),
        request("GET", "/v1/engines/echo-1/logs?lines=5"),
        request("GET", "/v1/nothing"),
        b"\x00garbage\r\n\r\n",
    ]
    start = threading.Barrier(CONCURRENT // 4 + 1)

    def one(i: int) -> int | None:
        sock = _connect(d.socket, timeout_s=60)
        if i % 4 == 0:
            start.wait(timeout=60)  # a quarter of them fire at exactly the same moment
        with sock:
            sock.sendall(kinds[i % len(kinds)])
            reply = _read_all(sock)
        m = _STATUS_LINE.match(reply)
        assert reply == b"" or m, reply[:200]
        return int(m.group(1)) if m else None

    with HeartbeatWatch(d), concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        futures = [pool.submit(one, i) for i in range(CONCURRENT)]
        start.wait(timeout=60)
        took = _timed_status(d)
        results = [f.result(timeout=120) for f in futures]
    assert took < STATUS_WITHIN_S, took
    expect = {0: {200}, 1: {200}, 2: {200}, 3: {404}, 4: {None, 400}}
    for i, status in enumerate(results):
        assert status in expect[i % len(kinds)], (i, status)
    d.wait_for(lambda: daemon.num_fds() <= fds_before + 2, 10,
               f"daemon fds back near {fds_before} (now {daemon.num_fds()})")
    _assert_fleet_unaffected(d, before)


def test_connections_past_the_cap_shed_the_idle_ones(engined):
    """Each HTTP server holds at most its cap of connections (every one is an fd; a daemon out of
    fds cannot spawn engines, and libzmq aborts it when an engine cannot be accepted). Past the
    cap a new connection sheds the connection idle the longest (supervisor.webserver): the new
    client is served, the daemon's descriptors do not grow, supervision goes on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = engined([ECHO2], supervisor={"http": f"127.0.0.1:{port}"})
    daemon = psutil.Process(d.pid)
    pid = d.engine("echo-0")["pid"]
    fds_before = daemon.num_fds()
    held: list[socket.socket] = []
    try:
        for _ in range(MAX_CONTROL_CONNECTIONS):
            held.append(_connect(d.socket))
        for _ in range(MAX_HTTP_CONNECTIONS):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        d.wait_for(lambda: daemon.num_fds() >= fds_before + len(held) - 3, 10,
                   "the daemon to accept every connection up to the caps")
        for _ in range(20):  # each new one is served: an idle one made room for it
            with _connect(d.socket) as sock:
                sock.sendall(request("GET", "/v1/status"))
                assert _read_all(sock).startswith(b"HTTP/1.1 200"), "a new client refused"
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                assert _read_all(sock).startswith(b"HTTP/1.1 "), "a new client refused"
        assert daemon.num_fds() <= fds_before + len(held) + 3
        shed = sum(1 for s in held if _closed_by_peer(s))
        assert shed >= 40, shed  # one per new client
        # Supervision goes on at the cap: a killed engine is respawned and reconnects.
        os.kill(pid, signal.SIGKILL)
        d.wait_for(lambda: re.search(r"\[ready\] echo-0 pid \d+ incarnation 2 ",
                                     d.stderr_text()), 20, "the killed engine READY again")
    finally:
        for sock in held:
            sock.close()
    d.wait_for(lambda: d.ctl("status").returncode == 0, 20, "status served again")
    engines = d.engines()
    assert all(e["state"] == "READY" for e in engines.values()), engines
    assert sum(e["restarts"] for e in engines.values()) == 1
    assert "Traceback" not in d.stderr_text()


# --- random requests ------------------------------------------------------------------------------

_PATHS = ["/v1/status", "/v1/generate", "/v1/reload", "/v1/engines/echo-0/logs",
          "/v1/engines/echo/logs", "/v1/engines/nosuch/stop", "/v1/engines/echo-0/explode", "/"]
# Not Content-Length, Transfer-Encoding or Connection: a request that is incomplete on purpose
# is the slow-client test's business and costs CLIENT_TIMEOUT_S here.
_HEADER_NAMES = ["Content-Type", "Expect", "Accept-Encoding", "Content-Encoding", "X-Junk",
                 "Host", "Cookie", "Range", "Accept", "Authorization", "Upgrade"]
_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30)
_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | _text,
                            lambda inner: st.lists(inner, max_size=3)
                            | st.dictionaries(_text, inner, max_size=3), max_leaves=8)


@st.composite
def http_requests(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD"]) | _text)
    target = draw(st.sampled_from(_PATHS) | _text.map(lambda t: "/" + t))
    if draw(st.booleans()):
        target += "?" + draw(_text)
    body_kind = draw(st.sampled_from(["none", "json", "object", "bytes"]))
    body = {"none": b"", "bytes": draw(st.binary(max_size=200)),
            "json": json.dumps(draw(_json_values)).encode(),
            # Never a valid command for a real route: no restart/stop/start of the fleet here.
            "object": json.dumps({"prompt": draw(_text), "max_tokens": draw(_json_values),
                                  "engine": draw(_json_values), "wait": draw(_json_values),
                                  "timeout_s": draw(_json_values)}).encode()}[body_kind]
    headers = draw(st.dictionaries(st.sampled_from(_HEADER_NAMES), _text, max_size=4))
    line = f"{method} {target} HTTP/1.1\r\n".encode("latin-1", "replace")
    head = {"Host": "engined", "Connection": "close", **headers}
    if body and "Content-Length" not in head and "Transfer-Encoding" not in head:
        head["Content-Length"] = str(len(body))
    raw = line + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode("latin-1", "replace")
    return raw + b"\r\n" + body


@pytest.mark.smoke
def test_random_requests_never_get_a_5xx(engined):
    d = engined([ECHO2])
    before = _identity(d)
    seen: list[tuple[bytes, int | None]] = []

    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(http_requests())
    def fire(raw: bytes) -> None:
        # A random request that happens to be a real lifecycle command would act: skip those.
        if re.match(rb"POST /v1/(reload|engines/[^/ ]+/(stop|start|restart))\b", raw):
            return
        status = exchange(d.socket, raw, timeout_s=CLIENT_TIMEOUT_S + 10)
        seen.append((raw[:80], status))
        assert status is None or status < 500, (raw[:300], status)

    with HeartbeatWatch(d):
        fire()
    assert len(seen) > 100
    _assert_fleet_unaffected(d, before)
