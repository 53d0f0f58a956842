"""Each incarnation's own TMPDIR, removed once the incarnation is gone.

Engines leave files in the temporary directory that only a clean exit removes: vLLM's
single-process executor rendezvouses through a FileStore (`$TMPDIR/vllm_dist_<uuid>`), its servers
bind ZeroMQ `ipc://$TMPDIR/<uuid>` sockets, and a SIGKILLed, hung or OOM-killed engine removes
none of them. Supervised for weeks with restarts, that is thousands of files. So, like systemd's
PrivateTmp= for one incarnation, every engine process gets TMPDIR set to a directory of its own:

    <daemon's temp dir>/engined-scratch-<daemon pid>/<replica>.<incarnation>/

created at spawn, removed when the reaper has cleared the incarnation (its processes are gone;
in the background, just after the replacement's spawn: an rmdir can take milliseconds), the
whole root removed at shutdown and by the guard after a SIGKILLed daemon; roots of daemons
that died without either are swept at start. Caches that live under the temporary directory by
default (torch inductor's) are pointed at the place they would have had, so restarts keep them.
A spec whose `env` sets TMPDIR keeps its own and gets none of this.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Mapping

log = logging.getLogger("engined.scratch")

ROOT_PREFIX = "engined-scratch-"
# vLLM binds `ipc://<TMPDIR>/<uuid4>` (37 more bytes); a unix socket path has at most 107
_MAX_DIR_CHARS = 64


def root(daemon_pid: int | None = None) -> Path:
    return Path(tempfile.gettempdir()) / f"{ROOT_PREFIX}{daemon_pid or os.getpid()}"


def incarnation_dir(token: str) -> Path:
    """The directory of the incarnation whose owner mark is `token` (`<pid>/<replica>/<n>`)."""
    daemon, _, rest = token.partition("/")
    base = root(int(daemon))
    path = base / rest.replace("/", ".")
    if len(str(path)) > _MAX_DIR_CHARS:  # a long name or temp dir: short, still unique
        path = base / hashlib.sha1(token.encode()).hexdigest()[:12]
    return path


def _default_inductor_cache() -> str | None:
    """Where torch inductor caches by default (its default_cache_dir), in our temp dir."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        return None
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_",
                                                                          user))


def environment(token: str, env: Mapping[str, str], torch: bool = True) -> dict[str, str]:
    """The variables to add for a child's own TMPDIR, `env` being its spec's env: nothing if
    that sets TMPDIR. Creates the directory. The inductor cache is left alone where the spec or
    the daemon's own environment (which the child inherits) sets it; `torch`: the child may
    use torch (not `builtin:echo`), so the TMPDIR links the cache (made if need be)."""
    if "TMPDIR" in env:
        return {}
    path = incarnation_dir(token)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.mkdir(mode=0o700, exist_ok=True)
    extra = {"TMPDIR": str(path)}
    cache = _default_inductor_cache()
    if cache is not None and "TORCHINDUCTOR_CACHE_DIR" not in {**os.environ, **env}:
        extra["TORCHINDUCTOR_CACHE_DIR"] = cache
    if torch and cache is not None and extra.get("TORCHINDUCTOR_CACHE_DIR") == cache:
        # torch puts some of it (its precompiled headers) under $TMPDIR whatever the variable
        # says: the same place, or every restart compiles them again (~20 s of g++ on a CPU)
        with contextlib.suppress(OSError):
            os.makedirs(cache, exist_ok=True)
            (path / os.path.basename(cache)).symlink_to(cache, target_is_directory=True)
    return extra


def remove(token: str) -> int:
    """Remove an incarnation's directory (its processes are gone); the entries it held (not
    counting the link to the inductor cache that `environment` made)."""
    path = incarnation_dir(token)
    try:
        count = sum(1 for entry in path.iterdir()
                    if not (entry.is_symlink() and entry.name.startswith("torchinductor_")))
    except OSError:
        return 0
    shutil.rmtree(path, ignore_errors=True)
    return count


def remove_root(daemon_pid: int | None = None) -> None:
    shutil.rmtree(root(daemon_pid), ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(keep: set[int] = frozenset()) -> list[Path]:  # type: ignore[assignment]
    """Remove the roots of daemons of ours that are gone (one that is alive, or a pid reused
    since, is left alone, and so are those of `keep`: daemons whose engines were adopted); the
    roots removed."""
    removed: list[Path] = []
    base = Path(tempfile.gettempdir())
    uid = os.getuid()
    try:
        entries = list(base.glob(f"{ROOT_PREFIX}*"))
    except OSError:
        return removed
    for path in entries:
        pid = path.name[len(ROOT_PREFIX):]
        try:
            if not pid.isdigit() or path.is_symlink() or path.stat().st_uid != uid:
                continue
        except OSError:
            continue
        if int(pid) != os.getpid() and int(pid) not in keep and not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("[start] removed %d scratch dir(s) of engined daemons that are gone: %s",
                 len(removed), ", ".join(str(p) for p in removed))
    return removed
