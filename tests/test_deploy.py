"""The deployment kit, checked offline (there is no cluster, no image registry and no Docker on these machines):
each Kubernetes overlay renders (`kubectl kustomize`) and is valid against the Kubernetes schemas, and agrees with
kvgate (its config loads, probes name the gateway's endpoints, pods get longer to stop than the gateway's drain,
the gateways find the engines' Service by DNS and share a Redis that exists); the monitoring component selects
what the kit labels; the compose file's pieces are valid for the real tools (haproxy -c, promtool) and its
gateway config loads."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import GatewayConfig
from gateway.config_load import load_config

ROOT = Path(__file__).resolve().parent.parent
KIT = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "deploy" / "compose"
OVERLAYS = ("cpu", "gpu")
pytestmark = pytest.mark.skipif(not KIT.is_dir(), reason="needs the source checkout's deploy/")
needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl")


def render(path: Path) -> list[dict[str, Any]]:
    rendered = subprocess.run(["kubectl", "kustomize", str(path)], check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(rendered) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    if shutil.which("kubectl") is None:
        pytest.skip("needs kubectl")
    return request.param, render(KIT / "overlays" / request.param)


def one(documents: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in documents if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def gateway_config(documents: list[dict[str, Any]], tmp_path: Path) -> GatewayConfig:
    config_map = next(d for d in documents if d["kind"] == "ConfigMap")
    (tmp_path / "kvgate.yaml").write_text(config_map["data"]["kvgate.yaml"])
    return load_config(str(tmp_path / "kvgate.yaml"), environ={"KVGATE__ADMIN__KEY": "k"})


def test_every_manifest_is_valid_kubernetes(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    _, documents = overlay
    kinds = sorted(d["kind"] for d in documents)
    assert kinds == ["ConfigMap", "Deployment", "Deployment", "HorizontalPodAutoscaler", "HorizontalPodAutoscaler",
                     "PodDisruptionBudget", "Secret", "Service", "Service", "Service", "StatefulSet"]  # fmt: skip
    for doc in documents:
        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_the_kit_agrees_with_the_gateway(overlay: tuple[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    name, documents = overlay
    config = gateway_config(documents, tmp_path)
    assert config.routing.policy == "cache-aware" and config.admin.key == "k"
    pod = one(documents, "Deployment", "kvgate")["spec"]["template"]["spec"]
    gateway = pod["containers"][0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    pause = float(gateway["lifecycle"]["preStop"]["exec"]["command"][1])  # new connections stop before SIGTERM
    assert pod["terminationGracePeriodSeconds"] > pause + config.server.shutdown_grace_s + 2  # + the ending
    assert {e["name"] for e in gateway["env"]} == {"KVGATE__ADMIN__KEY"}
    # the engines kvgate finds are the StatefulSet's pods, by its headless Service, with their KV events and replay
    statefulset = one(documents, "StatefulSet", "vllm")
    service = next(d for d in documents if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None")
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    (engine,) = config.engines
    assert engine.dns is not None
    assert engine.dns.name == statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert (engine.dns.port, engine.dns.kv_events_port, engine.dns.kv_events_replay_port) == (
        ports["http"], ports["kv-events"], ports["kv-replay"]
    )  # fmt: skip
    args = " ".join(statefulset["spec"]["template"]["spec"]["containers"][0]["args"])
    assert '"endpoint":"tcp://*:5557"' in args and '"replay_endpoint":"tcp://*:5558"' in args
    # the gateways share the kit's Redis
    assert config.admission.redis is not None
    redis_host = config.admission.redis.url.split("//", 1)[1].split(":", 1)[0]
    assert one(documents, "Service", redis_host)["spec"]["selector"] == {"app": "kvgate-redis"}
    if name == "cpu":  # the gateway's tokenizer is the one its init container builds, where it is mounted
        (model, tokenizer), = config.cache.tokenizers.items()  # fmt: skip
        assert f"--served-model-name={model}" in args and f"--model={tokenizer}" in args
        mounts = {m["mountPath"] for m in gateway["volumeMounts"]}
        assert any(tokenizer.startswith(m) for m in mounts)
        assert pod["initContainers"][0]["command"][-1] == tokenizer
    else:
        limits = statefulset["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits == {"nvidia.com/gpu": 1}


def test_the_autoscalers_scale_the_kits_own_workloads(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, documents = overlay
    targets = {("Deployment", "kvgate"), ("StatefulSet", "vllm")}
    hpas = [d for d in documents if d["kind"] == "HorizontalPodAutoscaler"]
    assert {(h["spec"]["scaleTargetRef"]["kind"], h["spec"]["scaleTargetRef"]["name"]) for h in hpas} == targets
    engines = next(h for h in hpas if h["spec"]["scaleTargetRef"]["kind"] == "StatefulSet")
    external = {m["external"]["metric"]["name"] for m in engines["spec"]["metrics"] if m["type"] == "External"}
    assert "kvgate_queue_depth" in external  # a gauge the gateways export (tests/test_observability.py)
    assert all(h["spec"]["minReplicas"] >= 2 for h in hpas)  # one still serves while another is disrupted


@needs_kubectl
def test_the_monitoring_component_scrapes_the_kits_gateways_and_engines(tmp_path: Path) -> None:
    """Rendered on top of an overlay (the Prometheus Operator's kinds are not in the Kubernetes schemas: their
    selectors and ports are checked against what the kit defines)."""
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",  # kustomize takes relative roots only
        "resources": [os.path.relpath(KIT / "overlays" / "gpu", tmp_path)],
        "components": [os.path.relpath(KIT / "components" / "monitoring", tmp_path)],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    documents = render(tmp_path)
    service_monitor = one(documents, "ServiceMonitor", "kvgate")
    service = one(documents, "Service", "kvgate")
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in service_monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    pod_monitor = one(documents, "PodMonitor", "vllm")
    pod = one(documents, "StatefulSet", "vllm")["spec"]["template"]
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    container_ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert {e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]} <= container_ports


def test_the_compose_file_is_consistent_and_its_pieces_are_valid(tmp_path: Path) -> None:
    compose = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    services = compose["services"]
    assert {"engine", "gateway", "haproxy", "redis", "prometheus", "grafana"} <= services.keys()
    assert services["gateway"]["deploy"]["replicas"] >= 2
    for service in services.values():  # every file mounted from the kit exists
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (COMPOSE / source).exists(), source
        build = service.get("build")
        if build:
            assert (COMPOSE / build["context"] / build["dockerfile"]).is_file()
    config = load_config(str(COMPOSE / "kvgate.yaml"), environ={})
    (engine,) = config.engines
    assert engine.dns is not None and engine.dns.name == "engine"
    engine_args = " ".join(services["engine"]["command"])
    assert f"--port={engine.dns.port}" in engine_args and f"--served-model-name={engine.model}" in engine_args
    assert config.admission.redis is not None and "//redis:" in config.admission.redis.url
    if shutil.which("haproxy"):
        subprocess.run(["haproxy", "-c", "-q", "-f", str(COMPOSE / "haproxy.cfg")], check=True)
    if shutil.which("promtool"):
        for name in ("prometheus.yml", "../observability/kvgate-alerts.yaml"):
            shutil.copy(COMPOSE / name, tmp_path)
        subprocess.run(
            ["promtool", "check", "config", str(tmp_path / "prometheus.yml")], check=True, capture_output=True
        )


def dockerfile(name: str) -> dict[str, Any]:
    """A Dockerfile's final stage: its EXPOSE ports, HEALTHCHECK command line, USER and ENTRYPOINT."""
    text = (ROOT / "deploy" / name).read_text().replace("\\\n", "")
    final = text[text.rindex("\nFROM ") :]
    instructions = [line.split(None, 1) for line in final.splitlines() if line and not line.startswith("#")]
    found: dict[str, Any] = {"EXPOSE": set()}
    for keyword, rest in instructions:
        if keyword == "EXPOSE":
            found["EXPOSE"] |= {int(p) for p in rest.split()}
        elif keyword in ("HEALTHCHECK", "USER", "ENTRYPOINT"):
            found[keyword] = rest
    return found


def test_the_images_take_every_package_pyproject_installs() -> None:
    """Both Dockerfiles copy, and the build context lets through, each of the packages (a package added to
    pyproject.toml alone made an image whose `kvgate` could not import itself)."""
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = {p.rstrip("*") for p in found["include"]}
    assert {"kvgate", "gateway", "cacheindex", "kvcommon"} <= packages
    for name in ("Dockerfile", "Dockerfile.engine-cpu"):
        copied = {
            line.split()[1] for line in (ROOT / "deploy" / name).read_text().splitlines() if line.startswith("COPY ")
        }
        assert packages <= copied, name
    unignored = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert packages <= unignored


@needs_kubectl
def test_the_compose_and_kubernetes_kits_run_the_images_scripts_images_sh_builds() -> None:
    """The three kits cannot drift apart: the images' names (scripts/images.sh tags them), ports, probes against the
    Dockerfiles' EXPOSE and HEALTHCHECK, and the engine's command line the same in compose and the cpu overlay (the
    container test runs compose's; tests/test_containers.py)."""
    compose = yaml.safe_load((COMPOSE / "compose.yaml").read_text())["services"]
    documents = render(KIT / "overlays" / "cpu")
    images_sh = (ROOT / "scripts" / "images.sh").read_text()
    gateway_image, engine_image = compose["gateway"]["image"], compose["engine"]["image"]
    assert f"build {gateway_image} deploy/Dockerfile\n" in images_sh
    assert f"build {engine_image} deploy/Dockerfile.engine-cpu\n" in images_sh
    assert compose["gateway"]["build"]["dockerfile"] == "deploy/Dockerfile"
    assert compose["engine"]["build"]["dockerfile"] == "deploy/Dockerfile.engine-cpu"
    gateway_file, engine_file = dockerfile("Dockerfile"), dockerfile("Dockerfile.engine-cpu")
    assert gateway_file["USER"] == engine_file["USER"] == "10001"

    pod = one(documents, "Deployment", "kvgate")["spec"]["template"]["spec"]
    gateway = pod["containers"][0]
    assert gateway["image"] == gateway_image and pod["initContainers"][0]["image"] == engine_image
    assert gateway["args"] == compose["gateway"]["command"]
    assert {p["containerPort"] for p in gateway["ports"]} == gateway_file["EXPOSE"]
    assert "/health" in gateway_file["HEALTHCHECK"] and gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    compose_config = load_config(str(COMPOSE / "kvgate.yaml"), environ={})
    assert compose_config.server.port in gateway_file["EXPOSE"]

    engine = one(documents, "StatefulSet", "vllm")["spec"]["template"]["spec"]
    container = engine["containers"][0]
    assert container["image"] == engine_image
    assert sorted(container["args"]) == sorted(compose["engine"]["command"])
    assert {p["containerPort"] for p in container["ports"]} == engine_file["EXPOSE"]
    for probe in ("readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    assert "/health" in engine_file["HEALTHCHECK"] and "/health" in " ".join(compose["engine"]["healthcheck"]["test"])
    # vLLM's shared-memory queues need more /dev/shm than a container gets by default, in both kits
    assert compose["engine"]["shm_size"] == "1g"
    shm = {m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"}
    assert [v["emptyDir"]["medium"] for v in engine["volumes"] if v["name"] in shm] == ["Memory"]
