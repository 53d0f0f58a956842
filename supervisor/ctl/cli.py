"""enginectl: the command-line client for engined's control socket.

Speaks HTTP/1.1 + JSON over the daemon's unix socket. It must start fast (`enginectl status` well
under 300 ms end to end), so it imports only the standard library, `engined.supervisor.ctl.client`
and `engined.engine.contract` (where daemon and client agree on the socket's location).

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
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import quote

from engined.engine.contract import resolve_socket_path
from engined.supervisor import __version__
from engined.supervisor.ctl.client import CONNECT_TIMEOUT_S, Remote, open_request
from engined.supervisor.ctl.completion import completion_script
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
            raise CtlError(f"access denied to engined's socket {self.socket_path}: {_reason(e)} "
                           f"(only root and the user engined runs as may use it; "
                           f"you are uid {os.getuid()})", EXIT_UNREACHABLE) from e
        except OSError as e:  # missing socket, refused, reset, timed out
            raise CtlError(f"cannot reach engined at {self.socket_path}: {_reason(e)} "
                           "(is engined running?)", EXIT_UNREACHABLE) from e
        except http.client.IncompleteRead as e:  # the daemon died mid-answer
            raise CtlError(f"lost connection to engined at {self.socket_path}: {_reason(e)}",
                           EXIT_UNREACHABLE) from e
        except http.client.HTTPException as e:
            raise CtlError(f"bad response from engined at {self.socket_path}: {_reason(e)}") from e

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


def _reason(e: BaseException) -> str:
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


def _print_json(data: Any) -> None:
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


def _not_ready(engines: list[dict[str, Any]], named: bool) -> bool:
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
        _print_json(data)
    else:
        now = wall_now()
        print(render_table([STATUS_HEADER] + [status_row(e, now) for e in engines]))
        if args.names and len(engines) == 1:
            _print_log_tail(engines[0])
    return EXIT_NOT_READY if _not_ready(engines, bool(args.names)) else EXIT_OK


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


def cmd_completion(client: Client, args: argparse.Namespace) -> int:
    """`completion bash|zsh` prints the script; `completion names` (what the script calls)
    prints the daemon's groups and replicas, and `all`."""
    if args.shell != "names":
        sys.stdout.write(completion_script(args.shell, build_parser()))
        return EXIT_OK
    engines = client.call("GET", "/v1/status").get("engines", [])
    names = dict.fromkeys([e["group"] for e in engines] + [e["name"] for e in engines])
    print("\n".join([*names, "all"]))
    return EXIT_OK


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
        _print_json(data)
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


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    # --socket on the subparsers too, so it works after the subcommand; SUPPRESS keeps a
    # subparser that did not see it from overwriting the value given before the subcommand.
    common = argparse.ArgumentParser(add_help=False)
    parser = argparse.ArgumentParser(prog="enginectl", description="Control engined.")
    parser.add_argument("--version", action="version", version=f"enginectl {__version__}")
    for p, default in ((common, argparse.SUPPRESS), (parser, None)):
        p.add_argument("--socket", metavar="PATH", default=default,
                       help="control socket (default: $ENGINED_SOCKET, else the daemon's)")
        p.add_argument("--host", action="append", metavar="[NODE=][https://]HOST:PORT",
                       default=default, help="an engined's control_tcp (repeatable: status "
                       "merges the nodes, restart/stop/start take NODE/NAME)")
        p.add_argument("--hosts-file", metavar="FILE", default=default,
                       help="more --host values, one a line")
        p.add_argument("--token-file", metavar="FILE", default=default,
                       help="the bearer token of the nodes' control_token_file")
        p.add_argument("--cacert", metavar="FILE", default=default,
                       help="CA certificates for https:// nodes (default: the system's)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("status", parents=[common], help="show engines")
    p.add_argument("names", nargs="*", metavar="NAME")
    p.add_argument("--json", action="store_true", help="print the API's JSON")
    p.add_argument("-w", "--watch", action="store_true",
                   help="redraw whenever an engine changes state, until Ctrl-C")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("completion", parents=[common], help="shell completion script")
    p.add_argument("shell", choices=("bash", "zsh", "names"),
                   help="bash or zsh (names: the engine names, for the script)")
    p.set_defaults(func=cmd_completion)

    p = sub.add_parser("events", parents=[common], help="state transitions as JSON lines")
    p.add_argument("-n", "--lines", type=_positive_int, default=100, metavar="N",
                   help="recent events first (default %(default)s)")
    p.add_argument("-f", "--follow", action="store_true", help="then stream them until Ctrl-C")
    p.set_defaults(func=cmd_events)

    for action in ("restart", "stop", "start"):
        p = sub.add_parser(action, parents=[common], help=f"{action} engines")
        p.add_argument("names", nargs="+", metavar="NAME", help="replica, group or 'all'")
        p.add_argument("--no-wait", action="store_true", help="return without waiting")
        if action == "restart":
            p.add_argument("--all-at-once", action="store_true",
                           help="restart every replica of a group together (no rollout)")
        p.add_argument("--timeout", type=_positive_float, default=DEFAULT_ACTION_TIMEOUT_S,
                       metavar="S", help="seconds to wait (default %(default)s)")
        p.set_defaults(func=cmd_action)

    p = sub.add_parser("reload", parents=[common], help="re-read the fleet spec")
    p.set_defaults(func=cmd_reload)

    p = sub.add_parser("upgrade", parents=[common], help="the installed engined takes over")
    p.add_argument("--timeout", type=_positive_float, default=UPGRADE_TIMEOUT_S, metavar="S")
    p.set_defaults(func=cmd_upgrade)

    p = sub.add_parser("logs", parents=[common], help="show an engine's log")
    p.add_argument("name", metavar="NAME")
    p.add_argument("-n", "--lines", type=_positive_int, default=DEFAULT_LOG_LINES, metavar="N")
    p.add_argument("-f", "--follow", action="store_true", help="stream new lines until Ctrl-C")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("generate", parents=[common], help="run one prompt through an engine")
    p.add_argument("prompt", nargs="+", metavar="PROMPT")
    p.add_argument("--engine", metavar="NAME", default=None)
    p.add_argument("--max-tokens", type=_positive_int, default=DEFAULT_MAX_TOKENS, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 (the default) is greedy")
    p.add_argument("--seed", type=int, default=None, metavar="N")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop before this text (repeatable)")
    p.add_argument("--stream", action="store_true", help="print tokens as they come")
    p.add_argument("--timeout", type=_positive_float, default=DEFAULT_GENERATE_TIMEOUT_S,
                   metavar="S")
    p.add_argument("--json", action="store_true", help="print the API's JSON")
    p.set_defaults(func=cmd_generate)
    return parser


# --- several nodes (--host) --------------------------------------------------------------------
NODE_CONNECT_TIMEOUT_S = 0.8  # a node that is down or cut off is shown as such, quickly


def _remotes(args: argparse.Namespace) -> list[Remote]:
    texts = list(args.host or [])
    try:
        if args.hosts_file:
            with open(args.hosts_file, encoding="utf-8") as f:
                texts += [line.strip() for line in f if line.strip()
                          and not line.lstrip().startswith("#")]
        if not texts:
            return []
        if not args.token_file:
            raise CtlError("--host needs --token-file (a node's control API asks for its "
                           "control_token_file's token)", EXIT_USAGE)
        with open(args.token_file, encoding="utf-8") as f:
            token = f.read(4096).strip()
    except OSError as e:
        raise CtlError(f"cannot read {e.filename}: {_reason(e)}", EXIT_USAGE) from e
    try:
        remotes = [Remote(text, token, args.cacert) for text in dict.fromkeys(texts)]
    except ValueError as e:
        raise CtlError(f"--host {e}", EXIT_USAGE) from e
    if len({r.name for r in remotes}) != len(remotes):
        raise CtlError("two --host values share a NODE name", EXIT_USAGE)
    return remotes


def _on_nodes(remotes: list[Remote], args: argparse.Namespace) -> int:
    if args.command == "status" and not args.watch:
        return _merged_status(remotes, args)
    if args.command == "events":
        return _merged_events(remotes, args)
    if args.command not in ("restart", "stop", "start"):
        raise CtlError(f"{args.command} talks to one node at a time: give one --host",
                       EXIT_USAGE)
    by_node: dict[str, list[str]] = {}
    for name in args.names:
        node, slash, engine = name.rpartition("/")
        if not slash or node not in {r.name for r in remotes}:
            raise CtlError(f"{name!r}: with several --host, name NODE/NAME (nodes: "
                           f"{', '.join(r.name for r in remotes)})", EXIT_USAGE)
        by_node.setdefault(node, []).append(engine)
    code = EXIT_OK
    for remote in remotes:
        if remote.name in by_node:
            print(f"[{remote.name}]")
            one = argparse.Namespace(**{**vars(args), "names": by_node[remote.name]})
            code = max(code, cmd_action(Client("", remote), one))
    return code


def _merged_status(remotes: list[Remote], args: argparse.Namespace) -> int:
    """Every node's engines in one table (a NODE column); a node that cannot be reached is a
    row saying so, and makes the exit code 3, as an engine not READY does."""
    def fetch(remote: Remote) -> tuple[Remote, Any, str]:
        try:
            client = Client("", remote, NODE_CONNECT_TIMEOUT_S)
            return remote, client.call("GET", "/v1/status"), ""
        except CtlError as e:
            return remote, None, str(e)
    with ThreadPoolExecutor(len(remotes)) as pool:
        answers = list(pool.map(fetch, remotes))
    if args.json:
        _print_json({"nodes": [{"node": r.name, "status": data, "error": error or None}
                               for r, data, error in answers]})
    rows, unready, now = [["NODE", *STATUS_HEADER]], False, wall_now()
    for remote, data, error in answers:
        if data is None:
            rows.append([remote.name, "-", f"UNREACHABLE ({error})"] + ["-"] * 5)
            unready = True
            continue
        mine = [n.rpartition("/")[2] for n in args.names
                if "/" not in n or n.rpartition("/")[0] == remote.name]
        if args.names and not mine:
            continue
        engines = [e for e in data.get("engines", []) if not mine  # a name on some nodes
                   or any(n in ("all", e.get("name"), e.get("group")) for n in mine)]
        rows += [[remote.name, *status_row(e, now)] for e in engines]
        unready = unready or _not_ready(engines, bool(mine))
    if not args.json:
        print(render_table(rows))
    return EXIT_NOT_READY if unready else EXIT_OK


def _merged_events(remotes: list[Remote], args: argparse.Namespace) -> int:
    """Every node's events, each with its `node`: the recent ones in time order, then (-f) as
    they come from any node. A node that cannot be reached is said on stderr (exit 3); the
    others go on."""
    lines: queue.Queue[tuple[Remote, bytes | None, str]] = queue.Queue()
    query = f"/v1/events?lines={args.lines}" + ("&follow=1" if args.follow else "")

    def read(remote: Remote) -> None:
        error = ""
        try:
            client = Client("", remote, NODE_CONNECT_TIMEOUT_S)
            resp = client.open("GET", query, timeout_s=None if args.follow else STATUS_TIMEOUT_S)
            with client.transport_errors():
                while line := resp.readline():
                    lines.put((remote, line, ""))
        except CtlError as e:
            error = str(e)
        finally:
            lines.put((remote, None, error))
    for remote in remotes:
        threading.Thread(target=read, args=(remote,), daemon=True, name=remote.name).start()
    backlog: list[dict[str, Any]] | None = []  # the recent events, printed in time order
    open_, code = len(remotes), EXIT_OK
    try:
        while open_:
            try:
                remote, line, error = lines.get(timeout=0.3)
            except queue.Empty:  # -f: the recent events are in (they come at once)
                if backlog is not None and args.follow:
                    _print_events(backlog, args.lines)
                    backlog = None
                continue
            if line is None:
                open_ -= 1
                if error:
                    print(f"enginectl: {remote.name}: {error}", file=sys.stderr)
                    code = EXIT_NOT_READY
                continue
            event = {"node": remote.name, **json.loads(line)}
            if backlog is not None:
                backlog.append(event)
            else:
                _print_events([event], 1)
        if backlog is not None:
            _print_events(backlog, args.lines)
    except KeyboardInterrupt:
        pass
    return code


def _print_events(events: list[dict[str, Any]], last: int) -> None:
    for event in sorted(events, key=lambda e: e.get("at") or 0)[-last:]:
        sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors, 0 after --help
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        remotes = _remotes(args)
        if len(remotes) > 1:
            return _on_nodes(remotes, args)
        if remotes:
            return args.func(Client("", remotes[0]), args)
        return args.func(Client(resolve_socket_path(args.socket)), args)
    except CtlError as e:
        print(f"enginectl: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Reader went away (`enginectl logs x | head`): not an error. Point stdout at devnull
        # so the interpreter's final flush does not complain.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
