"""enginectl across several nodes (`--host` more than once, or `--hosts-file`): status merged
with a NODE column, every node's events in time order, and NODE/NAME actions."""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engined.supervisor.ctl.client import Remote
from engined.supervisor.ctl.commands import (
    EXIT_NOT_READY,
    EXIT_OK,
    EXIT_USAGE,
    STATUS_TIMEOUT_S,
    Client,
    CtlError,
    cmd_action,
    error_reason,
    not_ready,
    print_json,
)
from engined.supervisor.ctl.format import (
    STATUS_HEADER,
    render_table,
    status_row,
    wall_now,
)

# --- several nodes (--host) --------------------------------------------------------------------
NODE_CONNECT_TIMEOUT_S = 0.8  # a node that is down or cut off is shown as such, quickly


def remotes_of(args: argparse.Namespace) -> list[Remote]:
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
        raise CtlError(f"cannot read {e.filename}: {error_reason(e)}", EXIT_USAGE) from e
    try:
        remotes = [Remote(text, token, args.cacert) for text in dict.fromkeys(texts)]
    except ValueError as e:
        raise CtlError(f"--host {e}", EXIT_USAGE) from e
    if len({r.name for r in remotes}) != len(remotes):
        raise CtlError("two --host values share a NODE name", EXIT_USAGE)
    return remotes


def on_nodes(remotes: list[Remote], args: argparse.Namespace) -> int:
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
        print_json({"nodes": [{"node": r.name, "status": data, "error": error or None}
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
        unready = unready or not_ready(engines, bool(mine))
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
