"""Three `kvgate serve` processes behind a real haproxy (round robin, L7 retries) in front of simulated engines, with
a real Redis, once with KV events and once without: they route as one gateway does.

Per case, on the same engines (each run with its own text, so one run's cache does not help the next): a
shared-prefix workload and an agent-session workload through one gateway, then through haproxy; the engine-side
prefix hit rate through three is within 3 points of one's, and every agent session keeps one replica. Then a
tenant's concurrency limit holds once across the three; a gateway killed with SIGKILL under load loses no request
(none streams, so haproxy retries all it had); restarted, its index converges to the others' (from the engines' KV
event replay, or from the shared routing stream).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.admission.config import hash_key
from simengine import SimConfig, SimServer, run_sim_engine
from tests.conftest import wait_for
from tests.test_admission_redis import RedisProcess, free_port, redis_server  # noqa: F401 (fixture)

pytestmark = [
    pytest.mark.redis,
    pytest.mark.timeout(240),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed"),
    pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy not installed (apt-get install haproxy)"),
]

MODEL = "sim"
LOAD_KEY, CAPPED_KEY = "sk-load", "sk-capped"
GROUPS, PER_GROUP, SESSIONS, TURNS = 6, 6, 8, 5


def gateway_yaml(port: int, servers: list[SimServer], redis_url: str, kv_events: bool) -> dict[str, Any]:
    engines = [
        {
            "url": s.url,
            "kv_events_endpoint": s.kv_events_endpoint,
            "kv_events_replay_endpoint": s.kv_events_replay_endpoint,
        }
        if kv_events
        else {"url": s.url}
        for s in servers
    ]
    return {
        "server": {"port": port, "access_log": "off", "metrics_access": "public"},
        "health": {"interval_s": 0.1, "timeout_s": 1.0, "metrics_interval_s": 0.1},
        "routing": {"policy": "cache-aware"},
        "cache": {"tokenizers": {MODEL: "sim"}},
        "admission": {
            "auth": True,
            "tenants": {
                "load": {"keys": [hash_key(LOAD_KEY)]},
                "capped": {"keys": [hash_key(CAPPED_KEY)], "limits": {"max_concurrency": 2}},
            },
            "redis": {"url": redis_url},
        },
        "engines": engines,
    }


HAPROXY = """
global
    maxconn 2000
defaults
    mode http
    timeout connect 1s
    timeout client 60s
    timeout server 60s
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response response-timeout
    option http-buffer-request
    option http-no-delay
frontend entry
    bind 127.0.0.1:{port}
    default_backend gateways
backend gateways
    balance roundrobin
    option httpchk GET /ready
    default-server inter 200ms fall 1 rise 2
{servers}
"""


class Fleet:
    """The gateways (child processes, restartable on their ports) and haproxy in front of them."""

    def __init__(self, tmp: Path, servers: list[SimServer], redis_url: str, kv_events: bool) -> None:
        self.tmp = tmp
        self.ports = [free_port() for _ in range(3)]
        self.entry = f"http://127.0.0.1:{free_port()}"
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * 3
        for i, port in enumerate(self.ports):
            (tmp / f"gw{i}.yaml").write_text(yaml.safe_dump(gateway_yaml(port, servers, redis_url, kv_events)))
        lines = "\n".join(f"    server gw{i} 127.0.0.1:{p} check" for i, p in enumerate(self.ports))
        (tmp / "haproxy.cfg").write_text(HAPROXY.format(port=self.entry.rsplit(":", 1)[1], servers=lines))
        self.haproxy: subprocess.Popen[bytes] | None = None

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def start_gateway(self, i: int) -> None:
        argv = [sys.executable, "-m", "kvgate", "serve", "--config", str(self.tmp / f"gw{i}.yaml")]
        with open(self.tmp / f"gw{i}.log", "ab") as log:
            self.procs[i] = subprocess.Popen(
                [*argv, "--log-level", "WARNING"], stdout=log, stderr=log, start_new_session=True
            )

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        self.procs[i] = None

    def start_haproxy(self) -> None:
        with open(self.tmp / "haproxy.log", "ab") as log:
            self.haproxy = subprocess.Popen(
                ["haproxy", "-db", "-f", str(self.tmp / "haproxy.cfg")], stdout=log, stderr=log
            )

    def stop(self) -> None:
        for proc in [*self.procs, self.haproxy]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


async def ready(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with http.get(f"{url}/ready") as resp:
            return resp.status == 200
    except aiohttp.ClientError:
        return False


async def wait_ready(http: aiohttp.ClientSession, url: str, timeout_s: float = 60.0) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            if await ready(http, url):
                return
            await asyncio.sleep(0.1)


@contextmanager
def fleet_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvgate-fleet-") as tmp:
        yield Path(tmp)


@asynccontextmanager
async def running_fleet(
    servers: list[SimServer], redis_url: str, kv_events: bool, http: aiohttp.ClientSession
) -> AsyncIterator[Fleet]:
    with fleet_dir() as tmp:
        fleet = Fleet(tmp, servers, redis_url, kv_events)
        try:
            for i in range(3):
                fleet.start_gateway(i)
            fleet.start_haproxy()
            for i in range(3):
                await wait_ready(http, fleet.url(i))
            await wait_ready(http, fleet.entry)
            yield fleet
        finally:
            fleet.stop()


# --- workloads ----------------------------------------------------------------------------------------------------
async def chat(
    http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], *, session: str | None = None,
    key: str = LOAD_KEY, max_tokens: int = 2,
) -> tuple[int, str, str]:  # fmt: skip
    """(status, replica, reply text) of one non-streaming chat request."""
    headers = {"authorization": f"Bearer {key}", **({"x-session-id": session} if session else {})}
    body = {"model": MODEL, "max_tokens": max_tokens, "messages": messages}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        data = await resp.json()
        if resp.status != 200:
            return resp.status, "", ""
        return 200, resp.headers.get("x-kvgate-replica", ""), data["choices"][0]["message"]["content"]


async def shared_prefix(http: aiohttp.ClientSession, url: str, variant: str) -> None:
    """GROUPS system prompts, PER_GROUP questions each, interleaved across groups; 4 at a time."""
    prompts = [
        [
            {"role": "system", "content": f"{variant} group {g}: " + f"rule {g} of the house, keep it. " * 60},
            {"role": "user", "content": f"question {q} for group {g} in {variant}"},
        ]
        for q in range(PER_GROUP)
        for g in range(GROUPS)
    ]
    queue = list(reversed(prompts))

    async def worker() -> None:
        while queue:
            status, _, _ = await chat(http, url, queue.pop())
            assert status == 200

    await asyncio.gather(*(worker() for _ in range(4)))


async def agent_sessions(http: aiohttp.ClientSession, url: str, variant: str) -> dict[str, set[str]]:
    """SESSIONS conversations of TURNS turns each (all sessions at once, turns in order); per session the replicas
    that served it."""
    served: dict[str, set[str]] = {}

    async def session(s: int) -> None:
        name = f"{variant}-agent-{s}"
        messages = [{"role": "system", "content": f"agent {s} of {variant}, tools listed below. " * 40}]
        for t in range(TURNS):
            messages.append({"role": "user", "content": f"step {t}: observation " * 12})
            status, replica, reply = await chat(http, url, messages, session=name)
            assert status == 200
            served.setdefault(name, set()).add(replica)
            messages.append({"role": "assistant", "content": reply})

    await asyncio.gather(*(session(s) for s in range(SESSIONS)))
    return served


def hit_totals(servers: list[SimServer]) -> tuple[int, int]:
    return (
        sum(s.engine.stats.cached_tokens_total for s in servers),
        sum(s.engine.stats.prompt_tokens_total for s in servers),
    )


async def measure(
    http: aiohttp.ClientSession, url: str, servers: list[SimServer], variant: str
) -> tuple[float, dict[str, set[str]]]:
    """The engine-side hit rate of both workloads through `url`, and the replicas of each agent session."""
    hits0, prompts0 = hit_totals(servers)
    await shared_prefix(http, url, variant)
    served = await agent_sessions(http, url, variant)
    hits1, prompts1 = hit_totals(servers)
    return (hits1 - hits0) / (prompts1 - prompts0), served


async def index_sizes(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    sizes = {}
    for line in text.splitlines():
        if line.startswith("kvgate_prefix_index_blocks{"):
            labels, value = line.rsplit(" ", 1)
            sizes[labels] = float(value)
    return sizes


# --- the test -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_events", [True, False], ids=["kv-events", "approximate"])
async def test_three_gateways_behind_haproxy_route_as_one(
    kv_events: bool,
    redis_server: RedisProcess,  # noqa: F811
) -> None:
    await redis_server.start()
    sim = {"kv_events_port": 0, "kv_events_replay_port": 0} if kv_events else {}
    async with AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(run_sim_engine(SimConfig(model=MODEL, seed=i, **sim))) for i in range(3)
        ]
        http = await stack.enter_async_context(aiohttp.ClientSession())
        fleet = await stack.enter_async_context(running_fleet(servers, redis_server.url, kv_events, http))

        # one gateway alone, then the three behind haproxy (round robin: consecutive requests change gateway)
        one, one_served = await measure(http, fleet.url(0), servers, "one")
        three, three_served = await measure(http, fleet.entry, servers, "three")
        assert three >= one - 0.03, f"hit rate through 3 gateways {three:.3f}, through one {one:.3f}"
        assert all(len(r) == 1 for r in one_served.values()), one_served
        assert all(len(r) == 1 for r in three_served.values()), three_served

        # one tenant limit across the three: 2 of 9 concurrent requests run, 7 are refused
        capped = [{"role": "user", "content": f"slow {i}"} for i in range(9)]
        results = await asyncio.gather(*(chat(http, fleet.entry, [m], key=CAPPED_KEY, max_tokens=200) for m in capped))
        assert sorted(status for status, _, _ in results) == [200] * 2 + [429] * 7

        # kill -9 one gateway under load: haproxy retries what it held; every request succeeds
        done: list[int] = []

        async def load(w: int) -> None:
            for i in range(25):
                status, _, _ = await chat(http, fleet.entry, [{"role": "user", "content": f"w{w} r{i} " * 30}])
                done.append(status)

        workers = [asyncio.create_task(load(w)) for w in range(4)]
        await wait_for(lambda: len(done) >= 20, 60.0, "load running")
        fleet.kill(1)
        await asyncio.gather(*workers)
        assert done == [200] * 100

        # restarted, its index converges to the others'
        fleet.start_gateway(1)
        await wait_ready(http, fleet.url(1))

        async def converged() -> bool:
            restarted, other = await index_sizes(http, fleet.url(1)), await index_sizes(http, fleet.url(0))
            return bool(other) and all(abs(restarted.get(k, 0) - v) <= 0.02 * v for k, v in other.items())

        async with asyncio.timeout(30.0):
            while True:
                if await converged():
                    break
                await asyncio.sleep(0.2)
