"""enginectl: the command-line client for engined's control socket.

Speaks HTTP/1.1 + JSON over the daemon's unix socket. It must start fast (`enginectl status` well
under 300 ms end to end), so it imports only the standard library, engined.supervisor.ctl's own
modules and `engined.engine.contract` (where daemon and client agree on the socket's location).
The commands are engined.supervisor.ctl.commands', several nodes engined.supervisor.ctl.nodes'.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from engined.engine.contract import resolve_socket_path
from engined.supervisor import __version__
from engined.supervisor.ctl.commands import (
    DEFAULT_ACTION_TIMEOUT_S,
    DEFAULT_GENERATE_TIMEOUT_S,
    DEFAULT_LOG_LINES,
    DEFAULT_MAX_TOKENS,
    EXIT_OK,
    EXIT_USAGE,
    UPGRADE_TIMEOUT_S,
    Client,
    CtlError,
    cmd_action,
    cmd_events,
    cmd_generate,
    cmd_logs,
    cmd_reload,
    cmd_status,
    cmd_upgrade,
)
from engined.supervisor.ctl.completion import completion_script
from engined.supervisor.ctl.nodes import on_nodes, remotes_of


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

    helps = {"sleep": "put on-demand engines to sleep (a request wakes them)",
             "wake": "wake sleeping engines (within the memory budget)"}
    for action in ("restart", "stop", "start", "sleep", "wake"):
        p = sub.add_parser(action, parents=[common], help=helps.get(action, f"{action} engines"))
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


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors, 0 after --help
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        remotes = remotes_of(args)
        if len(remotes) > 1:
            return on_nodes(remotes, args)
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
