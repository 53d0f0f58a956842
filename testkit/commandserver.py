"""A small stdlib HTTP server that tests (and benchmarks) run as a `command:` engine.

It behaves like an inference server engined did not write: it listens on $PORT (or --port),
answers /health, exposes Prometheus text at /metrics (`fake:num_requests_running`,
`fake:generation_tokens_total`) and serves an OpenAI-style API (/v1/models, /v1/completions,
/v1/chat/completions, SSE when `stream`, `return_token_ids` like vLLM, `n` copies; /tokenize,
/detokenize, /version, /v1/embeddings, /v1/responses). Every answer carries the body it got
(`fake_received`, in a stream's first event): what a gateway in front passed on. Its tokens are
produced by a separate *core* process (a grandchild of engined, like vLLM's EngineCore, whose
process title overwrites its environment): SIGSTOP the core and every request hangs while
/health stays 200.

Token ids are bytes. The next token is a function of the whole sequence so far (prompt ids and
generated ids), so a request replayed elsewhere with its delivered ids appended to the prompt
continues exactly as it would have: an exact oracle for the gateway's failover.

Broken answers (a completion whose prompt is one of these): `!garbage` streams a truncated JSON
event and a line that is not JSON, then closes; `!truncated` answers 200 with a Content-Length
larger than the JSON it sends, then closes; `!endless` streams one event and then nothing, never
ending its body.

Faults (flags): --start-delay S (listen after S), --never-ready (/health 503), --exit-after S
--exit-code N (exit on its own), --orphan (start a grandchild in a session of its own that
outlives this process unless its supervisor kills it), --pidfile-dir DIR (write core.pid and
orphan.pid there).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "fake-model"
VERSION = "fake-1.0"
# the rest of an OpenAI/vLLM server's API, answered from the body: token ids are bytes
OTHER_ROUTES = {
    "/tokenize": lambda body: {"tokens": list(str(body.get("prompt", "")).encode()),
                               "count": len(str(body.get("prompt", "")).encode())},
    "/detokenize": lambda body: {"prompt": bytes(body.get("tokens") or []).decode()},
    "/v1/embeddings": lambda body: {"object": "list", "model": MODEL, "data": [
        {"object": "embedding", "index": 0,
         "embedding": [b / 255 for b in str(body.get("input", "")).encode()[:8]]}]},
    "/v1/responses": lambda body: {"object": "response", "model": MODEL, "status": "completed",
                                   "output_text": str(body.get("input", ""))[::-1]},
}


def _garbage(handler: BaseHTTPRequestHandler) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.send_header("Connection", "close")
    handler.end_headers()
    handler.wfile.write(b'data: {"id": "x", "choices": [{"text": "a"\n\ndata: not json\n\n')
    handler.wfile.flush()
    handler.close_connection = True


def _truncated(handler: BaseHTTPRequestHandler) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", "500")
    handler.send_header("Connection", "close")
    handler.end_headers()
    handler.wfile.write(b'{"id": "x", "object": "text_completion", "choi')
    handler.wfile.flush()
    handler.close_connection = True


def _endless(handler: BaseHTTPRequestHandler) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.end_headers()
    event = {"id": "x", "object": "text_completion", "model": MODEL,
             "choices": [{"index": 0, "text": "a", "finish_reason": None}]}
    handler.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
    handler.wfile.flush()
    while True:  # never ends its body (until the client goes away)
        time.sleep(0.5)
        try:
            handler.wfile.write(b": still here\n\n")
            handler.wfile.flush()
        except OSError:
            return


BROKEN = {"!garbage": _garbage, "!truncated": _truncated, "!endless": _endless}


def next_token(sequence: list[int]) -> int:
    return 97 + sum(sequence) % 26  # a..z


def wipe_environ() -> None:
    """What setproctitle does to make room for a title (vLLM's EngineCore sets one): the
    environment block the kernel shows in /proc/PID/environ is overwritten."""
    import ctypes

    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])  # env_start, env_end (stat fields 50, 51)
    ctypes.memset(start, 0, end - start)


def core_main(path: str, tick_s: float) -> int:
    """The core: counts ticks into `path` (8 bytes); the server's tokens wait for its ticks.
    Like vLLM's EngineCore it overwrites its environment, so engined's mark is gone from it."""
    wipe_environ()
    fd = os.open(path, os.O_RDWR)
    ticks = 0
    while True:
        ticks += 1
        os.pwrite(fd, struct.pack("<Q", ticks), 0)
        time.sleep(tick_s)


class Core:
    def __init__(self, tick_s: float, pidfile_dir: str | None) -> None:
        fd, self.path = tempfile.mkstemp(prefix="fakecore-")
        os.write(fd, b"\0" * 8)
        self.fd = fd
        self.proc = subprocess.Popen([sys.executable, __file__, "--core", self.path,
                                      "--tick", str(tick_s)])
        if pidfile_dir:
            with open(os.path.join(pidfile_dir, "core.pid"), "w") as f:
                f.write(str(self.proc.pid))
        while self.ticks() == 0 and self.proc.poll() is None:  # it has opened the file
            time.sleep(0.005)
        os.unlink(self.path)

    def ticks(self) -> int:
        return int(struct.unpack("<Q", os.pread(self.fd, 8, 0))[0])

    def wait_tick(self, after: int) -> int:
        while True:
            now = self.ticks()
            if now > after:
                return now
            time.sleep(0.002)


class State:
    def __init__(self, args: argparse.Namespace, core: Core) -> None:
        self.args, self.core = args, core
        self.lock = threading.Lock()
        self.running = 0
        self.tokens = 0


def make_handler(state: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: object) -> None:
            pass

        def _send(self, code: int, body: object, content_type: str = "application/json") -> None:
            data = (json.dumps(body) if content_type == "application/json" else str(body)).encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/health":
                self._send(503 if state.args.never_ready else 200, {"ok": True})
            elif self.path == "/metrics":
                text = (f"# TYPE fake:num_requests_running gauge\n"
                        f"fake:num_requests_running {state.running}\n"
                        f"# TYPE fake:generation_tokens counter\n"
                        f"fake:generation_tokens_total {state.tokens}\n")
                self._send(200, text, "text/plain; version=0.0.4")
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            elif self.path == "/version":
                self._send(200, {"version": VERSION})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                self._send(400, {"error": {"message": "bad JSON"}})
                return
            if body.get("model") != MODEL:
                self._send(404, {"error": {"message": f"model {body.get('model')!r} not found"}})
                return
            if self.path in OTHER_ROUTES:
                self._send(200, {**OTHER_ROUTES[self.path](body), "fake_received": body})
                return
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            chat = self.path.endswith("chat/completions")
            if chat:
                text = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"])
                prompt_ids = list(text.encode())
            elif isinstance(body.get("prompt"), list):
                prompt_ids = [int(t) for t in body["prompt"]]
            else:
                prompt_ids = list(str(body.get("prompt", "")).encode())
            max_tokens = int(body.get("max_tokens") or 16)
            if max_tokens < 1:
                self._send(400, {"error": {"message": "max_tokens must be at least 1"}})
                return
            if not chat and str(body.get("prompt", "")) in BROKEN:
                BROKEN[str(body["prompt"])](self)
                return
            with state.lock:
                state.running += 1
            try:
                self._generate(body, chat, prompt_ids, max_tokens)
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                with state.lock:
                    state.running -= 1

        def _generate(self, body: dict, chat: bool, prompt_ids: list[int], max_tokens: int) -> None:
            stream, with_ids = bool(body.get("stream")), bool(body.get("return_token_ids"))
            kind = "chat.completion" if chat else "text_completion"
            sequence, out = list(prompt_ids), []
            if stream:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
            tick = state.core.ticks()
            for i in range(max_tokens):
                tick = state.core.wait_tick(tick)
                token = next_token(sequence)
                sequence.append(token)
                out.append(token)
                with state.lock:
                    state.tokens += 1
                finish = "length" if i == max_tokens - 1 else None
                if stream:
                    choice: dict = {"index": 0, "finish_reason": finish}
                    piece = chr(token)
                    if chat:
                        choice["delta"] = {"content": piece}
                    else:
                        choice["text"] = piece
                    if with_ids:
                        choice["token_ids"] = [token]
                    chunk: dict = {"id": "x", "object": kind + ".chunk" if chat else kind,
                                   "model": MODEL, "choices": [choice]}
                    if with_ids and i == 0:
                        chunk["prompt_token_ids"] = prompt_ids
                    if i == 0:
                        chunk["fake_received"] = body
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
            usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(out),
                     "total_tokens": len(prompt_ids) + len(out)}
            text = bytes(out).decode()
            if stream:
                if (body.get("stream_options") or {}).get("include_usage"):
                    chunk = {"id": "x", "object": kind, "model": MODEL, "choices": [],
                             "usage": usage}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True
                return
            choices = []
            for index in range(int(body.get("n") or 1)):  # n copies: the oracle is greedy
                choice: dict = {"index": index, "finish_reason": "length"}
                if chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                if with_ids:
                    choice["token_ids"] = out
                choices.append(choice)
            answer = {"id": "x", "object": kind, "model": MODEL, "choices": choices,
                      "usage": usage, "fake_received": body}
            if with_ids:
                answer["prompt_token_ids"] = prompt_ids
            self._send(200, answer)

    return Handler


def start_orphan(pidfile_dir: str | None) -> None:
    """A grandchild that leaves our process group and session: only engined's owner mark (its
    inherited environment) still ties it to this engine."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                            start_new_session=True)
    if pidfile_dir:
        with open(os.path.join(pidfile_dir, "orphan.pid"), "w") as f:
            f.write(str(proc.pid))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "0")))
    parser.add_argument("--tick", type=float, default=0.005)
    parser.add_argument("--start-delay", type=float, default=0.0)
    parser.add_argument("--never-ready", action="store_true")
    parser.add_argument("--exit-after", type=float, default=None)
    parser.add_argument("--exit-code", type=int, default=1)
    parser.add_argument("--orphan", action="store_true")
    parser.add_argument("--pidfile-dir", default=None)
    parser.add_argument("--core", default=None)
    args = parser.parse_args()
    if args.core:
        return core_main(args.core, args.tick)
    core = Core(args.tick, args.pidfile_dir)
    if args.orphan:
        start_orphan(args.pidfile_dir)
    if args.exit_after is not None:
        threading.Timer(args.exit_after, lambda: os._exit(args.exit_code)).start()
    time.sleep(args.start_delay)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(State(args, core)))
    server.daemon_threads = True
    print(f"fake server pid {os.getpid()} listening on {args.port}", flush=True)
    try:
        server.serve_forever()
    finally:
        core.proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
