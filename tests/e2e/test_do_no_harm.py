"""Do no harm: the daemon's own trouble (a freeze, a file-descriptor shortage, a child it cannot
start, an engine that leaves processes behind, a slow load) never takes healthy engines down."""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import stat
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from testkit.driver import ORPHAN_GRACE_S, free_port

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT_S = 1.5  # the fixture's
ECHO = {"name": "echo", "replicas": 1, "model": "builtin:echo"}


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, [line for line in text.splitlines() if name.split("_")[1] in line]
    return float(match.group(1))


def _gone(pid: int) -> bool:
    """Gone for good: not even a zombie (an adopted orphan is reaped by engined)."""
    try:
        psutil.Process(pid)
    except psutil.NoSuchProcess:
        return True
    return False


# --- the daemon's own freeze ------------------------------------------------------------------

def test_a_frozen_daemon_blames_no_engine_and_still_catches_a_frozen_one(engined):
    port = free_port()
    d = engined([{**ECHO, "replicas": 4}], supervisor={"http": f"127.0.0.1:{port}"})
    before = {n: (e["pid"], e["incarnation"]) for n, e in d.engines().items()}
    d.signal(signal.SIGSTOP)  # a VM pause, a swap storm, a debugger
    time.sleep(2 * HEARTBEAT_TIMEOUT_S)  # the freeze itself: an interval, not a wait
    d.signal(signal.SIGCONT)
    d.wait_for(lambda: "[loop] engined did not run for" in d.stderr_text(), 10,
               "the pause logged")
    d.holds(lambda: {n: (e["pid"], e["incarnation"]) for n, e in d.engines().items()} == before,
            2 * HEARTBEAT_TIMEOUT_S, "every engine untouched")
    assert all(e["restarts"] == 0 for e in d.engines().values())
    assert _metric(port, "engined_event_loop_stalled_seconds_total") >= HEARTBEAT_TIMEOUT_S
    assert _metric(port, "engined_event_loop_lag_seconds_count") > 0
    # an engine that really froze is still caught, as a hang (one heartbeat timeout after its
    # last heartbeat, also after a pause: pinned by tests/lifecycle/test_replica.py
    # test_a_pause_of_the_daemon_itself_is_never_blamed_on_engines)
    victim = before["echo-2"][0]
    os.kill(victim, signal.SIGSTOP)
    new = d.wait_restarted("echo-2", victim, timeout_s=30)
    assert new["last_exit"]["reason"] == "hang", new["last_exit"]
    others = {n: (e["pid"], e["incarnation"]) for n, e in d.engines().items() if n != "echo-2"}
    assert others == {n: v for n, v in before.items() if n != "echo-2"}


# --- resources --------------------------------------------------------------------------------

def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_file_descriptor_shortage_defers_the_spawn_and_never_ends_the_daemon(engined):
    d = engined([{**ECHO, "replicas": 2}], defaults={"backoff": {"initial": "0.2s",
                                                                  "max": "1s"}})
    before = d.engines()
    soft, hard = resource.prlimit(d.pid, resource.RLIMIT_NOFILE)
    assert soft == hard, (soft, hard)  # engined raised its soft limit to the hard one at start
    victim = before["echo-0"]["pid"]
    squeezed = _open_fds(d.pid) - 2  # below what it uses now
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (squeezed, hard))
    try:
        os.kill(victim, signal.SIGKILL)
        d.wait_for(lambda: "[spawn_error] echo-0" in d.stderr_text(), 30,
                   "the held-back spawn logged")
        time.sleep(1.0)  # a few retries under the shortage: an interval, not a wait
        assert d.alive()
    finally:
        resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (hard, hard))
    new = d.wait_restarted("echo-0", victim, timeout_s=30)
    assert new["restarts_by_reason"].get("spawn_error", 0) >= 1, new
    assert new["restarts_by_reason"].get("signal") == 1, new
    assert new["state"] == "READY" and d.engine("echo-1")["pid"] == before["echo-1"]["pid"]
    assert "shortage" in d.stderr_text()
    assert d.ctl("generate", "--engine", "echo-0", "back").stdout.strip() == "back"


def test_children_get_the_soft_limit_engined_started_with(engined):
    d = engined([ECHO])
    child_soft, _ = resource.prlimit(d.engine("echo-0")["pid"], resource.RLIMIT_NOFILE)
    assert child_soft == resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _wrapper(path: Path) -> Path:
    """An interpreter engined can be pointed at (`python:`) and that can then disappear."""
    path.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")  # the venv's own
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_an_engine_that_cannot_be_started_backs_off_then_fails_alone(engined, short_tmp):
    python = _wrapper(short_tmp / "python")
    # exec: a fork server that preloaded the interpreter would still fork it (that it keeps a
    # fleet running is the point of it); this is the spawn-error path
    d = engined([{**ECHO, "name": "gone", "python": str(python), "launcher": "exec",
                  "backoff": {"initial": "0.2s", "max": "1s", "jitter": 0},
                  "start_limit": {"burst": 3, "interval": "60s"}}, ECHO])
    steady = d.engine("echo-0")
    victim = d.engine("gone-0")["pid"]
    python.unlink()  # the venv was removed under a running fleet
    os.kill(victim, signal.SIGKILL)
    failed = d.wait_state("gone-0", "FAILED", timeout_s=60)
    assert failed["last_exit"]["reason"] == "spawn_error", failed["last_exit"]
    assert "No such file or directory" in failed["last_exit"]["description"], failed
    assert "start limit" in failed["fail_reason"] and "cannot start" in failed["fail_reason"]
    assert failed["restarts_by_reason"].get("spawn_error", 0) >= 2, failed
    assert re.search(r"\[spawn_error\] gone-0: restarting in \d", d.stderr_text())
    again = d.engine("echo-0")
    assert (again["pid"], again["restarts"]) == (steady["pid"], 0)
    # put it back, start it: it serves again
    _wrapper(python)
    assert d.ctl("start", "gone-0", "--timeout", "60").returncode == 0


def test_a_missing_interpreter_is_a_spec_error(tmp_path):
    from engined.supervisor.spec import SpecError, load_fleet

    spec = tmp_path / "fleet.yaml"
    spec.write_text("version: 1\nengines:\n  - {name: a, model: 'builtin:echo', "
                    "python: venvs/nope/bin/python}\n")
    try:
        load_fleet(spec)
    except SpecError as exc:
        text = str(exc)
    else:
        raise AssertionError("a missing interpreter passed")
    assert "engines[0].python" in text and str(tmp_path / "venvs/nope/bin/python") in text
    assert "does not exist" in text


# --- descendants ------------------------------------------------------------------------------

def _descendants(d, name: str, incarnation: int) -> list[int]:
    """The pids the echo engine's incarnation said it started (ENGINED_ECHO_SPAWN)."""
    def found() -> list[int] | None:
        text = d.log_text(name)
        spawned = re.search(rf"spawned pid \d+ incarnation {incarnation}\b", text)
        listed = spawned and re.search(r"\[echo\] started descendants: (.*)",
                                       text[spawned.end():])
        return [int(p) for p in re.findall(r"(\d+) \(", listed.group(1))] if listed else None
    return d.wait_for(found, 30, f"{name}'s descendants listed")


LEAKY = {**ECHO, "name": "leaky", "env": {"ENGINED_ECHO_SPAWN": "child,setsid"}}


def test_an_engines_descendants_die_with_it_before_its_replacement(engined):
    d = engined([LEAKY, ECHO])
    old = d.engine("leaky-0")
    kids = _descendants(d, "leaky-0", 1)
    assert len(kids) == 2 and all(psutil.Process(p).is_running() for p in kids)
    assert os.getsid(kids[1]) == kids[1] != os.getsid(old["pid"])  # left the engine's session
    os.kill(old["pid"], signal.SIGKILL)
    d.wait_restarted("leaky-0", old["pid"])
    d.wait_for(lambda: all(_gone(p) for p in kids), ORPHAN_GRACE_S, "the descendants reaped")
    log = d.stderr_text()  # the leftovers were killed before the replacement was spawned
    leftover = log.index("[leftover] leaky-0 incarnation 1")
    assert leftover < re.search(r"\[spawn\] leaky-0 pid \d+ incarnation 2", log).start(), log
    assert d.engine("echo-0")["restarts"] == 0


@pytest.mark.parametrize("orphan_s", [0, 1])
def test_an_engines_descendants_die_after_a_daemon_sigkill(engined, orphan_s):
    """At once (orphan_timeout 0), or once orphan_timeout has passed with no engined back."""
    d = engined([LEAKY], supervisor={"orphan_timeout": f"{orphan_s}s"})
    engine = d.engine("leaky-0")["pid"]
    kids = _descendants(d, "leaky-0", 1)
    guard = [p.pid for p in psutil.Process(d.pid).children()
             if "engined.supervisor.host.guard" in " ".join(p.cmdline())]
    assert len(guard) == 1, psutil.Process(d.pid).children()
    d.expect_unclean_exit = True
    d.signal(signal.SIGKILL)
    d.wait_exit()
    for pid in (engine, *kids, guard[0]):
        d.wait_for(lambda pid=pid: not _running(pid), 5.0 + orphan_s,
                   f"pid {pid} gone after the daemon")


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --- the engine's own stack and model ---------------------------------------------------------

def test_a_missing_model_stack_is_exit_78_with_a_hint(engined, engine_only_python, tiny_cache):
    d = engined([{"name": "tiny", "model": "builtin:tiny-llama", "python":
                  str(engine_only_python), "env": {"ENGINED_CACHE_DIR": str(tiny_cache)}}],
                ready=False)
    failed = d.wait_state("tiny-0", "FAILED", timeout_s=120)
    assert (failed["incarnation"], failed["last_exit"]["code"]) == (1, 78), failed
    assert "pip install 'engined[engine]'" in failed["fail_reason"], failed["fail_reason"]
    assert "'torch'" in failed["fail_reason"], failed["fail_reason"]
    assert "engined[engine]" in d.stderr_text()  # the daemon's own log says why
    d.holds(lambda: d.engine("tiny-0")["incarnation"] == 1, 1.0, "no restart")


def test_a_checkpoint_without_tokenizer_files_is_exit_78_naming_them(engined, tiny_checkpoint,
                                                                     short_tmp):
    broken = short_tmp / "no-tokenizer"
    shutil.copytree(tiny_checkpoint, broken)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (broken / name).unlink(missing_ok=True)
    d = engined([{"name": "tiny", "model": {"path": str(broken)}}], ready=False)
    failed = d.wait_state("tiny-0", "FAILED", timeout_s=120)
    assert (failed["incarnation"], failed["last_exit"]["code"]) == (1, 78), failed
    assert "has no tokenizer files" in failed["fail_reason"], failed["fail_reason"]
    assert "tokenizer.json" in failed["fail_reason"]
    assert re.search(r"\[exit\] tiny-0 pid \d+ exit 78: .*has no tokenizer files", d.stderr_text())


# --- busy machine, slow load ------------------------------------------------------------------

def test_the_first_request_after_a_load_longer_than_stall_timeout_is_no_stall(engined):
    slow = {**ECHO, "name": "slow", "stall_timeout": "1s",
            "env": {"ENGINED_ECHO_LOAD_S": "3", "ENGINED_ECHO_TOKEN_MS": "150"}}
    d = engined([slow], ready=False)
    d.wait_state("slow-0", "READY", timeout_s=60)
    out = d.ctl("generate", "--engine", "slow-0", "--max-tokens", "5", "hello")
    assert (out.returncode, out.stdout.strip()) == (0, "hello"), out
    engine = d.engine("slow-0")
    assert (engine["restarts"], engine["incarnation"]) == (0, 1), engine
    assert "[stall]" not in d.stderr_text()
