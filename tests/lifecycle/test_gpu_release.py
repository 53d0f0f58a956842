"""The wait for a dead incarnation's GPU memory before its replacement spawns on that GPU, with
a fake NVML and a jumping clock (no GPU needed; the real NVML path runs on GPU hosts)."""

from __future__ import annotations

import pytest

from engined.supervisor.host.gpus import GpuDevice, wait_gpu_released
from lifecycle.autojump import run


class FakeNvml:
    available = True

    def __init__(self, held_for_polls: int | None, pid: int = 123, gpu: int = 0) -> None:
        self.held_for_polls, self.pid, self.gpu, self.polls = held_for_polls, pid, gpu, 0

    def devices(self) -> tuple[GpuDevice, ...]:
        self.polls += 1
        held = self.held_for_polls is None or self.polls <= self.held_for_polls
        procs = {self.pid: 1 << 30} if held else {}
        return (GpuDevice(self.gpu, "GPU-x", sum(procs.values()), 80 << 30, procs),)


@pytest.mark.parametrize("nvml, gpus, waited", [
    (FakeNvml(held_for_polls=5), (0,), 0.5),  # freed after five polls, 100 ms apart
    (FakeNvml(held_for_polls=0), (0,), 0.0),  # already free: no wait at all
    (FakeNvml(held_for_polls=None), (0,), 10.0),  # never freed: bounded, then spawn anyway
    (FakeNvml(held_for_polls=None, gpu=3), (0,), 0.0),  # held on another GPU: not ours
])
def test_the_wait_is_bounded_and_only_for_our_gpus(nvml, gpus, waited, caplog):
    got = run(lambda: wait_gpu_released(nvml, "tiny-0", {123}, gpus))  # type: ignore[arg-type]
    assert got == pytest.approx(waited, abs=1e-6)
    if waited >= 10.0:
        assert "still held by [123] after 10s: spawning anyway" in caplog.text


def test_without_nvml_or_gpus_nothing_waits():
    class NoNvml:
        available = False

    assert run(lambda: wait_gpu_released(NoNvml(), "a-0", {1}, (0,))) is None  # type: ignore
    assert run(lambda: wait_gpu_released(FakeNvml(None), "a-0", {123}, ())) is None  # type: ignore
