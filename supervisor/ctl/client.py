"""HTTP over engined's unix control socket: the one client enginectl, the tests and the
benchmarks use. Standard library only (enginectl must start fast)."""

from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Any

CONNECT_TIMEOUT_S = 5.0  # a live daemon accepts at once; a long connect means it is gone or wedged


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTPConnection over an AF_UNIX socket; the Host header is `engined`."""

    def __init__(self, socket_path: str, timeout_s: float | None = 30.0) -> None:
        super().__init__("engined", timeout=timeout_s)
        self.socket_path = socket_path

    def connect(self) -> None:
        limit = min(CONNECT_TIMEOUT_S, self.timeout or CONNECT_TIMEOUT_S)
        deadline = time.monotonic() + limit
        pause = 0.005
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(limit)
                sock.connect(self.socket_path)
                sock.settimeout(self.timeout)  # the per-request read timeout (None: forever)
            except BlockingIOError:
                # A full accept backlog (a burst of clients, a busy daemon): a unix socket with a
                # timeout says EAGAIN at once instead of waiting; wait for room, up to `limit`.
                sock.close()
                if time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 0.1)
                continue
            except BaseException:
                sock.close()
                raise
            self.sock = sock
            return


def open_request(socket_path: str, method: str, path: str, body: Any = None,
                 headers: dict[str, str] | None = None,
                 timeout_s: float | None = 30.0) -> http.client.HTTPResponse:
    """Send one request on its own connection and return the response, whatever its status.

    `body` is bytes (sent as is) or anything JSON-serialisable. The response owns the socket
    (`Connection: close`): reading it to the end, or closing it, closes the connection.
    """
    conn = UnixHTTPConnection(socket_path, timeout_s)
    payload = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    sent = {"Accept": "application/json", "Connection": "close", **(headers or {})}
    if payload is not None and not isinstance(body, bytes):
        sent.setdefault("Content-Type", "application/json")
    try:
        conn.request(method, path, body=payload, headers=sent)
        return conn.getresponse()
    except BaseException:
        conn.close()
        raise


def request(socket_path: str, method: str, path: str, body: Any = None,
            headers: dict[str, str] | None = None,
            timeout_s: float | None = 30.0) -> tuple[int, dict[str, str], bytes]:
    """One request/response exchange: (status, lower-cased headers, body)."""
    resp = open_request(socket_path, method, path, body, headers, timeout_s)
    try:
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        resp.close()


class Remote:
    """An engined's control API on TCP (supervisor.control_tcp), as `enginectl --host` names it:
    `[NODE=][https://]HOST:PORT`. NODE (default HOST:PORT) is what `status` shows and what
    `restart NODE/NAME` addresses; https:// is TLS, checked against `cafile` or the system's
    CAs. Every request carries the bearer token."""

    def __init__(self, text: str, token: str, cafile: str | None = None) -> None:
        name, eq, rest = text.partition("=")
        if not eq:
            name, rest = "", text
        scheme, sep, address = rest.partition("://")
        if not sep:
            scheme, address = "http", rest
        host, colon, port = address.rpartition(":")
        if scheme not in ("http", "https") or not colon or not host or not port.isdigit() \
                or not 0 < int(port) < 65536:
            raise ValueError(f"{text!r}: expected [NODE=][https://]HOST:PORT")
        self.host, self.port = host.strip("[]"), int(port)
        self.name = name or address
        self.url = f"{scheme}://{address}"
        self.token = token
        self.tls = None
        if scheme == "https":
            import ssl

            self.tls = ssl.create_default_context(cafile=cafile)

    def open(self, method: str, path: str, body: Any = None,
             timeout_s: float | None = 30.0,
             connect_timeout_s: float = CONNECT_TIMEOUT_S) -> http.client.HTTPResponse:
        """One request on its own connection (as open_request), over TCP with the token."""
        conn: http.client.HTTPConnection
        if self.tls is not None:
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=connect_timeout_s,
                                               context=self.tls)
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=connect_timeout_s)
        payload = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Accept": "application/json", "Connection": "close",
                   "Authorization": f"Bearer {self.token}"}
        if payload is not None and not isinstance(body, bytes):
            headers["Content-Type"] = "application/json"
        try:
            conn.connect()  # a node that is gone says so within connect_timeout_s
            assert conn.sock is not None
            conn.sock.settimeout(timeout_s)
            conn.request(method, path, body=payload, headers=headers)
            return conn.getresponse()
        except BaseException:
            conn.close()
            raise
