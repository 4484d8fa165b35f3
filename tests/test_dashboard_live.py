"""Every panel of the Grafana dashboard (deploy/observability/grafana-kvgate.json) shows data: a real Prometheus
(Debian's package) scrapes a gateway under load every second, with kvgate's alert rules loaded, and each panel's
query, as Grafana sends it (`$__rate_interval` replaced), returns series through Prometheus's HTTP API.

The gateway is the operator's kit in small: an engine pool of two simulated engines, one of them killed under load
(a restart, upstream errors, retries), cache-aware routing, two tenants (alice; bob, with one request at
a time, whose bursts are refused, and latency targets no engine meets), latency targets on (the default).
Grafana itself is not run (no image registry here); its rendering of a query is Prometheus's answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from engine_pool.launcher import free_port
from gateway.admission.config import hash_key
from gateway.config import GatewayConfig
from gateway.embedded import running_gateway
from gateway.keys import POOL
from tests.conftest import wait_for
from tests.test_observability import ALERTS, DASHBOARD

PROMETHEUS = shutil.which("prometheus")
RATE_INTERVAL = "20s"  # Grafana's $__rate_interval for a 1 s scrape is 4 scrapes at least; wider is smoother
ADMIN = "adm"

pytestmark = [
    pytest.mark.skipif(PROMETHEUS is None, reason="needs prometheus (apt-get install prometheus)"),
    pytest.mark.timeout(240),
]


def panel_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"].replace("$__rate_interval", RATE_INTERVAL)) for p in panels for t in p["targets"]]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A Prometheus on loopback whose scrape targets are written to a file it watches: (its URL, that file)."""
    targets = tmp_path / "targets.json"
    targets.write_text("[]")
    shutil.copy(ALERTS, tmp_path / "kvgate-alerts.yaml")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["kvgate-alerts.yaml"],
        "scrape_configs": [{
            "job_name": "kvgate",
            "authorization": {"type": "Bearer", "credentials": ADMIN},  # /metrics takes the admin key
            "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}],
        }],
    }  # fmt: skip
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    argv = [str(PROMETHEUS), f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle"]  # fmt: skip
    with (tmp_path / "prometheus.log").open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", targets
    finally:
        process.terminate()
        process.wait(timeout=30)


async def query(http: aiohttp.ClientSession, prom: str, expr: str) -> list[dict[str, Any]]:
    async with http.get(f"{prom}/api/v1/query", params={"query": expr}) as resp:
        body = await resp.json()
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def gateway_config(tmp_path: Path) -> GatewayConfig:
    return GatewayConfig.model_validate({
        "server": {"port": 0, "access_log": "off"},
        "admin": {"key": ADMIN},
        "health": {"interval_s": 0.2, "metrics_interval_s": 0.2},
        "routing": {"policy": "cache-aware"},
        "admission": {"auth": True, "tenants": {
            "alice": {"keys": [hash_key("sk-alice")]},
            "bob": {"keys": [hash_key("sk-bob")], "limits": {"max_concurrency": 1},
                    "targets": {"ttft_s": 0.0001, "tpot_s": 0.0001}},
        }},
        "pool": {"log_dir": str(tmp_path / "logs"), "models": [
            {"name": "m", "kind": "sim", "replicas": 2, "restart": {"backoff_base_s": 0.05},
             "extra_args": ["--decode-ms", "4"]},
        ]},
    })  # fmt: skip


async def chat(http: aiohttp.ClientSession, url: str, key: str, i: int, stream: bool) -> int:
    body = {"model": "m", "messages": [{"role": "system", "content": "You answer briefly. " * 30},
                                       {"role": "user", "content": f"question {i}"}],
            "max_tokens": 12, "stream": stream}  # fmt: skip
    async with http.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        await r.read()
        return r.status


@asynccontextmanager
async def load(http: aiohttp.ClientSession, url: str) -> AsyncIterator[list[int]]:
    """Alice at 4 at once, streamed and not; bob in bursts of 3 (his limit is 1). Yields the statuses so far."""
    statuses: list[int] = []

    async def alice(worker: int) -> None:
        for i in itertools_count(worker):
            statuses.append(await chat(http, url, "sk-alice", i, stream=i % 2 == 0))

    async def bob() -> None:
        for i in itertools_count(0):
            statuses.extend(await asyncio.gather(*(chat(http, url, "sk-bob", i * 3 + j, True) for j in range(3))))
            await asyncio.sleep(0.2)

    tasks = [asyncio.create_task(alice(w)) for w in range(4)] + [asyncio.create_task(bob())]
    try:
        yield statuses
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with suppress(asyncio.CancelledError):
                await task


def itertools_count(start: int) -> Iterator[int]:
    n = start
    while True:
        yield n
        n += 4


async def test_every_dashboard_panel_returns_series_from_a_live_prometheus(
    tmp_path: Path, prometheus: tuple[str, Path]
) -> None:
    prom, targets = prometheus
    queries = panel_queries()
    assert len(queries) >= 20
    async with running_gateway(gateway_config(tmp_path)) as gw, aiohttp.ClientSession() as http:
        await gw.app[POOL].wait_ready(timeout_s=60)
        targets.write_text(json.dumps([{"targets": [gw.url.removeprefix("http://")]}]))
        empty: list[str] = [title for title, _ in queries]
        async with load(http, gw.url) as statuses:
            await wait_for(lambda: len(statuses) >= 40, 60, "40 answers")
            # a crash under load: of an engine with requests on it (cache-aware may keep the shared prompt's traffic
            # on one replica, and killing an idle one shows no upstream error)
            slots = gw.app[POOL].slots()
            await wait_for(lambda: any(s.replica.in_flight for s in slots), 60, "a request in flight")
            process = max(slots, key=lambda s: s.replica.in_flight).process
            assert process is not None
            os.kill(process.pid, signal.SIGKILL)
            for _ in range(120):  # until every panel has data, or two minutes
                await asyncio.sleep(1)
                empty = [title for title, expr in queries if not await query(http, prom, expr)]
                if not empty:
                    break
        async with http.get(f"{prom}/api/v1/targets") as resp:
            (target,) = (await resp.json())["data"]["activeTargets"]
        async with http.get(f"{prom}/api/v1/rules") as resp:
            groups = (await resp.json())["data"]["groups"]
    assert target["health"] == "up", target
    assert not empty, f"panels without data: {empty}"
    assert {200, 429} <= set(statuses)  # alice answered, bob's bursts refused by his quota
    loaded = {rule["name"] for g in groups for rule in g["rules"]}
    assert {"KvgateNoReadyReplica", "KvgateHighRejectionRate", "KvgateCrashLoop"} <= loaded
