"""The Kubernetes kit renders, is valid against the Kubernetes schemas (offline), and agrees with kvgate: the
gateway's config in it loads, its probes name the gateway's endpoints, and pods get longer to stop than the
gateway's own drain. Nothing here needs a cluster (there is none on these machines)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import load_config

ROOT = Path(__file__).resolve().parent.parent
KIT = ROOT / "deploy" / "k8s"
pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None or not KIT.is_dir(), reason="needs kubectl and the source checkout's deploy/"
)


@pytest.fixture(scope="module")
def documents() -> list[dict[str, Any]]:
    rendered = subprocess.run(["kubectl", "kustomize", str(KIT)], check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(rendered) if d]


def test_every_manifest_is_valid_kubernetes(documents: list[dict[str, Any]]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kinds = sorted(d["kind"] for d in documents)
    assert kinds == ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "HorizontalPodAutoscaler",
                     "PodDisruptionBudget", "Secret", "Service", "Service", "StatefulSet"]  # fmt: skip
    for doc in documents:
        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_the_kit_agrees_with_the_gateway(documents: list[dict[str, Any]], tmp_path: Path) -> None:
    config_map = next(d for d in documents if d["kind"] == "ConfigMap")
    (tmp_path / "kvgate.yaml").write_text(config_map["data"]["kvgate.yaml"])
    config = load_config(str(tmp_path / "kvgate.yaml"), environ={"KVGATE__ADMIN__KEY": "k"})
    assert config.routing.policy == "cache-aware" and config.admin.key == "k"
    pod = next(d for d in documents if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    gateway = pod["containers"][0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    assert pod["terminationGracePeriodSeconds"] > config.server.shutdown_grace_s
    assert {e["name"] for e in gateway["env"]} == {"KVGATE__ADMIN__KEY"}
    statefulset = next(d for d in documents if d["kind"] == "StatefulSet")
    service = next(d for d in documents if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None")
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    (engine,) = config.engines
    assert engine.dns is not None  # the engines kvgate finds are the StatefulSet's pods, by its headless Service
    assert engine.dns.name == statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert (engine.dns.port, engine.dns.kv_events_port) == (ports["http"], ports["kv-events"])


def test_the_autoscalers_scale_the_kits_own_workloads(documents: list[dict[str, Any]]) -> None:
    targets = {(d["kind"], d["metadata"]["name"]) for d in documents if d["kind"] in ("Deployment", "StatefulSet")}
    hpas = [d for d in documents if d["kind"] == "HorizontalPodAutoscaler"]
    assert {(h["spec"]["scaleTargetRef"]["kind"], h["spec"]["scaleTargetRef"]["name"]) for h in hpas} == targets
    engines = next(h for h in hpas if h["spec"]["scaleTargetRef"]["kind"] == "StatefulSet")
    external = {m["external"]["metric"]["name"] for m in engines["spec"]["metrics"] if m["type"] == "External"}
    assert "kvgate_queue_depth" in external  # a gauge the gateways export (tests/test_observability.py)
    assert all(h["spec"]["minReplicas"] >= 2 for h in hpas)  # one still serves while another is disrupted
