"""Pure tables for supervisor.policy and supervisor.state: `now` is passed in, nothing sleeps."""

from __future__ import annotations

import signal

import pytest

from engined.supervisor.lifecycle.policy import (
    Action,
    ExitStatus,
    FailureHistory,
    Liveness,
    backoff_delay,
    check_liveness,
    decide,
    exit_reason,
)
from engined.supervisor.lifecycle.state import (
    EngineState,
    IllegalTransition,
    Reason,
    check_transition,
)
from engined.supervisor.spec import BackoffSpec, StartLimitSpec

BACKOFF = BackoffSpec(initial_s=1.0, max_s=30.0, factor=2.0, jitter=0.1, reset_after_s=60.0)
LIMIT = StartLimitSpec(burst=5, interval_s=120.0)
KILLED = ExitStatus(signal=signal.SIGKILL)


@pytest.mark.parametrize("status, killed_for, reason", [
    (ExitStatus(code=0), None, Reason.EXIT),
    (ExitStatus(code=1), None, Reason.EXIT),
    (ExitStatus(code=78), None, Reason.EXIT),
    (ExitStatus(code=143), None, Reason.SIGNAL),  # SIGTERM, after cleanup
    (ExitStatus(signal=signal.SIGKILL), None, Reason.SIGNAL),
    (ExitStatus(signal=signal.SIGSEGV), None, Reason.SIGNAL),
    (ExitStatus(signal=signal.SIGKILL), Reason.HANG, Reason.HANG),
    (ExitStatus(signal=signal.SIGKILL), Reason.STALL, Reason.STALL),
    (ExitStatus(code=0), Reason.STARTUP_TIMEOUT, Reason.STARTUP_TIMEOUT),
    (ExitStatus.UNKNOWN, None, Reason.EXIT),
])
def test_exit_reason(status, killed_for, reason):
    assert exit_reason(status, killed_for) is reason


@pytest.mark.parametrize("status, name, text", [
    (ExitStatus(code=143), "SIGTERM", "exit 143 (terminated by SIGTERM after cleanup)"),
    (ExitStatus(signal=9), "SIGKILL", "killed by SIGKILL"),
    (ExitStatus(signal=11), "SIGSEGV", "killed by SIGSEGV"),
    (ExitStatus(code=78), None, "exit 78 (invalid engine config or model)"),
    (ExitStatus(code=3), None, "exit 3"),
    (ExitStatus.UNKNOWN, None,
     "exit status unknown (not engined's child: adopted, or reaped elsewhere)"),
])
def test_exit_description(status, name, text):
    assert status.signal_name == name
    assert status.describe() == text


def test_a_sigkill_is_called_an_oom_kill_only_with_evidence():
    assert KILLED.describe() == "killed by SIGKILL"
    assert KILLED.describe(oom=True) == \
        "killed by SIGKILL by the kernel's OOM killer (out of memory)"


KMSG_OOM = [
    b"6,1234,5000000,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,"
    b"mems_allowed=0,oom_memcg=/x,task_memcg=/x,task=python3,pid=4242,uid=0\n",
    b"3,1235,5000001,-;Memory cgroup out of memory: Killed process 4242 (python3) "
    b"total-vm:1000kB, anon-rss:900kB, file-rss:0kB, shmem-rss:0kB, UID:0\n",
    b"3,1236,5000002,-;Out of memory: Killed process 777 (engine) total-vm:1kB\n",
    b"6,1237,5000003,-;usb 1-1: new device 4242\n",
]


def test_oom_evidence_from_the_kernel_log_names_the_pid(tmp_path):
    from engined.supervisor.host.oom import OomWitness, oom_pids_in

    assert oom_pids_in(KMSG_OOM) == {4242, 777}
    no_log = str(tmp_path / "no-kmsg")  # unreadable: the cgroup counter decides
    counter = tmp_path / "memory.events"
    counter.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    witness = OomWitness(kmsg=no_log, counter=counter)
    assert not witness.killed(5)  # the counter did not move: a plain kill -9
    counter.write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    assert witness.killed(5)  # it moved since the last look
    assert not witness.killed(5)  # and not again
    assert not OomWitness(kmsg=no_log, counter=None, vmstat=None).killed(5)  # no evidence
    # no kernel log, no memory cgroup: the host's OOM-kill counter (/proc/vmstat) decides
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("pgfault 10\noom_kill 7\nthp_fault_alloc 0\n")
    host = OomWitness(kmsg=no_log, counter=None, vmstat=vmstat)
    assert not host.killed(5)
    vmstat.write_text("pgfault 11\noom_kill 8\nthp_fault_alloc 0\n")
    assert host.killed(5) and not host.killed(5)
    # a memory cgroup's counter, when there is one, is the better witness: the host's is not read
    both = OomWitness(kmsg=no_log, counter=counter, vmstat=vmstat)
    vmstat.write_text("oom_kill 9\n")
    assert not both.killed(5)


def test_wait_status_decoding():
    import os
    assert ExitStatus.from_wait_status(0) == ExitStatus(code=0)
    assert ExitStatus.from_wait_status(78 << 8) == ExitStatus(code=78)
    assert ExitStatus.from_wait_status(signal.SIGKILL) == ExitStatus(signal=9)
    assert os.WIFSIGNALED(signal.SIGKILL)


@pytest.mark.parametrize("consecutive, jitter_unit, delay", [
    (0, 0.0, 0.0),
    (1, 0.0, 0.0),  # the first restart after a stable run is immediate
    (1, 1.0, 0.0),
    (2, 0.0, 1.0),
    (3, 0.0, 2.0),
    (4, 0.0, 4.0),
    (6, 0.0, 16.0),
    (7, 0.0, 30.0),  # capped
    (50, 0.0, 30.0),
    (10_000, 0.0, 30.0),  # no overflow
    (2, 1.0, 1.1),
    (2, -1.0, 0.9),
    (7, 1.0, 33.0),  # jitter applies after the cap
    (3, 5.0, 2.2),  # jitter unit clamped to [-1, 1]
])
def test_backoff_delay(consecutive, jitter_unit, delay):
    assert backoff_delay(consecutive, BACKOFF, jitter_unit) == pytest.approx(delay)


def test_backoff_factor_one_is_constant():
    flat = BackoffSpec(initial_s=2.0, max_s=30.0, factor=1.0, jitter=0.0, reset_after_s=60.0)
    assert [backoff_delay(k, flat, 0.0) for k in (1, 2, 3, 9)] == [0.0, 2.0, 2.0, 2.0]


def _decide(now, status, history=None, ready_since=None, restart="always",
            reason=None, limit=LIMIT):
    history = history if history is not None else FailureHistory()
    return decide(now, restart, status, reason or exit_reason(status), history, ready_since,
                  BACKOFF, limit, 0.0)


@pytest.mark.parametrize("restart, status, action", [
    ("always", ExitStatus(code=0), Action.RESTART),
    ("on-failure", ExitStatus(code=0), Action.STOP),
    ("never", ExitStatus(code=0), Action.STOP),
    ("always", KILLED, Action.RESTART),
    ("on-failure", KILLED, Action.RESTART),
    ("on-failure", ExitStatus(code=143), Action.RESTART),  # external SIGTERM is a failure
    ("never", KILLED, Action.FAIL),
    ("always", ExitStatus(code=78), Action.FAIL),  # invalid config: no restart loop
    ("on-failure", ExitStatus(code=78), Action.FAIL),
    # reaped elsewhere: nobody knows how it ended, so it is not a clean exit
    ("on-failure", ExitStatus.UNKNOWN, Action.RESTART),
    ("never", ExitStatus.UNKNOWN, Action.FAIL),
])
def test_restart_modes(restart, status, action):
    decision, _ = _decide(100.0, status, restart=restart)
    assert decision.action is action


def test_an_unasked_clean_exit_under_always_counts_as_a_failure():
    """vLLM's API server exits 0 after its engine core died: under restart=always that must
    back off and reach the start limit, not loop model loads at full speed."""
    history = FailureHistory()
    delays = []
    for now in (100.0, 101.0, 102.0, 103.0, 104.0):
        decision, history = _decide(now, ExitStatus(code=0), history)
        assert decision.action is Action.RESTART and "counted as a failure" in decision.why
        delays.append(decision.delay_s)
    assert delays[0] == 0.0 and delays[1] > 0.0 and history.consecutive == 5
    decision, _ = _decide(105.0, ExitStatus(code=0), history)
    assert decision.action is Action.FAIL and "start limit" in decision.why


def test_clean_exit_under_on_failure_does_not_count():
    decision, history = _decide(100.0, ExitStatus(code=0), restart="on-failure")
    assert (decision.action, history) == (Action.STOP, FailureHistory())


def test_hang_kill_with_code_zero_is_still_a_failure():
    decision, history = _decide(100.0, ExitStatus(code=0), reason=Reason.HANG)
    assert decision.action is Action.RESTART and history.consecutive == 1


def test_consecutive_failures_back_off_then_fail_at_start_limit():
    history, delays, now = FailureHistory(), [], 1000.0
    for _ in range(5):
        decision, history = _decide(now, KILLED, history)
        assert decision.action is Action.RESTART
        delays.append(decision.delay_s)
        now += decision.delay_s + 0.1
    assert delays == [0.0, 1.0, 2.0, 4.0, 8.0]
    decision, history = _decide(now, KILLED, history)
    assert decision.action is Action.FAIL and "start limit" in decision.why


def test_failures_outside_the_window_do_not_count():
    limit = StartLimitSpec(burst=2, interval_s=10.0)
    history = FailureHistory(consecutive=2, failure_times=(0.0, 1.0))
    decision, history = _decide(20.0, KILLED, history, limit=limit)
    assert decision.action is Action.RESTART
    assert history.failure_times == (20.0,)


def test_stable_ready_run_resets_the_streak():
    history = FailureHistory(consecutive=4, failure_times=(0.0, 1.0, 3.0, 7.0))
    decision, history = _decide(200.0, KILLED, history, ready_since=100.0)  # READY for 100 s
    assert decision.delay_s == 0.0 and history.consecutive == 1


def test_short_ready_run_keeps_the_streak():
    history = FailureHistory(consecutive=2, failure_times=(0.0, 1.0))
    decision, history = _decide(30.0, KILLED, history, ready_since=20.0)  # READY for 10 s < 60 s
    assert decision.delay_s == 2.0 and history.consecutive == 3


def _live(**overrides):
    base = dict(starting=False, spawned_at=0.0, startup_timeout_s=600.0, last_heartbeat_at=100.0,
                heartbeat_timeout_s=10.0, last_iteration_at=100.0, work_queued=False,
                stall_timeout_s=60.0)
    base.update(overrides)
    return Liveness(**base)


@pytest.mark.parametrize("now, live, reason, next_at", [
    (5.0, _live(starting=True), None, 600.0),
    (600.0, _live(starting=True), Reason.STARTUP_TIMEOUT, 600.0),
    (105.0, _live(), None, 110.0),
    (110.0, _live(), Reason.HANG, 110.0),
    # idle engine: an old loop stamp is fine when nothing is queued
    (150.0, _live(last_heartbeat_at=149.0, last_iteration_at=0.0), None, 159.0),
    # work queued and the loop stopped: stall, even though heartbeats flow
    (165.0, _live(last_heartbeat_at=164.5, last_iteration_at=100.0, work_queued=True),
     Reason.STALL, 160.0),
    (130.0, _live(last_heartbeat_at=129.0, last_iteration_at=100.0, work_queued=True),
     None, 139.0),
    (105.0, _live(last_heartbeat_at=104.0, last_iteration_at=100.0, work_queued=True,
                  stall_timeout_s=2.0), Reason.STALL, 102.0),
    # over its memory_limit: judged after MEMORY_GRACE_S (3 s) of saying so, not before
    (102.0, _live(last_heartbeat_at=101.5, over_limit_since=101.0), None, 104.0),
    (104.0, _live(last_heartbeat_at=103.8, over_limit_since=101.0), Reason.MEMORY, 104.0),
    # a hang still comes first
    (110.0, _live(over_limit_since=109.0), Reason.HANG, 110.0),
    # an idle engine's own loop wakes every 0.5 s: one that stopped is stalled after
    # max(stall_timeout, IDLE_LOOP_FLOOR_S), 15 s; not without the loop's own stamp
    (109.0, _live(last_heartbeat_at=108.5, last_iteration_at=95.0, stall_timeout_s=2.0,
                  idle_loop=True), None, 110.0),
    (110.5, _live(last_heartbeat_at=110.0, last_iteration_at=95.0, stall_timeout_s=2.0,
                  idle_loop=True), Reason.STALL, 110.0),
    (112.0, _live(last_heartbeat_at=111.5, last_iteration_at=40.0, stall_timeout_s=60.0,
                  idle_loop=True), Reason.STALL, 100.0),
    (112.0, _live(last_heartbeat_at=111.5, last_iteration_at=40.0, stall_timeout_s=60.0),
     None, 121.5),
])
def test_liveness(now, live, reason, next_at):
    assert check_liveness(now, live) == (reason, next_at)


S = EngineState


@pytest.mark.parametrize("old, new", [
    (S.STOPPED, S.STARTING), (S.STARTING, S.READY), (S.READY, S.STOPPING),
    (S.STOPPING, S.STOPPED), (S.READY, S.BACKOFF), (S.BACKOFF, S.STARTING),
    (S.STARTING, S.FAILED), (S.FAILED, S.STARTING), (S.READY, S.STARTING),
    # a start whose child could not be spawned at all (spawn_error)
    (S.STOPPED, S.BACKOFF), (S.STOPPED, S.FAILED), (S.FAILED, S.BACKOFF),
])
def test_legal_transitions(old, new):
    assert check_transition(old, new) is new


@pytest.mark.parametrize("old, new", [
    (S.STOPPED, S.READY), (S.BACKOFF, S.READY), (S.FAILED, S.READY), (S.BACKOFF, S.STOPPING),
    (S.STOPPING, S.READY), (S.STOPPED, S.STOPPING), (S.FAILED, S.STOPPING),
])
def test_illegal_transitions_name_both_states(old, new):
    with pytest.raises(IllegalTransition) as err:
        check_transition(old, new)
    assert old.value in str(err.value) and new.value in str(err.value)
