"""The runtime directory (0700) and the lock that allows one daemon per directory."""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from engined.engine.contract import default_runtime_dir


class StartupError(Exception):
    """A fatal start-up problem with the runtime directory (exit 1)."""


def resolve_runtime_dir(configured: str | None) -> Path:
    return Path(configured or default_runtime_dir())


def resolve_log_dir(configured: str | None, runtime_dir: Path) -> Path:
    logs = os.environ.get("LOGS_DIRECTORY", "").split(":")[0]
    return Path(configured or logs or runtime_dir / "logs")


def prepare_runtime_dir(path: Path) -> None:
    """Create it 0700; refuse one owned by someone else (a /tmp path may be pre-created)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise StartupError(f"runtime directory {path} is not a directory")
    if info.st_uid != os.getuid():
        raise StartupError(f"runtime directory {path} is owned by uid {info.st_uid}, "
                            f"not by us (uid {os.getuid()})")
    os.chmod(path, 0o700)


class RuntimeLock:
    """An flock on <runtime_dir>/engined.lock, holding our pid; released when the process dies.

    Two daemons on one directory would bind the same ZeroMQ ipc:// paths, and the second bind
    silently steals the endpoint from the first: hence the lock, taken before anything binds.
    """

    def __init__(self, runtime_dir: Path) -> None:
        self.path = runtime_dir / "engined.lock"
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock. A daemon that exits cleanly unlinks the file while it holds the lock,
        so a lock taken on a file that is no longer the one at the path (the inode changed, or
        it is gone) is stale: open again."""
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise StartupError(f"another engined (pid {holder}) holds the runtime "
                                    f"directory {self.path.parent}") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self.fd = fd
                return
            os.close(fd)  # unlinked by the daemon that just left: try the new file
        raise StartupError(f"cannot lock {self.path}: it keeps being replaced")

    def release(self, unlink: bool = False) -> None:
        """`unlink` (a clean exit): remove the file first, while still holding the lock."""
        if self.fd is not None:
            if unlink:
                try:
                    self.path.unlink()
                except OSError:
                    pass
            os.close(self.fd)
            self.fd = None
