"""The deployment kit's images, built and run with podman (marker `containers`; not in the default run: see
README.md's deployment section for why and for the command).

`scripts/images.sh` builds both images (kept when their source hash is unchanged) from a locally made Debian base
where no registry is reachable. Then, on the host network with one loopback port each: a vLLM CPU engine container,
two gateway containers sharing a Redis, haproxy in front; chat through the openai client; one gateway container
killed under load loses no request (haproxy retries); SIGTERM drains the other one: its streamed answer finishes
and it exits 0, i.e. before podman's SIGKILL at the end of the grace period.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from openai import AsyncOpenAI

from tests.conftest import wait_for
from tests.test_admission_redis import RedisProcess, free_port, redis_server  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "deploy" / "podman" / "containers.conf"
MODEL = "tiny-llama"
GRACE_S = 60  # podman stop's grace period, above the gateway's shutdown_grace_s

pytestmark = [
    pytest.mark.containers,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman not installed (apt-get install podman runc)"),
    pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy not installed (apt-get install haproxy)"),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed"),
]


def podman_env() -> dict[str, str]:
    env = dict(os.environ)
    if "CONTAINERS_CONF" not in env and shutil.which("runc"):
        env["CONTAINERS_CONF"] = str(CONF)
    return env


def podman(*args: str, timeout: float = 120, check: bool = True) -> str:
    done = subprocess.run(
        ["podman", *args], env=podman_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {done.returncode}\n{done.stderr[-3000:]}")
    return done.stdout.strip()


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    """Image name -> `built` or `kept` (scripts/images.sh prints name, built|kept, seconds, bytes)."""
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "images.sh")],
        env=podman_env(), capture_output=True, text=True, timeout=3600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-5000:]
    lines = [line.split() for line in done.stdout.splitlines() if line.strip()]
    return {fields[0]: fields[1] for fields in lines}


def inspect(image: str) -> dict[str, Any]:
    """The image's config, with its health check (podman puts that beside the config)."""
    (data,) = json.loads(podman("image", "inspect", image))
    return {**data["Config"], "Healthcheck": data.get("Healthcheck") or data["Config"].get("Healthcheck")}


def test_the_images_are_built_and_the_gateway_runs_unprivileged(images: dict[str, str]) -> None:
    assert set(images) == {"kvgate:latest", "kvgate-engine-cpu:latest"}
    gateway = inspect("kvgate:latest")
    assert gateway["User"] == "10001" and gateway["Entrypoint"] == ["kvgate"]
    assert gateway.get("StopSignal", "SIGTERM") == "SIGTERM"
    assert "/health" in " ".join(gateway["Healthcheck"]["Test"])
    assert podman("run", "--rm", "--network", "host", "--entrypoint", "id", "kvgate:latest", "-u") == "10001"
    engine = inspect("kvgate-engine-cpu:latest")
    assert engine["User"] == "10001" and engine["Entrypoint"] == ["engine-cpu-entrypoint"]
    assert "/health" in " ".join(engine["Healthcheck"]["Test"])


# --- the fleet of containers ---------------------------------------------------------------------------------------
class Containers:
    """Containers started by one test, all removed (with their volume) at the end."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:8]
        self.names: list[str] = []
        self.volume = f"kvgate-test-models-{self.tag}"
        podman("volume", "create", self.volume)

    def run(self, name: str, *args: str) -> str:
        full = f"kvgate-test-{name}-{self.tag}"
        podman("run", "-d", "--name", full, "--network", "host", *args)
        self.names.append(full)
        return full

    def exit_code(self, name: str) -> int:
        return int(podman("inspect", "--format", "{{.State.ExitCode}}", name))

    def logs(self, name: str) -> str:
        """The container's state and its last lines (podman logs replays the container's stderr on its own)."""
        state = podman(
            "inspect", "--format", "{{.State.Status}} exit {{.State.ExitCode}} {{.State.Error}}", name, check=False
        )
        done = subprocess.run(
            ["podman", "logs", "--tail", "60", name],
            env=podman_env(), capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        return f"{name}: {state}\n{done.stdout}{done.stderr}"

    async def wait(self, http: aiohttp.ClientSession, name: str, url: str, timeout_s: float) -> None:
        """Until the container answers 200 at `url`; its state and logs as the failure once it has stopped running
        or after `timeout_s`."""
        end = asyncio.get_running_loop().time() + timeout_s
        while await status_of(http, url) != 200:
            running = await asyncio.to_thread(podman, "inspect", "--format", "{{.State.Running}}", name, check=False)
            if running != "true" or asyncio.get_running_loop().time() > end:
                raise AssertionError(f"{url} not 200 after up to {timeout_s} s; {self.logs(name)}")
            await asyncio.sleep(0.5)

    def remove(self) -> None:
        for name in self.names:
            podman("rm", "-f", "-t", "0", name, check=False)
        podman("volume", "rm", "-f", self.volume, check=False)


@pytest.fixture
def containers() -> Iterator[Containers]:
    c = Containers()
    try:
        yield c
    finally:
        c.remove()


# deploy/compose/compose.yaml's engine command line, on loopback ports (tests/test_deploy.py keeps the Kubernetes kit's
# the same)
COMPOSE_ENGINE = yaml.safe_load((ROOT / "deploy" / "compose" / "compose.yaml").read_text())["services"]["engine"]
ENGINE_ARGS = [a for a in COMPOSE_ENGINE["command"] if not a.startswith(("--port=", "--kv-events-config="))]


def engine_ports() -> dict[str, int]:
    return {"http": free_port(), "events": free_port(), "replay": free_port()}


def engine_command(engine: dict[str, int]) -> list[str]:
    """compose.yaml's engine command line on the engine's loopback ports."""
    events = {
        "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events",
        "endpoint": f"tcp://*:{engine['events']}", "replay_endpoint": f"tcp://*:{engine['replay']}",
    }  # fmt: skip
    return [f"--port={engine['http']}", *ENGINE_ARGS, f"--kv-events-config={json.dumps(events)}"]


def gateway_yaml(engines: list[dict[str, int]], redis_url: str) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "metrics_access": "public", "shutdown_grace_s": 30},  # port: environment
        "routing": {"policy": "cache-aware"},
        "engines": [
            {
                "url": f"http://127.0.0.1:{engine['http']}",
                "model": MODEL,
                "kv_events_endpoint": f"tcp://127.0.0.1:{engine['events']}",
                "kv_events_replay_endpoint": f"tcp://127.0.0.1:{engine['replay']}",
            }
            for engine in engines
        ],
        "cache": {"tokenizers": {MODEL: "/models/tiny-llama"}},
        "admission": {"replica_max_concurrency": 16, "redis": {"url": redis_url}},
    }


HAPROXY = """
global
    maxconn 400
defaults
    mode http
    timeout connect 2s
    timeout client 300s
    timeout server 300s
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response response-timeout
    option http-buffer-request
    option http-no-delay
frontend kvgate
    bind 127.0.0.1:{port}
    default_backend gateways
backend gateways
    balance roundrobin
    option httpchk GET /ready
    default-server inter 500ms fall 1 rise 2
{servers}
"""


def start_haproxy(config: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["haproxy", "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def status_of(http: aiohttp.ClientSession, url: str) -> int:
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            return resp.status
    except (aiohttp.ClientError, TimeoutError):
        return 0


async def wait_status(http: aiohttp.ClientSession, url: str, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            if await status_of(http, url) == 200:
                return
            await asyncio.sleep(0.5)


async def load_while_killing(
    client: AsyncOpenAI, container: str, per_worker: int, logs: Callable[[], str]
) -> list[int]:
    """Four workers sending chat requests in turn through `client`; once eight are answered, `container` is killed
    with SIGKILL. The completion tokens of every answer (a failed request fails it, with `logs()` shown)."""
    done: list[int] = []

    async def load(w: int) -> None:
        for i in range(per_worker):
            r = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"worker {w} request {i} " * 8}], max_tokens=4
            )
            done.append(r.usage.completion_tokens if r.usage else 0)

    workers = [asyncio.create_task(load(w)) for w in range(4)]
    await wait_for(lambda: len(done) >= 8, 120.0, "load running")
    podman("kill", "--signal", "KILL", container)
    try:
        await asyncio.gather(*workers)
    except Exception as exc:  # the gateway's side of it
        raise AssertionError(f"{exc}\n{logs()}") from exc
    return done


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_engine_and_two_gateways_in_containers_behind_haproxy(
    images: dict[str, str],
    containers: Containers,
    redis_server: RedisProcess,  # noqa: F811
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    await redis_server.start()
    engine = engine_ports()
    engine_name = containers.run(
        "engine", f"--shm-size={COMPOSE_ENGINE['shm_size']}", "-v", f"{containers.volume}:/models",
        "kvgate-engine-cpu:latest", *engine_command(engine),
    )  # fmt: skip
    await containers.wait(http, engine_name, f"http://127.0.0.1:{engine['http']}/health", 900)

    gateways = []
    ports = [free_port(), free_port()]
    for i, port in enumerate(ports):
        (tmp_path / f"gw{i}.yaml").write_text(yaml.safe_dump(gateway_yaml([engine], redis_server.url)))
        gateways.append(
            containers.run(
                f"gw{i}", "-e", f"KVGATE__SERVER__PORT={port}",
                "-v", f"{tmp_path / f'gw{i}.yaml'}:/etc/kvgate/kvgate.yaml:ro",
                "-v", f"{containers.volume}:/models:ro", "kvgate:latest",
            )
        )  # fmt: skip
    entry_port = free_port()
    servers = "\n".join(f"    server gw{i} 127.0.0.1:{p} check" for i, p in enumerate(ports))
    (tmp_path / "haproxy.cfg").write_text(HAPROXY.format(port=entry_port, servers=servers))
    haproxy = start_haproxy(tmp_path / "haproxy.cfg")
    stack = AsyncExitStack()
    try:
        for name, port in zip(gateways, ports, strict=True):
            await containers.wait(http, name, f"http://127.0.0.1:{port}/ready", 120)
        entry = f"http://127.0.0.1:{entry_port}"
        await wait_status(http, f"{entry}/ready", 60)
        # the image's own health check passes in the running container
        podman("healthcheck", "run", gateways[0])

        client = AsyncOpenAI(base_url=f"{entry}/v1", api_key="unused", max_retries=0, timeout=120)
        direct = AsyncOpenAI(base_url=f"http://127.0.0.1:{ports[0]}/v1", api_key="unused", max_retries=0, timeout=120)
        await stack.enter_async_context(client)
        await stack.enter_async_context(direct)
        resp = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8
        )
        assert resp.choices[0].message.content and resp.usage is not None and resp.usage.completion_tokens > 0

        # kill -9 one gateway container under load: haproxy retries what it held; every request succeeds
        done = await load_while_killing(client, gateways[1], 12, lambda: containers.logs(gateways[0]))
        assert len(done) == 48 and all(n > 0 for n in done)

        # SIGTERM drains: a streamed answer in flight on the remaining gateway finishes, then the container exits 0
        stream = await direct.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a long answer"}], max_tokens=200, stream=True,
            extra_body={"ignore_eos": True, "stream_options": {"include_usage": True}},
        )  # fmt: skip
        chunks = aiter(stream)
        await anext(chunks)  # the answer has started
        stop = asyncio.create_task(asyncio.to_thread(podman, "stop", "-t", str(GRACE_S), gateways[0], timeout=120))
        usage = None
        async for chunk in chunks:
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == 200
        await stop
        assert containers.exit_code(gateways[0]) == 0, containers.logs(gateways[0])  # not 137: no SIGKILL
        podman("stop", "-t", str(GRACE_S), engine_name, timeout=120)
        assert containers.exit_code(engine_name) == 0, containers.logs(engine_name)
    finally:
        await stack.aclose()
        haproxy.terminate()
        haproxy.wait(10)
