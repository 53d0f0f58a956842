"""LogSink on its own: lines and partial writes, the ring and the file, rotation, an unwritable
file, followers, and the per-incarnation tail kept with an exit."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from engined.supervisor.logs import _MAX_LINE, TAIL_LINES, LogSink


def test_lines_split_across_writes_are_joined(tmp_path: Path) -> None:
    sink = LogSink(tmp_path / "a.log")
    sink.feed(b"first li")
    sink.feed(b"ne\nsecond\nthi")
    assert list(sink.ring) == ["first line", "second"]
    sink.flush_partial()
    assert list(sink.ring) == ["first line", "second", "thi"]
    assert (tmp_path / "a.log").read_bytes() == b"first line\nsecond\nthi"
    assert sink.lines_total == 3


def test_invalid_utf8_is_kept_readable_and_an_endless_line_is_cut(tmp_path: Path) -> None:
    sink = LogSink(tmp_path / "a.log")
    sink.feed(b"caf\xe9\n")
    sink.feed(b"x" * (_MAX_LINE + 10))  # a child writing without newlines
    assert sink.ring[0] == "caf\ufffd"
    assert len(sink.ring) == 2 and len(sink.ring[1]) == _MAX_LINE + 10


def test_tail_since_gives_one_incarnations_lines(tmp_path: Path) -> None:
    sink = LogSink(tmp_path / "a.log")
    sink.feed(b"old 1\nold 2\n")
    mark = sink.lines_total
    sink.feed(b"new 1\nnew 2\nnew 3\n")
    assert sink.tail_since(mark, 20) == ["new 1", "new 2", "new 3"]
    assert sink.tail_since(mark, 2) == ["new 2", "new 3"]
    assert sink.tail_since(sink.lines_total, 20) == []


def test_rotation_keeps_backups_and_last_lines_reads_through_them(tmp_path: Path) -> None:
    path = tmp_path / "a.log"
    sink = LogSink(path, max_bytes=1000, backups=2)
    for i in range(2 * TAIL_LINES):
        sink.feed(f"line {i:05d}\n".encode())  # 11 bytes a line: ~90 lines a file
    assert path.stat().st_size <= 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.log", "a.log.1", "a.log.2"]
    assert list(sink.ring)[-1] == f"line {2 * TAIL_LINES - 1:05d}"
    # more lines than the ring holds come from the files (the current one and its backup)
    want = TAIL_LINES + 50
    got = sink.last_lines(want)
    current_and_backup = (path.with_name("a.log.1").read_text() + path.read_text()).splitlines()
    assert got == current_and_backup[-want:]
    assert sink.last_lines(3) == [f"line {i:05d}" for i in range(2 * TAIL_LINES - 3,
                                                                2 * TAIL_LINES)]


def test_an_unwritable_file_never_stops_capture(tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the log directory should be")
    sink = LogSink(blocked / "a.log")
    sink.feed(b"still captured\n")
    assert sink.write_errors == 1 and list(sink.ring) == ["still captured"]
    # the ring is authoritative while the file misses lines
    assert sink.last_lines(TAIL_LINES + 10) == ["still captured"]


def test_followers_get_lines_as_they_come_and_none_at_close(tmp_path: Path) -> None:
    async def main() -> list[str | None]:
        sink = LogSink(tmp_path / "a.log")
        queue = sink.follow()
        sink.feed(b"one\ntwo\n")
        sink.note("spawned pid 1 incarnation 1")
        sink.close()
        return [queue.get_nowait() for _ in range(queue.qsize())]

    got = asyncio.run(main())
    assert got[:2] == ["one", "two"] and got[-1] is None
    assert got[2] is not None and got[2].startswith("[engined ") and "spawned pid 1" in got[2]


def test_the_file_is_created_owner_and_group_readable_only(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        sink = LogSink(tmp_path / "a.log")
        sink.feed(b"x\n")
    finally:
        os.umask(old)
    assert (tmp_path / "a.log").stat().st_mode & 0o777 == 0o640
