"""What an operator sees: the live view in a real terminal (tmux), the event stream, shell
completion through bash's `complete`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess

import pytest

from testkit.driver import (
    ORPHAN_GRACE_S,
    PYTHON,
    Daemon,
    build_spec,
    read_until,
    stream_lines,
    wait_engines_gone,
)

ECHO = {"name": "echo", "replicas": 2, "model": "builtin:echo", "backoff": {"initial": "0s"}}


@pytest.mark.smoke
def test_events_follow_streams_transitions_as_json_lines(engined):
    d = engined([ECHO])
    recent = d.ctl("events", "-n", "10")
    assert recent.returncode == 0, recent
    first = [json.loads(line) for line in recent.stdout.splitlines()]
    assert {(e["engine"], e["to"]) for e in first} >= {("echo-0", "READY"), ("echo-1", "READY")}
    follow = d.ctl_popen("events", "-f", "-n", "1", stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        lines = stream_lines(follow.stdout)
        read_until(lines, '"to": "READY"', 20)  # the head: following has begun
        victim = d.engine("echo-1")
        os.kill(victim["pid"], signal.SIGKILL)
        seen = read_until(lines, '"to": "READY"', 20)
        events = [json.loads(line) for line in seen]
        down = next(e for e in events if e["engine"] == "echo-1" and e["to"] == "BACKOFF")
        assert down["from"] == "READY" and down["reason"] == "signal", down
        assert down["exit"] == "killed by SIGKILL", down  # no OOM guess without evidence
        up = events[-1]
        assert up["engine"] == "echo-1" and up["incarnation"] == 2 and up["pid"] != victim["pid"]
        assert follow.poll() is None
    finally:
        follow.terminate()
        follow.wait(timeout=10)


def _pane(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                          text=True, timeout=10, check=True).stdout


@pytest.mark.skipif(shutil.which("tmux") is None and not os.environ.get("CI"),
                    reason="tmux is not installed (CI installs it)")
def test_status_watch_redraws_in_a_real_terminal(engined, short_tmp):
    d = engined([ECHO])
    session = f"engined-watch-{os.getpid()}"
    env_prefix = f"ENGINED_SOCKET={d.socket}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "20",
                    f"{env_prefix} {PYTHON} -m engined.supervisor.ctl.cli status --watch"],
                   check=True, timeout=10)
    try:
        pids = {n: e["pid"] for n, e in d.engines().items()}
        d.wait_for(lambda: str(pids["echo-1"]) in _pane(session), 20, "the table in the pane")
        assert "watching engined" in _pane(session)
        os.kill(pids["echo-1"], signal.SIGKILL)
        new = d.wait_restarted("echo-1", pids["echo-1"])
        def redrawn() -> str | None:
            pane = _pane(session)
            return pane if str(new["pid"]) in pane else None
        pane = d.wait_for(redrawn, 20, "the redraw with the new pid")
        row = next(line for line in pane.splitlines() if line.startswith("echo-1"))
        assert "READY" in row and "signal SIGKILL" in row, pane
        assert str(pids["echo-1"]) not in pane  # redrawn, not appended
        d.ctl("stop", "echo-0")
        d.wait_for(lambda: "STOPPED (by an operator)" in _pane(session), 20, "the stop shown")
        subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], check=True, timeout=10)
        d.wait_for(lambda: subprocess.run(["tmux", "has-session", "-t", session],
                                          capture_output=True).returncode != 0, 20,
                   "Ctrl-C ends the watch (and the session with it)")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True, timeout=10)


def test_bash_completion_completes_commands_and_engine_names(engined, short_tmp):
    d = engined([ECHO])
    script = subprocess.run([PYTHON, "-m", "engined.supervisor.ctl.cli", "completion", "bash"],
                            capture_output=True, text=True, timeout=30, check=True).stdout
    path = short_tmp / "enginectl.bash"
    path.write_text(script)

    def complete(line: str) -> list[str]:
        words = line.split(" ")
        probe = (f"source {path}\nCOMP_WORDS=({' '.join(repr(w) for w in words)})\n"
                 f"COMP_CWORD={len(words) - 1}\nCOMP_LINE={line!r}\nCOMP_POINT={len(line)}\n"
                 f"_enginectl\nprintf '%s\\n' \"${{COMPREPLY[@]}}\"\n")
        done = subprocess.run(["bash", "--norc", "-c", probe], capture_output=True, text=True,
                              timeout=30, env={
                                  **os.environ, "ENGINED_SOCKET": d.socket,
                                  "ENGINECTL": f"{PYTHON} -m engined.supervisor.ctl.cli"})
        assert done.returncode == 0, done
        return sorted(done.stdout.split())

    assert complete("enginectl st") == ["start", "status", "stop"]
    assert complete("enginectl restart ec") == ["echo", "echo-0", "echo-1"]
    assert "--follow" in complete("enginectl logs echo-0 --f")
    registered = subprocess.run(["bash", "--norc", "-c", f"source {path}; complete -p enginectl"],
                                capture_output=True, text=True, timeout=30)
    assert "-F _enginectl" in registered.stdout, registered
    assert subprocess.run([PYTHON, "-m", "engined.supervisor.ctl.cli", "completion", "zsh"],
                          capture_output=True, text=True, timeout=30).stdout.startswith(
        "#compdef enginectl")


def _pipes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return out


def test_children_inherit_no_stray_descriptor_and_a_clean_exit_leaves_no_socket_or_lock(
        short_tmp):
    r, w = os.pipe()  # what a careless parent leaves open (and inheritable) for the daemon
    stray = f"pipe:[{os.fstat(r).st_ino}]"
    spec = build_spec(short_tmp, [ECHO, {"name": "cmd", "command": ["/bin/sleep", "3600"]},
                                  {"name": "old", "model": "builtin:echo", "launcher": "exec"}],
                      None, None)
    d = Daemon(short_tmp, spec)
    try:
        d.start(pass_fds=(r, w))
        d.wait_all_ready()
        assert stray in _pipes(d.pid)  # the daemon has it: a child must not
        engines = d.engines()
        for name, e in engines.items():
            assert stray not in _pipes(e["pid"]), (name, _pipes(e["pid"]))
        for server in d.status()["supervisor"]["fork_servers"]:
            assert stray not in _pipes(server["pid"])
        runtime = short_tmp / "rt"
        assert (runtime / "control.sock").exists() and (runtime / "engined.lock").exists()
        assert d.stop() == 0
        left = sorted(p.name for p in runtime.iterdir() if p.name not in ("python", "logs"))
        assert left == [], left  # no control socket, no lock, no ipc socket left
        d.start()  # and the next daemon starts as if nothing had been there
        d.wait_all_ready()
    finally:
        os.close(r)
        os.close(w)
        if d.alive():
            d.stop()
        if d.proc is not None:
            assert wait_engines_gone(d.spawned_pids() | d.server_pids, d.pid, ORPHAN_GRACE_S) == []
