"""A command engine's probes and progress checks (supervisor.probe.Prober) on a jumping
clock, against a scripted HTTP client: READY at the first pass, hung after `failures` in a row,
no blame for a pause of engined, and progress read as heartbeats."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from engined.engine import protocol as proto
from engined.supervisor.lifecycle.loopmonitor import LoopMonitor
from engined.supervisor.lifecycle.probe import ProbeFailed, Prober, metric_sum
from engined.supervisor.spec import parse_fleet
from lifecycle.autojump import VirtualClock, run

SPEC = """
version: 1
engines:
  - name: web
    command: [server]
    port: 8000
    probe: {interval: 1s, timeout: 500ms, failures: 3}
    progress: {busy: "x:running", counter: "x:tokens"}
"""


class ScriptedClient:
    """Answers probes from a script: True passes, a string fails with that reason; the metrics
    page comes from `metrics()`."""

    def __init__(self, script: list[bool | str], metrics: Callable[[], str] = lambda: "") -> None:
        self.script, self.metrics, self.calls = list(script), metrics, 0

    async def get(self, port: int, path: str, timeout_s: float, read_body: bool = False) -> str:
        if path == "/metrics":
            return self.metrics()
        self.calls += 1
        await asyncio.sleep(0.01)
        step = self.script.pop(0) if self.script else True
        if step is not True:
            raise ProbeFailed(str(step))
        return ""


def _watch(client: ScriptedClient, in_flight: Callable[[], int] = lambda: 0):
    (spec,) = parse_fleet(SPEC).engines
    loop = asyncio.get_running_loop()
    clock = VirtualClock(loop)
    monitor = LoopMonitor(clock, grace_s=1.0)
    got: list[proto.ChildMessage] = []
    verdicts: list[str] = []
    watch = Prober(spec, 1, 8000, client, clock, monitor, got.append, verdicts.append,
                         in_flight)  # type: ignore[arg-type]
    return watch, monitor, clock, got, verdicts


def test_ready_at_the_first_pass_failures_while_loading_do_not_count():
    async def main():
        watch, _, clock, got, verdicts = _watch(ScriptedClient(["refused"] * 5 + [True]))
        task = asyncio.ensure_future(watch.run())
        await asyncio.sleep(10)
        task.cancel()
        readies = [m for m in got if isinstance(m, proto.Ready)]
        assert len(readies) == 1 and abs(readies[0].load_s - 5.01) < 1e-6
        assert verdicts == []
        assert sum(isinstance(m, proto.Heartbeat) for m in got) >= 4  # each later pass
    run(main)


def test_hung_after_failures_in_a_row_and_a_pass_resets_the_count():
    async def main():
        script = [True, "a", "b", True, "c", "d", "timeout"]
        watch, _, _, _, verdicts = _watch(ScriptedClient(script))
        task = asyncio.ensure_future(watch.run())
        await asyncio.sleep(7.5)
        task.cancel()
        assert verdicts == ["3 probes failed in a row (last: timeout)"]
    run(main)


def test_a_failure_that_overlapped_a_pause_of_engined_is_not_counted():
    async def main():
        watch, monitor, clock, _, verdicts = _watch(ScriptedClient([True, "a", "b", "c", "d"]))
        task = asyncio.ensure_future(watch.run())
        await asyncio.sleep(2.5)  # passes at 0, fails at 1 and 2
        now = clock.monotonic()
        monitor.note(now - 0.6, now + 1.0)  # engined "did not run" across the next probe
        await asyncio.sleep(3)
        task.cancel()
        assert verdicts == []  # the paused probe and the grace after it are not blamed
    run(main)


def test_progress_heartbeats_busy_from_the_gauge_or_the_gateway_and_the_counter():
    async def main():
        page = {"running": 0.0, "tokens": 0.0}
        flight = [0]

        def metrics() -> str:
            return (f'x:running{{model="m"}} {page["running"]}\n'
                    f'x:tokens_total{{model="m"}} {page["tokens"]}\n')

        watch, _, clock, got, _ = _watch(ScriptedClient([], metrics), lambda: flight[0])
        task = asyncio.ensure_future(watch.run())
        await asyncio.sleep(1.5)  # READY at 0, idle heartbeat at 1
        flight[0] = 1  # a gateway request arrives; the server's gauge does not show it
        began = clock.monotonic()
        await asyncio.sleep(2)
        beats = [m for m in got if isinstance(m, proto.Heartbeat)]
        assert beats[-1].running == 1 and began < beats[-1].last_iteration_at < began + 1
        stuck_at = beats[-1].last_iteration_at
        await asyncio.sleep(3)  # no token: the progress stamp stays (the stall check's input)
        assert [m for m in got if isinstance(m, proto.Heartbeat)][-1].last_iteration_at == \
            stuck_at
        page["tokens"] = 42.0
        await asyncio.sleep(1)
        last = [m for m in got if isinstance(m, proto.Heartbeat)][-1]
        assert last.last_iteration_at > stuck_at and last.tokens == 42
        task.cancel()
    run(main)


def test_progress_heartbeats_carry_a_vllm_servers_queue_and_kv_cache_usage():
    """What the gateway's model-server metrics say of a command engine (serverstats): its own
    vllm:num_requests_waiting and vllm:kv_cache_usage_perc, where it says them. Requests only
    waiting are work too: the stall clock starts when they appear, not at the last token of
    long ago."""
    async def main():
        page = {"running": "0", "waiting": "0",
                "usage": 'vllm:kv_cache_usage_perc{engine="0"} 0.25\n'}

        def metrics() -> str:
            return (f'x:running{{model="m"}} {page["running"]}\nx:tokens_total{{model="m"}} 1\n'
                    f'vllm:num_requests_waiting{{engine="0"}} {page["waiting"]}\n'
                    + page["usage"])

        watch, _, clock, got, _ = _watch(ScriptedClient([], metrics), lambda: 0)
        task = asyncio.ensure_future(watch.run())
        await asyncio.sleep(3.5)  # idle: the counter last moved at the first read
        began = clock.monotonic()
        page["waiting"] = "3"
        await asyncio.sleep(1.5)
        last = [m for m in got if isinstance(m, proto.Heartbeat)][-1]
        assert (last.running, last.waiting, last.kv_cache_usage) == (0, 3, 0.25)
        assert last.last_iteration_at >= began  # not the idle time before: no false stall
        page.update(running="2", waiting="0", usage="")  # without the gauge: unknown, not 0
        await asyncio.sleep(1)
        last = [m for m in got if isinstance(m, proto.Heartbeat)][-1]
        assert (last.running, last.waiting, last.kv_cache_usage) == (2, 0, None)
        task.cancel()
    run(main)


def test_metric_sum_reads_every_label_set_and_the_total_suffix():
    text = ('# HELP vllm:generation_tokens Generated.\n# TYPE vllm:generation_tokens counter\n'
            'vllm:generation_tokens_total{engine="0",model_name="m"} 10.0\n'
            'vllm:generation_tokens_total{engine="1",model_name="m"} 5\n'
            'vllm:generation_tokens_created{engine="0"} 1.7e9\n'
            'vllm:num_requests_running{engine="0"} 2\n'
            'other 1e400\n')
    assert metric_sum(text, "vllm:generation_tokens") == 15.0
    assert metric_sum(text, "vllm:generation_tokens_total") == 15.0
    assert metric_sum(text, "vllm:num_requests_running") == 2.0
    assert metric_sum(text, "vllm:num_requests_waiting") is None
    assert metric_sum(text, "other") is None  # not finite: not a reading


def test_a_stopped_prober_ends_even_if_its_cancel_is_lost():
    """Its incarnation is gone: the prober stops at its next round whether or not the task's
    cancellation got through (Python 3.11's wait_for can swallow one), and says nothing more."""
    async def main():
        watch, _, _, got, verdicts = _watch(ScriptedClient([True] + ["refused"] * 20))
        task = asyncio.ensure_future(watch.run())
        await asyncio.sleep(1.5)  # READY at the first pass; the next probe is failing
        seen = len(got)
        watch.stop()  # no cancel at all: the worst case of a lost one
        await asyncio.sleep(10)
        assert task.done() and verdicts == [] and len(got) == seen
    run(main)
