"""End to end: the daemon itself: shutdown, being killed, the runtime-directory lock, bad specs."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import yaml

from testkit.driver import (
    REPO_ROOT,
    _clean_env,
    process_gone,
    read_until,
    stream_lines,
    wait_engines_gone,
)

ECHO2 = {"name": "echo", "replicas": 2, "model": "builtin:echo"}


def _run_daemon(*args: str, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engined.supervisor.daemon", *args], cwd=REPO_ROOT,
                          env=_clean_env(), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout_s)


@pytest.mark.smoke
def test_sigterm_stops_every_engine_with_cleanup(engined):
    d = engined([ECHO2])
    engines = d.engines()
    # A client streaming a log must not hold the shutdown up; it sees the end of the stream.
    follower = d.ctl_popen("logs", "echo-0", "-f", stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    try:
        read_until(stream_lines(follower.stdout), "[ready] echo-0", 20)  # it is following
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0, d.stderr_text()
        follower.wait(timeout=20)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == 0, follower.stderr.read()
    for name, e in engines.items():
        assert process_gone(e["pid"]), name
        log = d.log_text(name)
        assert f"[cleanup] {name} incarnation {e['incarnation']} reason=signal SIGTERM" in log, log
    assert "[shutdown] done" in d.stderr_text()


def test_second_sigterm_kills_a_slow_stop_at_once(engined):
    d = engined([{"name": "echo", "replicas": 1, "model": "builtin:echo"}],
                defaults={"stop_timeout": "60s", "stall_timeout": "120s"})
    pid = d.engine("echo-0")["pid"]
    gen = d.ctl_popen("generate", "--engine", "echo-0", "!stall", stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE)
    try:
        d.wait_for(lambda: (d.engine("echo-0").get("queue") or {}).get("running") == 1, 20,
                   "the !stall request to be running")
        d.signal(signal.SIGTERM)
        d.wait_for(lambda: "[shutdown] stopping" in d.stderr_text(), 20, "shutdown to begin")
        # The stalled engine ignores SIGTERM's flag: a graceful stop would take stop_timeout.
        d.holds(lambda: d.alive() and not process_gone(pid), 1.0, "the slow stop")
        d.signal(signal.SIGTERM)
        assert d.wait_exit(timeout_s=30) == 0, d.stderr_text()
        assert process_gone(pid)
        # The second signal's kill ended it, not stop_timeout's: in that order, and no
        # escalation (that it kills at that very moment is pinned by
        # tests/lifecycle/test_timing_pins.py
        # test_a_second_shutdown_signal_kills_what_is_left_at_that_moment).
        log = [msg for _, _, msg in d.daemon_log()]
        second = next((i for i, m in enumerate(log) if m.startswith("[shutdown] second signal")),
                      None)
        assert second is not None, log[-20:]
        assert any(m.startswith(f"[stop] echo-0 pid {pid} stopped (killed by SIGKILL")
                   for m in log[second:]), log[-20:]
        assert not any("did not exit in time" in m for m in log), log[-20:]
        gen.communicate(timeout=20)
        assert gen.returncode != 0  # the request failed rather than hung
    finally:
        if gen.poll() is None:
            gen.kill()
            gen.wait()


@pytest.mark.smoke
def test_sigkill_of_the_daemon_leaves_no_engine_behind(engined):
    """With `orphan_timeout: 0` engines die with engined (tests/e2e/test_recovery.py: adopted
    by the next one otherwise)."""
    d = engined([ECHO2], supervisor={"orphan_timeout": "0s"})
    pids = {e["pid"] for e in d.engines().values()}
    d.expect_unclean_exit = True
    d.signal(signal.SIGKILL)
    assert d.wait_exit(timeout_s=10) == -signal.SIGKILL
    assert wait_engines_gone(pids, d.pid, 5.0) == []  # PR_SET_PDEATHSIG, no orphans
    # The lock died with it, and the stale sockets do not stop a new daemon on the same directory.
    d.expect_unclean_exit = False
    d.start()
    fresh = d.wait_all_ready()
    assert not {e["pid"] for e in fresh.values()} & pids
    assert d.ctl("generate", "back").stdout.strip() == "back"


def test_second_daemon_on_the_same_runtime_dir_exits_1(engined):
    d = engined([{"name": "echo", "replicas": 1, "model": "builtin:echo"}])
    before = d.engines()
    second = _run_daemon("-c", str(d.spec_path))
    assert second.returncode == 1, second
    assert f"pid {d.pid}" in second.stderr, second.stderr
    assert str(d.runtime_dir) in second.stderr
    after = d.engines()
    assert {n: e["pid"] for n, e in after.items()} == {n: e["pid"] for n, e in before.items()}
    assert d.ctl("generate", "--engine", "echo-0", "mine").stdout.strip() == "mine"


@pytest.mark.smoke
def test_invalid_spec_exits_78_naming_the_key(short_tmp):
    spec = {"version": 1, "supervisor": {"http": "off", "runtime_dir": str(short_tmp / "rt")},
            "engines": [{"name": "echo", "replicas": 0, "model": "builtin:echo"}]}
    path = short_tmp / "bad.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    for args in (["--check"], []):
        out = _run_daemon("-c", str(path), *args)
        assert out.returncode == 78, out
        assert "engines[0].replicas" in out.stderr, out.stderr
        assert str(path) in out.stderr
    assert not (short_tmp / "rt" / "control.sock").exists()

    good = dict(spec, engines=[{"name": "echo", "replicas": 1, "model": "builtin:echo"}])
    path.write_text(yaml.safe_dump(good, sort_keys=False))
    out = _run_daemon("-c", str(path), "--check")
    assert out.returncode == 0, out
    assert "echo-0" in out.stdout
