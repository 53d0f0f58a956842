"""enginectl's commands against one daemon: the control socket's client (or one node's control
API over TCP), each subcommand's request and how its answer is printed. Standard library only,
and fast to import (see engined.supervisor.ctl.cli).

Exit codes (a contract, see DESIGN.md): 0 ok; 1 the operation failed; 2 usage error; 3 (`status`)
an engine that should be READY is not; 4 daemon unreachable or access denied.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import quote

from engined.supervisor.ctl.client import CONNECT_TIMEOUT_S, Remote, open_request
from engined.supervisor.ctl.format import (
    STATUS_HEADER,
    render_table,
    status_row,
    wall_now,
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_READY = 3
EXIT_UNREACHABLE = 4

STATUS_TIMEOUT_S = 30.0
RELOAD_TIMEOUT_S = 300.0
UPGRADE_TIMEOUT_S = 120.0  # the drain (at most the longest stop_timeout), then the exec
# The daemon waits up to the command's own timeout before answering; leave it room to reply.
WAIT_MARGIN_S = 30.0
DEFAULT_ACTION_TIMEOUT_S = 120.0
DEFAULT_GENERATE_TIMEOUT_S = 300.0
DEFAULT_LOG_LINES = 50
DEFAULT_MAX_TOKENS = 64
STREAM_CHUNK_BYTES = 65536


# --- transport --------------------------------------------------------------------------------


class CtlError(Exception):
    """A failure to report as `enginectl: <message>` with the given exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _error_text(body: bytes, status: int, reason: str) -> str:
    """The daemon's `{"error": ...}` text, or whatever the body says."""
    try:
        data = json.loads(body)
        if isinstance(data, dict) and isinstance(data.get("error"), str):
            return data["error"]
    except ValueError:
        pass
    text = body.decode("utf-8", "replace").strip()
    return text or f"HTTP {status} {reason}"


class Client:
    """Talks to the daemon; enginectl makes a handful of requests at most, one per connection."""

    def __init__(self, socket_path: str, remote: Remote | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.remote, self.connect_timeout_s = remote, connect_timeout_s
        self.socket_path = remote.url if remote is not None else socket_path  # for messages

    @contextlib.contextmanager
    def transport_errors(self) -> Iterator[None]:
        """Turn socket-level failures into exit code 4 with a message naming the socket."""
        try:
            yield
        except PermissionError as e:  # the file system said no (socket 0600, directory 0700)
            raise CtlError(f"access denied to engined's socket {self.socket_path}: "
                           f"{error_reason(e)} (only root and the user engined runs as may use it; "
                           f"you are uid {os.getuid()})", EXIT_UNREACHABLE) from e
        except OSError as e:  # missing socket, refused, reset, timed out
            raise CtlError(f"cannot reach engined at {self.socket_path}: {error_reason(e)} "
                           "(is engined running?)", EXIT_UNREACHABLE) from e
        except http.client.IncompleteRead as e:  # the daemon died mid-answer
            raise CtlError(f"lost connection to engined at {self.socket_path}: {error_reason(e)}",
                           EXIT_UNREACHABLE) from e
        except http.client.HTTPException as e:
            raise CtlError(f"bad response from engined at {self.socket_path}: "
                           f"{error_reason(e)}") from e

    def open(self, method: str, path: str, body: Any = None,
             timeout_s: float | None = STATUS_TIMEOUT_S) -> http.client.HTTPResponse:
        """Send a request; return a 2xx response, else raise CtlError with the daemon's text."""
        with self.transport_errors():
            if self.remote is not None:
                resp = self.remote.open(method, path, body, timeout_s, self.connect_timeout_s)
            else:
                resp = open_request(self.socket_path, method, path, body, timeout_s=timeout_s)
            if resp.status < 400:
                return resp
            text = _error_text(resp.read(), resp.status, resp.reason)
        resp.close()
        if resp.status in (401, 403):
            raise CtlError(f"access denied by engined at {self.socket_path}: {text}",
                           EXIT_UNREACHABLE)
        raise CtlError(text)

    def call(self, method: str, path: str, body: Any = None,
             timeout_s: float | None = STATUS_TIMEOUT_S) -> Any:
        """A JSON request/response exchange."""
        resp = self.open(method, path, body, timeout_s)
        with self.transport_errors():
            raw = resp.read()
        resp.close()
        try:
            return json.loads(raw)
        except ValueError as e:
            raise CtlError(f"bad response from engined at {self.socket_path}: {e}") from e


def error_reason(e: BaseException) -> str:
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


# --- commands ---------------------------------------------------------------------------------


def select_engines(engines: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Engines matching each NAME (replica, group or `all`), in status order; unknown → error."""
    wanted: set[str] = set()
    for name in names:
        matched = {e["name"] for e in engines
                   if name == "all" or e.get("name") == name or e.get("group") == name}
        if not matched and name != "all":
            raise CtlError(f"unknown engine '{name}'")
        wanted |= matched
    return [e for e in engines if e["name"] in wanted]


def not_ready(engines: list[dict[str, Any]], named: bool) -> bool:
    # Without names, engines an operator stopped on purpose, and standbys (the fleet serves in
    # full while one builds), do not count against health.
    return any(e.get("state") != "READY" for e in engines
               if named or e.get("desired", "run") == "run" and e.get("role") != "standby")


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    if args.watch:
        return _watch_status(client, args)
    data = client.call("GET", "/v1/status")
    engines = data.get("engines", [])
    if args.names:
        engines = select_engines(engines, args.names)
        data = {**data, "engines": engines}
    if args.json:
        print_json(data)
    else:
        now = wall_now()
        print(render_table([STATUS_HEADER] + [status_row(e, now) for e in engines]))
        if args.names and len(engines) == 1:
            _print_log_tail(engines[0])
    return EXIT_NOT_READY if not_ready(engines, bool(args.names)) else EXIT_OK


def _status_table(data: Mapping[str, Any], names: list[str], now: float) -> str:
    engines = data.get("engines", [])
    if names:
        engines = select_engines(engines, names)
    return render_table([STATUS_HEADER] + [status_row(e, now) for e in engines])


def _watch_status(client: Client, args: argparse.Namespace) -> int:
    """Redraw the table when an engine changes state (the daemon's event stream: no polling);
    in between, only the ages move, computed here once a second. Ctrl-C ends it."""
    events: queue.Queue[bytes | None] = queue.Queue()
    resp = client.open("GET", "/v1/events?lines=0&follow=1", timeout_s=None)

    def pump() -> None:
        try:
            while line := resp.readline():
                events.put(line)
        except (OSError, http.client.HTTPException):
            pass
        events.put(None)  # the daemon went away

    threading.Thread(target=pump, daemon=True, name="events").start()
    tty = sys.stdout.isatty()
    data = client.call("GET", "/v1/status")
    changed = True
    try:
        while True:
            now = wall_now()
            if changed or tty:
                table = _status_table(data, args.names, now)
                if tty:  # home, clear, the table, a footer
                    sys.stdout.write(f"\x1b[H\x1b[2J{table}\n\nwatching engined "
                                     f"{client.socket_path} (Ctrl-C to quit)\n")
                else:
                    sys.stdout.write(f"{table}\n\n")
                sys.stdout.flush()
            changed = False
            try:
                line = events.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                raise CtlError(f"lost connection to engined at {client.socket_path}",
                               EXIT_UNREACHABLE)
            while True:  # a burst of transitions: one redraw
                try:
                    if events.get_nowait() is None:
                        raise CtlError(f"lost connection to engined at {client.socket_path}",
                                       EXIT_UNREACHABLE)
                except queue.Empty:
                    break
            data, changed = client.call("GET", "/v1/status"), True
    except KeyboardInterrupt:
        # The reader thread holds the response in a blocking read: closing it from here would
        # wait on that read. Nothing to clean up: leave at once.
        sys.stdout.flush()
        os._exit(EXIT_OK)


def cmd_events(client: Client, args: argparse.Namespace) -> int:
    """State transitions as JSON lines, the recent ones first; -f: then as they happen."""
    query = f"lines={args.lines}" + ("&follow=1" if args.follow else "")
    resp = client.open("GET", f"/v1/events?{query}",
                       timeout_s=None if args.follow else STATUS_TIMEOUT_S)
    out = sys.stdout.buffer
    try:
        while True:
            with client.transport_errors():
                line = resp.readline()
            if not line:
                return EXIT_OK
            out.write(line)
            out.flush()
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        resp.close()


def _print_log_tail(engine: Mapping[str, Any]) -> None:
    if engine.get("fail_reason"):
        print(f"\nfailed: {engine['fail_reason']}")
    last = engine.get("last_exit") or {}
    if last.get("description"):
        print(f"last exit: {last['description']} (reason {last.get('reason')})")
    tail = last.get("log_tail") or []
    if tail:
        print(f"\nlast exit of {engine['name']}, log tail:")
        for line in tail:
            print(f"    {line}")


def format_action_result(result: Mapping[str, Any], requested: str | None = None) -> str:
    """`tiny-0: READY (pid 1234)` or `tiny-0: FAILED: <error>`; without waiting (`requested`:
    the action), what was asked and the state it was in: `tiny-0: restart requested (was READY,
    pid 1234)`."""
    if requested is not None and result.get("ok"):
        pid = result.get("pid")
        was = f"was {result.get('state')}" + ("" if pid is None else f", pid {pid}")
        return f"{result.get('name')}: {requested} requested ({was})"
    head = f"{result.get('name')}: {result.get('state')}"
    if not result.get("ok"):
        return f"{head}: {result.get('error') or 'did not reach the target state'}"
    pid = result.get("pid")
    return head if pid is None else f"{head} (pid {pid})"


def cmd_action(client: Client, args: argparse.Namespace) -> int:
    """restart / stop / start: one request per NAME; a 404 for one does not skip the others."""
    body = {"wait": not args.no_wait, "timeout_s": args.timeout}
    if getattr(args, "all_at_once", False):
        body["all_at_once"] = True
    http_timeout_s = args.timeout + WAIT_MARGIN_S
    failed = False
    for name in dict.fromkeys(args.names):  # de-duplicate, keep order
        path = f"/v1/engines/{quote(name, safe='')}/{args.command}"
        try:
            data = client.call("POST", path, body, timeout_s=http_timeout_s)
        except CtlError as e:
            if e.exit_code != EXIT_FAILED:
                raise  # unreachable / denied: the rest would fail the same way
            print(f"enginectl: {e}", file=sys.stderr)
            failed = True
            continue
        for result in data.get("engines", []):
            print(format_action_result(result, args.command if args.no_wait else None))
            failed = failed or not result.get("ok")
    return EXIT_FAILED if failed else EXIT_OK


def format_reload(diff: Mapping[str, Any]) -> list[str]:
    def line(label: str, key: str) -> list[str]:
        names = diff.get(key) or []
        return [f"{label}: {', '.join(names)}"] if names else []

    lines = line("added", "added") + line("removed", "removed") + line("changed", "changed")
    if not lines:
        lines = ["no changes"]
    return lines + line("unchanged", "unchanged") + line("restart required", "restart_required")


def cmd_reload(client: Client, args: argparse.Namespace) -> int:
    diff = client.call("POST", "/v1/reload", timeout_s=RELOAD_TIMEOUT_S)
    print("\n".join(format_reload(diff)))
    return EXIT_OK


def cmd_upgrade(client: Client, args: argparse.Namespace) -> int:
    """The installed engined takes over in place (1: refused, nothing changed; or no report)."""
    before = client.call("POST", "/v1/upgrade", {"settle_s": args.timeout},
                         timeout_s=args.timeout + RELOAD_TIMEOUT_S)
    deadline, sup = time.monotonic() + args.timeout, dict(handovers=-1, upgrade_abandoned=0)
    while sup["handovers"] <= before["handovers"]:
        if sup["upgrade_abandoned"] > before["abandoned"] or time.monotonic() >= deadline:
            raise CtlError(str(sup.get("upgrade_error") or f"no report in {args.timeout:g}s"))
        time.sleep(0.05)
        status = client.call("GET", "/v1/status")
        sup, kept = status["supervisor"], sum(1 for e in status["engines"] if e["adopted_at"])
    print(f"engined upgraded in place: {before['from']} -> {sup['version']} (pid {sup['pid']}, "
          f"hand-over {sup['handover_s']}s, {kept} engine(s) kept running)")
    return EXIT_OK


def cmd_logs(client: Client, args: argparse.Namespace) -> int:
    query = f"lines={args.lines}" + ("&follow=1" if args.follow else "")
    path = f"/v1/engines/{quote(args.name, safe='')}/logs?{query}"
    # Following waits for new lines indefinitely; only the connect is bounded.
    resp = client.open("GET", path, timeout_s=None if args.follow else STATUS_TIMEOUT_S)
    sys.stdout.flush()
    out = sys.stdout.buffer
    try:
        while True:
            with client.transport_errors():
                chunk = resp.read1(STREAM_CHUNK_BYTES)
            if not chunk:
                return EXIT_OK
            out.write(chunk)
            out.flush()  # show lines as they arrive, not when a buffer fills
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        resp.close()


def cmd_generate(client: Client, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"prompt": " ".join(args.prompt), "max_tokens": args.max_tokens,
                            "engine": args.engine, "temperature": args.temperature,
                            "timeout_s": args.timeout}
    if args.seed is not None:
        body["seed"] = args.seed
    if args.stop:
        body["stop"] = args.stop
    if args.stream:
        return _generate_stream(client, body, args)
    data = client.call("POST", "/v1/generate", body, timeout_s=args.timeout + WAIT_MARGIN_S)
    if args.json:
        print_json(data)
    else:
        print(data.get("text", ""))
    return EXIT_OK


def _generate_stream(client: Client, body: dict[str, Any], args: argparse.Namespace) -> int:
    """Print tokens as they come (the daemon's NDJSON lines); `--json` prints the lines."""
    resp = client.open("POST", "/v1/generate", {**body, "stream": True},
                       timeout_s=args.timeout + WAIT_MARGIN_S)
    out = sys.stdout
    try:
        while True:
            with client.transport_errors():
                line = resp.readline()
            if not line:
                raise CtlError("the stream ended without a result (engined went away?)")
            event = json.loads(line)
            if args.json:
                out.write(line.decode())
            elif "error" in event:
                out.write("\n")
                out.flush()
                raise CtlError(str(event["error"]))
            else:
                out.write(event.get("text", ""))
            out.flush()
            if event.get("done"):
                if not args.json:
                    out.write("\n")
                return EXIT_OK
            if "error" in event:
                return EXIT_FAILED
    finally:
        resp.close()


# --- argument parsing -------------------------------------------------------------------------
