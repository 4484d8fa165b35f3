"""deploy/compose/compose.yaml itself, run with podman-compose (marker `containers`, beside tests/test_containers.py).

The fleet as compose.yaml defines it (two engines, two gateways sharing a Redis, haproxy in front, Prometheus with
kvgate's alert rules), started by `podman-compose -f compose.yaml -f <loopback override> up -d`. The override is
what these machines need and nothing more: every container on the host network with loopback ports of its own
(never a container-bridge address), so the second engine and gateway are compose.yaml's first again on other ports and
the gateways list the engines by URL instead of by the compose network's DNS; haproxy, Redis and Prometheus from
Debian's packages (deploy/podman/Dockerfile.compose-tools) because no image registry is reachable. Grafana has no
Debian package and is not started (tests/test_dashboard_live.py runs its dashboard's queries instead).

Checked: every service's own health check passes (`podman healthcheck run`: podman here has no systemd to run
them), the README's curl answers through haproxy, Prometheus shows both gateways and both engines up with the alert
rules loaded, a gateway container killed under load loses no request, and `stop` stops everything within the grace
period (exit status 0, not podman's SIGKILL).
"""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from openai import AsyncOpenAI

from tests.test_admission_redis import free_port
from tests.test_containers import (  # noqa: F401 (fixtures)
    GRACE_S,
    HAPROXY,
    MODEL,
    ROOT,
    engine_command,
    engine_ports,
    gateway_yaml,
    http,
    images,
    load_while_killing,
    podman,
    podman_env,
    status_of,
    wait_status,
)

COMPOSE = ROOT / "deploy" / "compose"
TOOLS = "localhost/kvgate-compose-tools:bookworm"
SERVICES = ["engine", "engine-2", "redis", "gateway", "gateway-2", "haproxy", "prometheus"]

pytestmark = [
    pytest.mark.containers,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        importlib.util.find_spec("podman_compose") is None,
        reason="needs podman-compose 1.1 or later (the dev extra; Debian bookworm's 1.0.3 cannot use host networking)",
    ),
]


class Tagged(list[Any]):
    """A YAML sequence written with a tag: podman-compose's `!override` replaces a list of compose.yaml's where a
    plain one would be appended to it."""

    def __init__(self, tag: str, items: list[Any]) -> None:
        super().__init__(items)
        self.tag = tag


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(Tagged, lambda dumper, value: dumper.represent_sequence(value.tag, list(value)))


@pytest.fixture(scope="module")
def tools_image(images: dict[str, str]) -> str:  # noqa: F811
    """haproxy, Redis and Prometheus from Debian (built on scripts/images.sh's base; layers cached by podman)."""
    base = "localhost/kvgate-base:bookworm"
    if subprocess.run(["podman", "image", "exists", base], env=podman_env(), check=False).returncode != 0:
        base = "docker.io/library/debian:bookworm-slim"
    podman("build", "--network", "host", "--build-arg", f"BASE={base}", "-t", TOOLS,
           "-f", str(ROOT / "deploy" / "podman" / "Dockerfile.compose-tools"), str(ROOT / "deploy" / "podman"),
           timeout=1200)  # fmt: skip
    return TOOLS


def health(engine: dict[str, int]) -> list[str]:
    code = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{engine['http']}/health', timeout=2)"
    return ["CMD", "python3", "-c", code]


def loopback_override(tmp_path: Path, ports: dict[str, Any]) -> Path:
    """The override and the files it mounts, in tmp_path."""
    engines, gateways = ports["engines"], ports["gateways"]
    redis_url = f"redis://127.0.0.1:{ports['redis']}/0"
    (tmp_path / "kvgate.yaml").write_text(yaml.safe_dump(gateway_yaml(engines, redis_url)))
    servers = "\n".join(f"    server gw{i} 127.0.0.1:{p} check" for i, p in enumerate(gateways))
    (tmp_path / "haproxy.cfg").write_text(HAPROXY.format(port=ports["haproxy"], servers=servers))
    prometheus = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["kvgate-alerts.yaml"],
        "scrape_configs": [
            {"job_name": "kvgate", "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in gateways]}]},
            {"job_name": "vllm", "static_configs": [{"targets": [f"127.0.0.1:{e['http']}" for e in engines]}]},
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prometheus))
    defined = yaml.safe_load((COMPOSE / "compose.yaml").read_text())["services"]
    host: dict[str, Any] = {"network_mode": "host"}
    tools = {**host, "image": TOOLS}  # haproxy's and Prometheus's published ports are moot on the host network
    engine = {**host, "deploy": {"replicas": 1}}
    gateway = {**host, "deploy": {"replicas": 1},
               "volumes": [f"{tmp_path / 'kvgate.yaml'}:/etc/kvgate/kvgate.yaml:ro"]}  # fmt: skip
    services = {
        "engine": {**engine, "command": engine_command(engines[0]),
                   "healthcheck": {"test": Tagged("!override", health(engines[0]))}},
        # the second of each: compose.yaml's definition again (`extends:` would append to its lists)
        "engine-2": {**defined["engine"], **engine, "command": engine_command(engines[1]),
                     "healthcheck": {**defined["engine"]["healthcheck"], "test": health(engines[1])}},
        "gateway": {**gateway, "environment": {"KVGATE__SERVER__PORT": str(gateways[0])}},
        "gateway-2": {**defined["gateway"], **gateway, "environment": {"KVGATE__SERVER__PORT": str(gateways[1])},
                      "volumes": [*gateway["volumes"], *defined["gateway"]["volumes"][1:]]},
        "redis": {**tools, "command": ["redis-server", "--bind", "127.0.0.1", "--port", str(ports["redis"]),
                                       "--save", "", "--appendonly", "no"]},
        # as haproxy's own image runs it: master-worker (a lone haproxy as PID 1 ignores SIGTERM), SIGUSR1 drains
        "haproxy": {**tools, "command": ["haproxy", "-W", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"],
                    "stop_signal": "SIGUSR1",
                    "volumes": [f"{tmp_path / 'haproxy.cfg'}:/usr/local/etc/haproxy/haproxy.cfg:ro"]},
        "prometheus": {**tools, "command": ["prometheus", "--config.file=/etc/prometheus/prometheus.yml",
                                            "--storage.tsdb.path=/tmp/prometheus",
                                            f"--web.listen-address=127.0.0.1:{ports['prometheus']}"],
                       "volumes": [f"{tmp_path / 'prometheus.yml'}:/etc/prometheus/prometheus.yml:ro"]},
    }  # fmt: skip
    override = tmp_path / "compose.loopback.yaml"
    override.write_text(yaml.dump({"services": services}, Dumper=_Dumper, sort_keys=False))
    return override


class Fleet:
    def __init__(self, override: Path) -> None:
        self.project = f"kvgate-test-{uuid.uuid4().hex[:8]}"
        self.override = override

    def compose(self, *args: str, timeout: float = 600) -> str:
        argv = [sys.executable, "-m", "podman_compose", "-p", self.project,
                "-f", str(COMPOSE / "compose.yaml"), "-f", str(self.override), *args]  # fmt: skip
        done = subprocess.run(argv, env=podman_env(), capture_output=True, text=True, timeout=timeout, check=False)
        assert done.returncode == 0, f"podman-compose {' '.join(args)}: {done.returncode}\n{done.stderr[-4000:]}"
        return done.stdout

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def logs(self, service: str) -> str:
        name = self.container(service)
        state = podman("inspect", "--format", "{{.State.Status}} exit {{.State.ExitCode}}", name, check=False)
        done = subprocess.run(["podman", "logs", "--tail", "60", name], env=podman_env(), capture_output=True,
                              text=True, timeout=60, check=False)  # fmt: skip
        return f"{name}: {state}\n{done.stdout}{done.stderr}"

    async def wait(self, http: aiohttp.ClientSession, service: str, url: str, timeout_s: float) -> None:  # noqa: F811
        end = asyncio.get_running_loop().time() + timeout_s
        name = self.container(service)
        while await status_of(http, url) != 200:
            running = await asyncio.to_thread(podman, "inspect", "--format", "{{.State.Running}}", name, check=False)
            if running != "true" or asyncio.get_running_loop().time() > end:
                raise AssertionError(f"{url} not 200 after up to {timeout_s} s; {self.logs(service)}")
            await asyncio.sleep(0.5)


@pytest.fixture
def fleet(tools_image: str, tmp_path: Path) -> Iterator[tuple[Fleet, dict[str, Any]]]:
    ports = {"engines": [engine_ports(), engine_ports()], "gateways": [free_port(), free_port()],
             "haproxy": free_port(), "redis": free_port(), "prometheus": free_port()}  # fmt: skip
    fleet = Fleet(loopback_override(tmp_path, ports))
    try:
        yield fleet, ports
    finally:
        fleet.compose("down", "-v", "-t", str(GRACE_S), timeout=300)
        left = podman("ps", "-a", "--filter", f"name={fleet.project}", "--format", "{{.Names}}")
        assert not left, left


async def prometheus_get(http: aiohttp.ClientSession, url: str) -> Any:  # noqa: F811
    async with http.get(url) as resp:
        return (await resp.json())["data"]


async def test_the_compose_fleet_under_podman_compose(
    fleet: tuple[Fleet, dict[str, Any]],
    http: aiohttp.ClientSession,  # noqa: F811
) -> None:
    compose, ports = fleet
    compose.compose("up", "-d", *SERVICES)
    for service, engine in zip(("engine", "engine-2"), ports["engines"], strict=True):
        await compose.wait(http, service, f"http://127.0.0.1:{engine['http']}/health", 900)
    for service, port in zip(("gateway", "gateway-2"), ports["gateways"], strict=True):
        await compose.wait(http, service, f"http://127.0.0.1:{port}/ready", 180)
    entry = f"http://127.0.0.1:{ports['haproxy']}"
    await wait_status(http, f"{entry}/ready", 60)
    for service in ("engine", "engine-2", "gateway", "gateway-2"):  # the images' and compose's own checks
        podman("healthcheck", "run", compose.container(service))
    assert podman("exec", compose.container("redis"), "redis-cli", "-p", str(ports["redis"]), "ping") == "PONG"

    # the README's curl, through haproxy
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    async with http.post(f"{entry}/v1/chat/completions", json=body) as resp:
        answer = await resp.json()
    assert resp.status == 200 and answer["choices"][0]["message"]["content"], answer

    # Prometheus: both gateways and both engines up, kvgate's alert rules loaded
    prom = f"http://127.0.0.1:{ports['prometheus']}"
    await wait_status(http, f"{prom}/-/ready", 60)

    async def targets_up() -> dict[str, int]:
        active = (await prometheus_get(http, f"{prom}/api/v1/targets"))["activeTargets"]
        up: dict[str, int] = {}
        for target in active:
            up[target["labels"]["job"]] = up.get(target["labels"]["job"], 0) + (target["health"] == "up")
        return up

    for _ in range(60):
        up = await targets_up()
        if up == {"kvgate": 2, "vllm": 2}:
            break
        await asyncio.sleep(1)
    assert up == {"kvgate": 2, "vllm": 2}, up
    rules = {r["name"] for g in (await prometheus_get(http, f"{prom}/api/v1/rules"))["groups"] for r in g["rules"]}
    assert {"KvgateNoReadyReplica", "KvgateHighRejectionRate", "KvgateCrashLoop"} <= rules

    # a gateway container killed under load: haproxy retries what it held, every request is answered
    async with AsyncOpenAI(base_url=f"{entry}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        done = await load_while_killing(client, compose.container("gateway-2"), 10, lambda: compose.logs("gateway"))
    assert len(done) == 40 and all(n > 0 for n in done)

    # everything stops within the grace period: exit status 0, no SIGKILL (137) but the one the test sent
    compose.compose("stop", "-t", str(GRACE_S), timeout=300)
    exits = {s: podman("inspect", "--format", "{{.State.ExitCode}}", compose.container(s)) for s in SERVICES}
    assert exits == {**dict.fromkeys(SERVICES, "0"), "gateway-2": "137"}, exits
