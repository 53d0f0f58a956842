"""What the daemon, the engine child and enginectl agree on, in one place.

Standard library only: the engine child imports it (possibly under another virtual environment's
interpreter, see the spec's `python:`), and enginectl must start fast. The message types live in
`engined.engine.protocol`, which builds on this.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# --- child exit codes (DESIGN "Engine lifecycle") ------------------------------------------------
EXIT_OK = 0
EXIT_FAILURE = 1  # a crash (engine child), another fatal error (daemon)
EXIT_CONFIG = 78  # EX_CONFIG: the engine's own config or model is invalid; never restarted
EXIT_SIGNAL_BASE = 128  # 128+N: terminated by signal N after cleanup
# Before exiting 78 the child prints one line starting with this, naming what is wrong; the
# daemon puts it in its log line and the engine's fail_reason.
CONFIG_LINE_PREFIX = "[config] invalid engine config: "

# --- environment the daemon sets for each child --------------------------------------------------
ENV_CONFIG = "ENGINED_CONFIG"  # JSON of protocol.EngineConfig
ENV_PARENT_PID = "ENGINED_PARENT_PID"  # the daemon's pid, checked after PR_SET_PDEATHSIG
# set (seconds > 0) when engines outlive a dead daemon for the next one to adopt
# (supervisor.orphan_timeout): the engine then sets no PR_SET_PDEATHSIG; the daemon's guard
# ends it if no engined adopts it in time
ENV_ORPHAN_TIMEOUT = "ENGINED_ORPHAN_TIMEOUT"
ENV_NOFILE = "ENGINED_NOFILE"  # the soft RLIMIT_NOFILE engined started with: the child's own
# "<daemon pid>/<engine>/<incarnation>", inherited by everything an engine starts: how engined
# (and its guard, after a daemon SIGKILL) finds an engine's descendants
ENV_OWNER = "ENGINED_OWNER"

def outlives_daemon(env: Mapping[str, str] | None = None) -> bool:
    """Whether this engine is to outlive a dead daemon (ENV_ORPHAN_TIMEOUT > 0)."""
    raw = (os.environ if env is None else env).get(ENV_ORPHAN_TIMEOUT, "")
    try:
        return float(raw) > 0
    except ValueError:
        return False


# --- engine channels (ZeroMQ ipc:// endpoints the daemon binds in its runtime directory) ----------
CONTROL_SOCKET_NAME = "engines-control.sock"
REQUEST_SOCKET_NAME = "engines-requests.sock"


def control_endpoint(runtime_dir: str | os.PathLike[str]) -> str:
    return f"ipc://{os.fspath(runtime_dir)}/{CONTROL_SOCKET_NAME}"


def request_endpoint(runtime_dir: str | os.PathLike[str]) -> str:
    return f"ipc://{os.fspath(runtime_dir)}/{REQUEST_SOCKET_NAME}"


def routing_id(engine: str, incarnation: int) -> bytes:
    """The ZeroMQ routing identity of one incarnation of an engine on the request channel."""
    return f"{engine}:{incarnation}".encode()


# --- where the daemon lives -----------------------------------------------------------------------
def default_runtime_dir(env: Mapping[str, str] | None = None) -> str:
    """$RUNTIME_DIRECTORY (first entry), else $XDG_RUNTIME_DIR/engined, else /tmp/engined-<uid>."""
    env = os.environ if env is None else env
    # systemd joins several RuntimeDirectory= entries with ':'; ours is the first.
    runtime = env.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if runtime:
        return runtime
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg:
        return os.path.join(xdg, "engined")
    return f"/tmp/engined-{os.getuid()}"


def default_socket_path(env: Mapping[str, str] | None = None) -> str:
    """The control socket the daemon binds when the spec does not name one."""
    return os.path.join(default_runtime_dir(env), "control.sock")


def resolve_socket_path(option: str | None, env: Mapping[str, str] | None = None) -> str:
    """--socket, else $ENGINED_SOCKET, else the daemon's default."""
    env = os.environ if env is None else env
    return option or env.get("ENGINED_SOCKET") or default_socket_path(env)


# --- process titles ---------------------------------------------------------------------------
_PR_SET_NAME = 15


FORK_SERVER_TITLE = "engined: fork server"


def prepare_process_title(title: str, short: str) -> None:
    """A fork server's own title. setproctitle finds the argv area by walking back from
    `environ`; set up here, before any fork, it stays usable in a forked engine that replaced its
    environment."""
    set_process_title(title, short)


def set_process_title(title: str, short: str) -> str:
    """`title` in `ps -o args` and top where setproctitle is installed (a C extension: optional
    here, the engine side needs only pyzmq and msgspec); `short` (15 bytes) as the process name
    (`ps -o comm`, top's default) in any case. Returns how it was set."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(short.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    # SPT_NOENV: the title stays within the argv area, and /proc/PID/environ (where engined's
    # owner mark lives) is left alone
    os.environ.setdefault("SPT_NOENV", "1")
    try:
        import setproctitle  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return "name"
    setproctitle.setproctitle(title)
    setproctitle.setthreadtitle(short[:15])
    return "title"
