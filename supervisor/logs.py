"""Per-engine log capture: the child's fd 1 and 2 (a pipe) into a size-rotated file.

The pipe is read by the event loop, so everything the child's process writes at the fd level
(C libraries, CUDA errors, a segfault's message) is kept. A ring of recent lines gives the tail
kept with each unexpected exit, and `enginectl logs -f` followers get lines as they arrive. A log
file that cannot be written (full disk, permissions) never stops supervision: lines still reach
the ring and followers, and the file is retried a second later.

With `supervisor.engine_logs: stdout` (a container, whose runtime collects only its main
process's output) no file is written: each line goes to engined's stdout instead, prefixed with
its engine (`NAME | line`), from a thread of its own so that a slow reader of the container's
output never holds up the event loop; past STDOUT_QUEUE lines waiting, lines are dropped and
counted (`lines_dropped`).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import queue as queues
import threading
import time
from pathlib import Path

log = logging.getLogger("engined.logs")

DEFAULT_MAX_BYTES = 10 * 1024 * 1024
DEFAULT_BACKUPS = 3
TAIL_LINES = 500
_RETRY_S = 1.0
_MAX_LINE = 16 * 1024
STDOUT_QUEUE = 10_000


class StdoutLines:
    """Engine lines to engined's stdout (fd 1), written by a daemon thread."""

    def __init__(self, fd: int = 1) -> None:
        self.fd = fd
        self.lines_dropped = 0
        self._queue: queues.Queue[bytes] = queues.Queue(STDOUT_QUEUE)
        self._thread: threading.Thread | None = None

    def put(self, line: str) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._write, name="engine-stdout",
                                            daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait(line.encode("utf-8", "replace"))
        except queues.Full:
            self.lines_dropped += 1

    def flush(self, timeout_s: float = 2.0) -> None:
        """Until what was queued is written (shutdown), at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def _write(self) -> None:
        while True:
            data = self._queue.get()
            try:
                while data:
                    data = data[os.write(self.fd, data):]
            except OSError:
                pass  # nobody reads our stdout any more: the line is lost, supervision goes on
            finally:
                self._queue.task_done()


class LogSink:
    """One engine's log: file with rotation, a line ring, and live followers."""

    def __init__(self, path: Path, max_bytes: int = DEFAULT_MAX_BYTES,
                 backups: int = DEFAULT_BACKUPS, stdout: StdoutLines | None = None,
                 name: str = "") -> None:
        self.path = path
        self.stdout, self.prefix = stdout, f"{name} | "  # no file then: lines to stdout
        self.max_bytes = max_bytes
        self.backups = backups
        self.ring: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.lines_total = 0  # lines ever seen, so an incarnation can find its own tail
        self.write_errors = 0
        self.followers: dict[asyncio.Queue[str | None], str] = {}  # queue -> line prefix
        self._partial = b""
        self._file: int | None = None
        self._size = 0
        self._retry_at = 0.0
        # lines_total when a write to the file last failed: until a full ring of lines has been
        # written since, the file lacks some of the ring's lines and must not stand in for it.
        self._unwritten_mark = -TAIL_LINES

    # --- input -------------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        written = self._write_file(data)
        chunks = (self._partial + data).split(b"\n")
        self._partial = chunks.pop()
        if len(self._partial) > _MAX_LINE:  # a child writing without newlines: cut, keep going
            chunks.append(self._partial)
            self._partial = b""
        for raw in chunks:
            self._add_line(raw.decode("utf-8", "replace"))
        if not written:
            self._unwritten_mark = self.lines_total

    def flush_partial(self) -> None:
        if self._partial:
            self._add_line(self._partial.decode("utf-8", "replace"))
            self._partial = b""

    def note(self, line: str) -> None:
        """A line from the supervisor itself (spawn, exit), so the file tells the whole story."""
        stamped = f"[engined {time.strftime('%Y-%m-%dT%H:%M:%S')}] {line}\n"
        self.feed(stamped.encode())

    def _add_line(self, line: str) -> None:
        if self.stdout is not None:
            self.stdout.put(self.prefix + line + "\n")
        self.ring.append(line)
        self.lines_total += 1
        for queue, prefix in self.followers.items():
            if queue.qsize() < 10_000:  # a stuck follower must not grow without bound
                queue.put_nowait(prefix + line)

    # --- reading -----------------------------------------------------------------------------
    def tail_since(self, mark: int, limit: int) -> list[str]:
        """The last `limit` lines written after `mark` (a previous `lines_total`)."""
        fresh = min(self.lines_total - mark, len(self.ring))
        lines = list(self.ring)[len(self.ring) - fresh:] if fresh > 0 else []
        return lines[-limit:]

    def last_lines(self, count: int) -> list[str]:
        """The last `count` lines, read from the file (and its backup) when the ring is short
        and the file holds everything the ring does."""
        if (count <= len(self.ring) or self.stdout is not None
                or self.lines_total - self._unwritten_mark < TAIL_LINES):
            return list(self.ring)[len(self.ring) - count:] if count else []
        lines: list[str] = []
        for path in (self.path.with_name(self.path.name + ".1"), self.path):
            try:
                lines.extend(path.read_text("utf-8", "replace").splitlines())
            except OSError:
                continue
        return lines[-count:] if lines else list(self.ring)[-count:]

    def follow(self, queue: asyncio.Queue[str | None] | None = None,
               prefix: str = "") -> asyncio.Queue[str | None]:
        """New lines as they come, each with `prefix` (a group's replicas share one queue)."""
        if queue is None:
            queue = asyncio.Queue()
        self.followers[queue] = prefix
        return queue

    def unfollow(self, queue: asyncio.Queue[str | None]) -> None:
        self.followers.pop(queue, None)

    # --- file --------------------------------------------------------------------------------
    def _write_file(self, data: bytes) -> bool:
        """Append to the file; False if (some of) it could not be written."""
        if self.stdout is not None:
            return True  # engine_logs: stdout (the line goes there from _add_line)
        if self._file is None and not self._open():
            return False
        assert self._file is not None
        try:
            if self._size + len(data) > self.max_bytes:
                self._rotate()
            view = memoryview(data)
            while view:  # a nearly full disk takes part of a write; the rest fails (ENOSPC)
                written = os.write(self._file, view)
                if written == 0:
                    raise OSError(errno.ENOSPC, "short write")
                self._size += written
                view = view[written:]
        except OSError as exc:
            self._fail(exc)
            return False
        return True

    def _open(self) -> bool:
        now = time.monotonic()
        if now < self._retry_at:
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                                 0o640)
            self._size = os.fstat(self._file).st_size
            return True
        except OSError as exc:
            self._fail(exc)
            return False

    def _rotate(self) -> None:
        self._close()
        if self.backups == 0:  # no backups kept: start the file again
            os.truncate(self.path, 0)
        for index in range(self.backups, 0, -1):
            src = self.path if index == 1 else self.path.with_name(f"{self.path.name}.{index - 1}")
            if src.exists():
                os.replace(src, self.path.with_name(f"{self.path.name}.{index}"))
        self._open()
        if self._file is None:
            raise OSError(f"cannot reopen {self.path} after rotation")

    def _fail(self, exc: OSError) -> None:
        self.write_errors += 1
        if self.write_errors == 1 or self.write_errors % 1000 == 0:
            log.warning("[logs] cannot write %s: %s (supervision continues; %d errors)",
                        self.path, exc, self.write_errors)
        self._close()
        self._retry_at = time.monotonic() + _RETRY_S

    def _close(self) -> None:
        if self._file is not None:
            try:
                os.close(self._file)
            except OSError:
                pass
            self._file = None

    def close(self) -> None:
        self.flush_partial()
        for queue in self.followers:
            queue.put_nowait(None)
        self._close()


class PipeReader:
    """Reads a child's output pipe from the event loop into a LogSink until EOF."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, sink: LogSink) -> None:
        self.loop, self.fd, self.sink = loop, fd, sink
        self.closed = False
        loop.add_reader(fd, self.drain)

    def drain(self) -> None:
        """Read everything available now; called on readability and once more at child exit."""
        while not self.closed:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self.close()
                return
            self.sink.feed(data)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.sink.flush_partial()
