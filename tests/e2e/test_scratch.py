"""Each incarnation's own TMPDIR (engined.supervisor.host.scratch), through the real daemon: engines
leave files there that only a clean exit removes (vLLM's FileStore, its servers' ipc:// sockets);
engined removes them when the incarnation is gone, the daemon's whole scratch root at shutdown,
the guard after a SIGKILLed daemon, and a new daemon the roots of daemons that are gone."""

from __future__ import annotations

import getpass
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from testkit.driver import PYTHON

# A command engine that reports its temporary directory and leaves a unix socket in it
_REPORT = """
import json, os, socket, sys, tempfile, time
tmp = tempfile.gettempdir()
s = socket.socket(socket.AF_UNIX)
s.bind(os.path.join(tmp, "left.sock"))
report = {"tmp": tmp, "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}
with open(os.path.join(sys.argv[1], f"{os.getpid()}.json"), "w") as f:
    json.dump(report, f)
time.sleep(600)
"""


def _reported(d, out: Path, pid: int) -> dict:
    path = out / f"{pid}.json"
    d.wait_for(lambda: path.exists() and path.read_text(), 20, f"{path} written")
    return json.loads(path.read_text())


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.smoke
def test_each_incarnation_has_its_own_tmpdir_removed_when_it_is_gone(engined, short_tmp):
    tmp, out, own = short_tmp / "t", short_tmp / "out", short_tmp / "own"
    for path in (tmp, out, own):
        path.mkdir()
    report = [PYTHON, "-c", _REPORT, str(out)]
    d = engined([{"name": "fork", "model": "builtin:echo", "env": {"ENGINED_ECHO_TEMPFILE": "1"}},
                 {"name": "exec", "model": "builtin:echo", "launcher": "exec",
                  "env": {"ENGINED_ECHO_TEMPFILE": "1"}},
                 {"name": "plain", "command": report, "probe": "off"},
                 {"name": "own", "command": report, "probe": "off", "env": {"TMPDIR": str(own)}}],
                env={"TMPDIR": str(tmp)})
    root = tmp / f"engined-scratch-{d.pid}"
    engines = d.engines()
    assert engines["fork-0"]["launcher"] == "forkserver", engines["fork-0"]
    # a forked child finds its own directory (not the fork server's), an exec'd one too
    for name in ("fork-0", "exec-0"):
        d.wait_for(lambda n=name: list((root / f"{n}.1").glob("echo_*")), 10,
                   f"{name}'s file in {root / f'{name}.1'}")
    plain = _reported(d, out, engines["plain-0"]["pid"])
    assert plain["tmp"] == str(root / "plain-0.1"), plain
    assert (root / "plain-0.1" / "left.sock").is_socket()
    # the compile cache stays where it is without a private TMPDIR: restarts keep it
    assert plain["inductor"] == str(tmp / f"torchinductor_{getpass.getuser()}"), plain
    # a spec that sets TMPDIR keeps it, and gets no directory of ours
    assert _reported(d, out, engines["own-0"]["pid"])["tmp"] == str(own)
    assert not (root / "own-0.1").exists()

    for name in ("fork-0", "exec-0", "plain-0"):
        os.kill(engines[name]["pid"], signal.SIGKILL)
    for name in ("fork-0", "exec-0", "plain-0"):
        d.wait_restarted(name, engines[name]["pid"], 30)
        # cleared before the replacement spawned
        assert not (root / f"{name}.1").exists(), sorted(root.rglob("*"))
    new = d.engine("plain-0")["pid"]
    assert _reported(d, out, new)["tmp"] == str(root / "plain-0.2")
    d.wait_for(lambda: list((root / "fork-0.2").glob("echo_*")), 10, "the new fork-0's file")
    assert "fork-0 incarnation 1 left 1 file(s) in its TMPDIR: removed" in d.stderr_text()

    assert d.stop() == 0
    assert not root.exists(), sorted(root.rglob("*"))
    assert (own / "left.sock").is_socket()  # not ours to remove
    # what stays is torch's inductor cache, shared by every incarnation of a command engine
    # (one may run torch) and outliving them, as torch's own default would; echo engines,
    # which never import torch, make none
    cache = f"torchinductor_{getpass.getuser()}"
    assert sorted(p.name for p in tmp.iterdir()) == [cache]
    assert not any((tmp / cache).iterdir())


@pytest.mark.parametrize("orphan_s", [0, 1])
def test_the_guard_removes_a_killed_daemons_root_and_a_new_daemon_sweeps_stale_ones(
        engined, short_tmp, orphan_s):
    tmp = short_tmp / "t"
    stale = tmp / f"engined-scratch-{_dead_pid()}" / "echo-0.3"
    live = tmp / f"engined-scratch-{os.getpid()}"  # a daemon that is alive: this test, say
    odd = tmp / "engined-scratch-x"
    for path in (stale, live, odd):
        path.mkdir(parents=True)
    (stale / "vllm_dist_0").write_text("")
    d = engined([{"name": "echo", "model": "builtin:echo", "env": {"ENGINED_ECHO_TEMPFILE": "1"}}],
                env={"TMPDIR": str(tmp)}, supervisor={"orphan_timeout": f"{orphan_s}s"})
    assert not stale.parent.exists()
    assert live.exists() and odd.exists()
    root = tmp / f"engined-scratch-{d.pid}"
    d.wait_for(lambda: list((root / "echo-0.1").glob("echo_*")), 10, "the engine's file")

    d.expect_unclean_exit = True
    d.signal(signal.SIGKILL)
    d.wait_exit()
    d.wait_for(lambda: not root.exists(), 10 + orphan_s, f"the guard to remove {root}")


def test_a_spawn_that_fails_leaves_no_directory(engined, short_tmp):
    tmp, python = short_tmp / "t", short_tmp / "py"
    tmp.mkdir()
    python.write_text(f'#!/bin/sh\nexec {PYTHON} "$@"\n')  # this venv's, by another path
    python.chmod(0o755)
    d = engined([{"name": "echo", "model": "builtin:echo", "python": str(python),
                  "launcher": "exec"}], env={"TMPDIR": str(tmp)})
    root = tmp / f"engined-scratch-{d.pid}"
    old = d.engine("echo-0")
    assert (root / "echo-0.1").is_dir()
    python.unlink()  # the interpreter is gone: the next spawns fail (ENOENT)
    os.kill(old["pid"], signal.SIGKILL)
    d.wait_for(lambda: (d.engine("echo-0")["last_exit"] or {}).get("reason") == "spawn_error",
               30, "a spawn_error")
    # the failed spawn's own directory goes at once; the dead incarnation's (echo-0.1) is
    # removed in the background from its replacement's spawn on (Reaper.tidy), so it may still
    # be going when the spawn_error is told: a loaded box (CI) met exactly that
    # (a later spawn's attempt makes and removes its own in between: the wait is the check)
    d.wait_for(lambda: not any(root.iterdir()), 30, f"nothing left in {root}")
