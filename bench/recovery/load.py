"""Clients of the gateway, shared by sections 4 and 5: `request` sends one `/v1/completions` and
tells how it ended (and when a stream's first token came); `Load` is K client threads, each with
its own keep-alive connection, sending what a plan says until it ends or the load is stopped.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench.common import BenchError

RETRY_S = 0.05  # a client waits this long after a failed request before its next one
REQUEST_TIMEOUT_S = 120.0  # the clients' socket timeout (a bound, far above any request here)
FAILURES = ((ConnectionRefusedError, "refused"),  # what a failed request was, by its exception
            ((ConnectionResetError, BrokenPipeError), "reset"),  # RemoteDisconnected included
            (http.client.IncompleteRead, "cut"), (TimeoutError, "timeout"),
            ((OSError, http.client.HTTPException, ValueError), "other"))
# (client, its k-th request) -> (model, streamed), or None: that client is done
Plan = Callable[[int, int], "tuple[str, bool] | None"]


@dataclass
class Req:
    start: float  # time.time() when the request was sent (its connection opened, if new)
    end: float  # when its answer was read to the end, or it failed
    kind: str  # ok | refused | reset | http | cut | timeout | other
    detail: str = ""  # the failure: HTTP status, exception type and message
    streamed: bool = False
    client: int = 0  # which client thread sent it
    model: str = ""
    first: float | None = None  # streamed: when the first token's chunk came

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start


def request(conn: http.client.HTTPConnection, model: str, prompt: str, max_tokens: int,
            streamed: bool, client: int = 0) -> Req:
    """One greedy `/v1/completions` on `conn`; a stream is ok once `data: [DONE]` came."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": streamed})
    q = Req(time.time(), 0.0, "ok", "", streamed, client, model)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            text = resp.read()[:200].decode(errors="replace")
            q.kind, q.detail = "http", f"HTTP {resp.status}: {text}"
        elif not streamed:
            answer = json.loads(resp.read())
            if not answer.get("choices"):
                q.kind, q.detail = "other", f"no choices: {answer}"
        else:
            done = False
            for line in resp:  # SSE: `data: {...}` lines, then `data: [DONE]`
                if q.first is None and line.startswith(b"data: {"):
                    q.first = time.time()
                done = done or line.strip() == b"data: [DONE]"
            if not done:
                q.kind, q.detail = "cut", "the stream ended without data: [DONE]"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        q.kind = next(kind for types, kind in FAILURES if isinstance(exc, types))
        q.detail = f"{type(exc).__name__}: {exc}"[:200]
    q.end = time.time()
    return q


class Load:
    """K client threads sending `plan`'s requests; after a failure a client closes its
    connection and waits RETRY_S."""

    def __init__(self, port: int, clients: int, plan: Plan, prompt: str,
                 max_tokens: int) -> None:
        self.port, self.plan, self.prompt, self.max_tokens = port, plan, prompt, max_tokens
        self.reqs: list[Req] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True,
                                         name=f"client-{i}") for i in range(clients)]

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def stop(self, now: bool = True, timeout_s: float = REQUEST_TIMEOUT_S + 10) -> list[Req]:
        """Stop (`now`: the clients' current requests are their last; else at the plan's end,
        within `timeout_s`) and return every request."""
        if now:
            self.stopping.set()
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self.threads):
            raise BenchError("a client thread did not finish its request")
        return self.snapshot()

    def snapshot(self) -> list[Req]:
        with self.lock:
            return list(self.reqs)

    def _client(self, i: int) -> None:
        conn: http.client.HTTPConnection | None = None
        k = 0
        while not self.stopping.is_set() and (step := self.plan(i, k)) is not None:
            k += 1
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", self.port,
                                                  timeout=REQUEST_TIMEOUT_S)
            req = request(conn, step[0], self.prompt, self.max_tokens, step[1], i)
            with self.lock:
                self.reqs.append(req)
            if not req.ok:
                conn.close()
                conn = None
                self.stopping.wait(RETRY_S)
        if conn is not None:
            conn.close()
