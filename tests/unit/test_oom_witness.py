"""host.oom's kernel-log witness reads the log only when the host's OOM-kill counter says there
may be something new in it (the log is read between an engine's exit and its respawn)."""

from __future__ import annotations

from pathlib import Path

from engined.supervisor.host.oom import OomWitness

KILLED_4242 = b"3,1,5000001,-;Out of memory: Killed process 4242 (python3) total-vm:1kB\n"
KILLED_777 = b"3,2,5000002,-;Out of memory: Killed process 777 (engine) total-vm:1kB\n"


class Log:
    """A kernel log the witness reads through `read_kmsg`, counting the reads."""

    def __init__(self) -> None:
        self.records: list[bytes] = []
        self.reads = 0


def witness(tmp_path: Path, log: Log, monkeypatch) -> tuple[OomWitness, Path]:
    import engined.supervisor.host.oom as oom

    def read(path: str = "", limit: int = 0) -> list[bytes]:
        log.reads += 1
        return list(log.records)
    monkeypatch.setattr(oom, "read_kmsg", read)
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("oom_kill 3\n")
    return OomWitness(counter=None, vmstat=vmstat), vmstat


def test_the_log_is_read_again_only_when_the_counter_moved(tmp_path, monkeypatch):
    log = Log()
    w, vmstat = witness(tmp_path, log, monkeypatch)
    assert log.reads == 1  # once at the start: what the log already names
    assert not w.killed(4242) and not w.killed(5)
    assert log.reads == 1  # the counter stood still: no OOM kill, nothing read
    log.records.append(KILLED_4242)
    vmstat.write_text("oom_kill 4\n")
    assert w.killed(4242) and log.reads == 2
    assert w.killed(4242) and not w.killed(5) and log.reads == 2  # the same answer stands


def test_a_kill_counted_but_not_yet_logged_keeps_the_log_read(tmp_path, monkeypatch):
    log = Log()
    w, vmstat = witness(tmp_path, log, monkeypatch)
    vmstat.write_text("oom_kill 5\n")  # two kills counted, one logged so far
    log.records.append(KILLED_4242)
    assert w.killed(4242) and log.reads == 2
    log.records.append(KILLED_777)  # its line comes after the counter moved
    assert w.killed(777) and log.reads == 3  # read again although the counter stood still
    assert not w.killed(5) and log.reads == 3  # now every counted kill is named
