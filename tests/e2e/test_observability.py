"""End to end: /metrics, /health, /livez, /readyz, promtool and a real Prometheus server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.driver import free_port

REPO = Path(__file__).resolve().parents[2]


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is missing in CI: .ci/run must install Debian's prometheus")
        pytest.skip(f"{tool} not installed (apt-get install prometheus)")
    return path


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _samples(port: int) -> dict[tuple[str, tuple], float]:
    code, body = _get(port, "/metrics")
    assert code == 200
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


FLEET = [{"name": "echo", "replicas": 2, "model": "builtin:echo"},
         {"name": "slow", "model": "builtin:echo", "env": {"ENGINED_ECHO_LOAD_S": "2"}}]


@pytest.fixture
def http_fleet(engined):
    """Two echo replicas (one group) plus a slow-loading single engine, HTTP on a free port."""
    port = free_port()
    daemon = engined(engines=FLEET, supervisor={"http": f"127.0.0.1:{port}"})
    daemon.port = port
    return daemon


# The read-only tests share one daemon: the same fleet as http_fleet's.
SHARED = pytest.mark.xdist_group("observability-shared")


@pytest.fixture(scope="module")
def shared_fleet(module_engined):
    port = free_port()
    daemon = module_engined(engines=FLEET, supervisor={"http": f"127.0.0.1:{port}"})
    daemon.port = port
    return daemon


@pytest.mark.smoke
@SHARED
def test_every_design_metric_is_exposed_with_its_labels(shared_fleet):
    samples = _samples(shared_fleet.port)
    names = {name for name, _ in samples}
    for name in ("engined_build_info", "engined_engine_info", "engined_engine_state",
                 "engined_engine_up", "engined_engine_restarts_total",
                 "engined_engine_start_time_seconds", "engined_engine_startup_duration_seconds",
                 "engined_engine_heartbeat_timestamp_seconds",
                 "engined_engine_resident_memory_bytes", "engined_engine_cpu_seconds_total",
                 "engined_engine_requests_total", "engined_engine_requests_running",
                 "engined_engine_requests_waiting", "engined_event_loop_lag_seconds_bucket",
                 "engined_event_loop_lag_seconds_count",
                 "engined_event_loop_stalled_seconds_total"):
        assert name in names, name
    assert _value(samples, "engined_engine_restarts_total", engine="echo-0",
                  reason="spawn_error") == 0
    assert _value(samples, "engined_engine_up", engine="echo-0") == 1
    assert _value(samples, "engined_engine_state", engine="echo-0", state="READY") == 1
    assert _value(samples, "engined_engine_state", engine="echo-0", state="FAILED") == 0
    assert _value(samples, "engined_engine_info", engine="echo-1", group="echo",
                  model="builtin:echo") == 1
    assert _value(samples, "engined_engine_resident_memory_bytes", engine="echo-0") > 1_000_000
    # No NVML driver on CPU machines: device metrics are absent rather than zero or an error.
    gpu_driver = shutil.which("nvidia-smi") is not None
    assert gpu_driver or "engined_gpu_memory_total_bytes" not in names


@pytest.mark.smoke
@SHARED
def test_promtool_check_metrics_is_clean_on_a_live_scrape(shared_fleet):
    promtool = _need("promtool")
    assert shared_fleet.ctl("generate", "hello").returncode == 0  # request counters have samples
    _, body = _get(shared_fleet.port, "/metrics")
    check = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True,
                           timeout=30)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), (
        check.stdout + check.stderr).decode()


@pytest.mark.smoke
def test_promtool_rules_check_and_unit_tests():
    promtool = _need("promtool")
    rules = REPO / "etc/examples/engined-alerts.yml"
    check = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run([promtool, "test", "rules", "engined-alerts_test.yml"],
                          cwd=REPO / "tests/promtool", capture_output=True, text=True, timeout=60)
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr
    config = subprocess.run([promtool, "check", "config", "prometheus.yml"],
                            cwd=REPO / "etc/examples", capture_output=True, text=True, timeout=30)
    assert config.returncode == 0, config.stdout + config.stderr


@pytest.mark.smoke
def test_grafana_dashboard_covers_the_operator_views():
    dashboard = json.loads((REPO / "etc/examples/grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in ("engined_engine_state", "engined_engine_restarts_total",
                   "engined_engine_startup_duration_seconds",
                   "engined_engine_gpu_memory_allocated_bytes", "engined_gpu_memory_used_bytes",
                   "engined_event_loop_lag_seconds_bucket",
                   "engined_event_loop_stalled_seconds_total", 'reason="spawn_error"',
                   "engined_gateway_requests_total", "engined_gateway_migrations_total",
                   "engined_gateway_time_to_first_token_seconds_bucket",
                   "engined_gateway_request_duration_seconds_bucket"):
        assert metric in exprs, metric


def test_health_and_readyz_follow_restarts_failures_and_stops(http_fleet):
    port = http_fleet.port
    code, body = _get(port, "/health")
    assert code == 200 and json.loads(body)["status"] == "ok"
    assert _get(port, "/livez")[0] == 200
    assert _get(port, "/readyz")[0] == 200

    # `slow` takes 2 s to load: while it restarts, /health is 503 and /readyz too (its group has
    # no READY replica); both come back to 200 when it is READY again.
    old = http_fleet.engine("slow-0")["pid"]
    os.kill(old, signal.SIGKILL)
    http_fleet.wait_for(lambda: _get(port, "/health")[0] == 503, 10, "/health 503")
    body = json.loads(_get(port, "/health")[1])
    assert body["status"] == "degraded" and body["engines"]["slow-0"] != "READY"
    assert _get(port, "/readyz")[0] == 503
    http_fleet.wait_restarted("slow-0", old)
    assert _get(port, "/health")[0] == 200 and _get(port, "/readyz")[0] == 200

    # Stopped on purpose: not expected to run, so /health stays 200.
    assert http_fleet.ctl("stop", "slow").returncode == 0
    code, body = _get(port, "/health")
    assert code == 200, body
    assert json.loads(body)["engines"]["slow-0"] == "STOPPED"
    assert _get(port, "/readyz")[0] == 200

    # Everything stopped: nothing can serve, so readiness says so (health: nothing is expected)
    assert http_fleet.ctl("stop", "all").returncode == 0
    code, body = _get(port, "/readyz")
    assert code == 503 and json.loads(body)["status"] == "nothing to serve", body
    assert _get(port, "/health")[0] == 200


def test_readyz_stays_up_while_one_replica_of_a_group_restarts(engined):
    port = free_port()
    daemon = engined(engines=[{"name": "g", "replicas": 2, "model": "builtin:echo",
                               "env": {"ENGINED_ECHO_LOAD_S": "2"}}],
                     supervisor={"http": f"127.0.0.1:{port}"})
    old = daemon.engine("g-0")["pid"]
    os.kill(old, signal.SIGKILL)
    daemon.wait_state("g-0", "STARTING")
    assert _get(port, "/health")[0] == 503
    assert _get(port, "/readyz")[0] == 200  # g-1 is READY
    daemon.wait_restarted("g-0", old)
    assert _get(port, "/health")[0] == 200


def test_failed_engine_makes_health_503(engined):
    port = free_port()
    daemon = engined(engines=[
        {"name": "ok", "model": "builtin:echo"},
        {"name": "bad", "model": "builtin:echo", "env": {"ENGINED_ECHO_FAIL": "config"}},
    ], supervisor={"http": f"127.0.0.1:{port}"}, ready=False)
    daemon.wait_state("bad-0", "FAILED")
    daemon.wait_state("ok-0", "READY")
    code, body = _get(port, "/health")
    assert code == 503 and json.loads(body)["status"] == "degraded"
    assert _get(port, "/readyz")[0] == 503  # group `bad` has no READY replica
    samples = _samples(port)
    assert _value(samples, "engined_engine_state", engine="bad-0", state="FAILED") == 1
    assert _value(samples, "engined_engine_up", engine="bad-0") == 0


def test_metrics_stay_correct_across_restarts(http_fleet):
    port = http_fleet.port
    before = _samples(port)
    old = http_fleet.engine("echo-0")["pid"]
    os.kill(old, signal.SIGKILL)
    http_fleet.wait_restarted("echo-0", old)
    http_fleet.wait_for(
        lambda: _value(_samples(port), "engined_engine_heartbeat_timestamp_seconds",
                       engine="echo-0") > _value(before,
                                                 "engined_engine_heartbeat_timestamp_seconds",
                                                 engine="echo-0"), 10, "a newer heartbeat")
    after = _samples(port)
    for key, value in before.items():
        if key[0].endswith("_total"):
            assert after[key] >= value, f"counter went backwards: {key}: {value} -> {after[key]}"
    assert _value(after, "engined_engine_restarts_total", engine="echo-0", reason="signal") == \
        _value(before, "engined_engine_restarts_total", engine="echo-0", reason="signal") + 1
    assert _value(after, "engined_engine_start_time_seconds", engine="echo-0") > \
        _value(before, "engined_engine_start_time_seconds", engine="echo-0")
    assert _value(after, "engined_engine_up", engine="echo-0") == 1


def test_real_prometheus_sees_the_restart(http_fleet, tmp_path):
    prometheus = _need("prometheus")
    port, prom_port = http_fleet.port, free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: engined\n    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n")
    with open(tmp_path / "prometheus.log", "wb") as log:
        proc = subprocess.Popen([prometheus, f"--config.file={config}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        def query(expr: str) -> float | None:
            url = (f"http://127.0.0.1:{prom_port}/api/v1/query?"
                   + urllib.parse.urlencode({"query": expr}))
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    result = json.load(resp)["data"]["result"]
            except (OSError, ValueError, KeyError):
                return None
            return float(result[0]["value"][1]) if result else None

        restarts = 'engined_engine_restarts_total{engine="echo-0",reason="signal"}'
        up = 'engined_engine_up{engine="echo-0"}'
        http_fleet.wait_for(lambda: query(restarts) is not None, 60, "Prometheus's first scrape",
                            interval_s=0.5)
        baseline = query(restarts)
        old = http_fleet.engine("echo-0")["pid"]
        os.kill(old, signal.SIGKILL)
        http_fleet.wait_restarted("echo-0", old)
        http_fleet.wait_for(lambda: (query(restarts) or 0) > baseline, 30,
                            "Prometheus to see the restart", interval_s=0.5)
        assert query(restarts) == baseline + 1
        http_fleet.wait_for(lambda: query(up) == 1, 30, "engine up again in Prometheus",
                            interval_s=0.5)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def test_nvml_per_process_memory_matches_the_engine(engined):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA and an NVIDIA driver")
    port = free_port()
    daemon = engined(engines=[{"name": "gpu", "model": "builtin:tiny-llama", "gpus": [0],
                               "gpus_per_replica": 1}],
                     supervisor={"http": f"127.0.0.1:{port}"},
                     defaults={"startup_timeout": "120s"})
    engine = daemon.wait_state("gpu-0", "READY", timeout_s=120)
    samples = daemon.wait_for(
        lambda: (s := _samples(port)) and _value(
            s, "engined_engine_gpu_memory_used_bytes", engine="gpu-0", gpu="0") and s,
        30, "NVML per-process memory for gpu-0")
    used = _value(samples, "engined_engine_gpu_memory_used_bytes", engine="gpu-0", gpu="0")
    reserved = _value(samples, "engined_engine_gpu_memory_reserved_bytes", engine="gpu-0",
                      gpu="0")
    assert engine["pid"] and used > 0
    # torch's reserved pool lives inside what the driver reports for the process (plus context).
    assert reserved is not None and 0 < reserved <= used
    assert _value(samples, "engined_gpu_memory_total_bytes", gpu="0",
                  uuid=next(k[1][1][1] for k in samples
                            if k[0] == "engined_gpu_memory_total_bytes")) >= used
