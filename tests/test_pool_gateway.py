"""The engine pool inside the gateway, with simulated engines as child processes: admin endpoints (auth, errors),
drain lets in-flight streams finish, rolling restart under steady load with zero failed requests and never fewer
than N-1 ready, scale up and down, a degradation rule restarting a failing replica."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client import CollectorRegistry

from engine_pool.admin_cli import main as admin_main
from engine_pool.pool import EnginePool
from engine_pool.slots import SlotState
from gateway.config import GatewayConfig
from gateway.embedded import RunningGateway, running_gateway
from gateway.keys import POOL, REGISTRY

KEY = "s3cret-admin"
Gw = tuple[RunningGateway, EnginePool, aiohttp.ClientSession, openai.AsyncOpenAI]


def config(tmp_path: Path, **model: Any) -> GatewayConfig:
    spec = {
        "name": "m",
        "kind": "sim",
        "replicas": 2,
        "drain_grace_s": 60,
        "restart": {"backoff_base_s": 0.05},
        "liveness": {"interval_s": 0.2},
        **model,
    }
    return GatewayConfig.model_validate(
        {
            "server": {"port": 0, "access_log": "off"},
            "admin": {"key": KEY},
            "health": {"interval_s": 0.2, "metrics_interval_s": 0.2},
            "pool": {"log_dir": str(tmp_path / "logs"), "models": [spec]},
        }
    )


@asynccontextmanager
async def gateway(cfg: GatewayConfig) -> AsyncIterator[Gw]:
    async with (
        running_gateway(cfg) as gw,
        aiohttp.ClientSession(base_url=gw.url, headers={"Authorization": f"Bearer {KEY}"}) as admin,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0) as oai,
    ):
        pool = gw.app[POOL]
        await pool.wait_ready(timeout_s=60)
        yield gw, pool, admin, oai
    for slot in pool.slots():
        assert slot.process is None


async def test_admin_auth_and_errors(tmp_path: Path) -> None:
    async with gateway(config(tmp_path, replicas=1)) as (gw, _pool, admin, _oai):
        async with aiohttp.ClientSession() as anon:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                async with anon.get(gw.url + "/admin/replicas", headers=headers) as resp:
                    assert resp.status == 401
                    body = await resp.json()
                    assert set(body["error"]) == {"message", "type", "param", "code"}
                    assert body["error"]["type"] == "authentication_error"
        async with admin.get("/admin/replicas") as resp:
            assert resp.status == 200
            (entry,) = (await resp.json())["replicas"]
        assert entry["id"] == "m-0" and entry["state"] == "ready" and entry["routable"] and entry["managed"]
        async with admin.post("/admin/replicas/nope/drain") as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "replica_not_found"
        async with admin.post("/admin/models/m/scale", json={"replicas": "two"}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "replicas"
        async with admin.post("/admin/models/other/rolling-restart") as resp:
            assert resp.status == 404
        # the only replica cannot be rolled without dropping below N-1 = 0? N-1 = 0 is allowed: it restarts
        async with admin.post("/admin/replicas/m-0/restart") as resp:
            assert resp.status == 200 and (await resp.json())["result"] == "ready"


async def test_admin_disabled_without_key(tmp_path: Path) -> None:
    cfg = config(tmp_path, replicas=1).model_copy(update={"pool": None})
    cfg.admin.key = None
    async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/admin/replicas", headers={"Authorization": "Bearer x"}) as resp:
            assert resp.status == 404


async def test_drain_lets_in_flight_streams_finish(tmp_path: Path) -> None:
    async with gateway(config(tmp_path, extra_args=["--decode-ms", "40"])) as (_gw, pool, admin, oai):
        streams = []
        for _ in range(4):
            raw = await oai.completions.with_raw_response.create(
                model="m", prompt="drain me", max_tokens=40, stream=True
            )
            streams.append((raw.headers["x-kvgate-replica"], raw.parse()))
        target = streams[0][0]

        async def consume(stream: Any) -> tuple[int, str | None]:
            n, finish = 0, None
            async for chunk in stream:
                n += 1
                finish = chunk.choices[0].finish_reason if chunk.choices else finish
            return n, finish

        consumers = [asyncio.create_task(consume(s)) for _, s in streams]
        async with admin.post(f"/admin/replicas/{target}/drain") as resp:
            assert resp.status == 200 and (await resp.json())["result"] == "stopped"
        results = await asyncio.gather(*consumers)
        assert all(finish == "length" for _, finish in results)  # every stream ran to its end
        assert pool.slot(target).state is SlotState.STOPPED
        # new requests go to the other replica
        for _ in range(3):
            again = await oai.completions.with_raw_response.create(model="m", prompt="after", max_tokens=2)
            assert again.headers["x-kvgate-replica"] != target


async def test_an_engine_that_hangs_during_the_gateways_drain_is_not_relaunched(tmp_path: Path) -> None:
    """SIGTERM: the gateway drains a stream on each replica, and one engine hangs meanwhile. It is stopped, not
    relaunched (an engine started during the drain would only be stopped after it: a GPU's minutes of loading for
    nothing), and the other stream runs to its end."""
    async with gateway(config(tmp_path, extra_args=["--decode-ms", "20"])) as (gw, pool, _admin, oai):
        streams = {}
        for _ in range(2):
            raw = await oai.completions.with_raw_response.create(model="m", prompt="drain", max_tokens=100, stream=True)
            streams[raw.headers["x-kvgate-replica"]] = raw.parse()
        assert sorted(streams) == ["m-0", "m-1"]

        async def consume(stream: Any) -> str | None:
            finish = None
            with contextlib.suppress(openai.APIError):  # the hung engine's stream may end with an error event
                async for chunk in stream:
                    finish = chunk.choices[0].finish_reason if chunk.choices else finish
            return finish

        consumers = [asyncio.create_task(consume(s)) for s in streams.values()]
        draining = asyncio.create_task(gw.listener.stop())
        hung = pool.slot("m-0")
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{hung.replica.url}/sim/faults", json={"fail_health": True}) as resp:
                assert resp.status == 200
        assert (await asyncio.gather(*consumers))[1] == "length"
        await draining
        states = [event for _, event in hung.events]
        assert "stopped: not relaunched: the gateway is shutting down" in states, states
        ready = next(i for i, event in enumerate(states) if event.startswith("ready"))
        assert not any(event.startswith("starting") for event in states[ready:]), states


async def test_rolling_restart_under_load_zero_failures(tmp_path: Path) -> None:
    async with gateway(config(tmp_path, extra_args=["--decode-ms", "5"])) as (_gw, pool, admin, oai):
        gens = {s.id: s.gen for s in pool.slots()}
        min_ready = [len(pool.slots())]
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                changed = pool.supervisor.changed
                min_ready[0] = min(min_ready[0], sum(s.state is SlotState.READY for s in pool.slots()))
                await changed.wait()

        async def load(worker: int) -> tuple[int, int]:
            ok = failed = 0
            while not stop.is_set():
                try:
                    r = await oai.completions.create(
                        model="m", prompt=f"load {worker}", max_tokens=8, stream=bool(worker % 2)
                    )
                    if worker % 2:
                        async for _ in r:  # type: ignore[union-attr]
                            pass
                    ok += 1
                except openai.APIError:
                    failed += 1
            return ok, failed

        watcher = asyncio.create_task(watch())
        workers = [asyncio.create_task(load(i)) for i in range(4)]
        async with admin.post("/admin/models/m/rolling-restart") as resp:
            assert resp.status == 200, await resp.text()
        stop.set()
        pool.supervisor.changed.set()
        results = await asyncio.gather(*workers)
        await watcher
        assert sum(f for _, f in results) == 0
        assert sum(ok for ok, _ in results) > 0
        assert min_ready[0] >= 1  # N-1 with N = 2
        assert all(s.gen == gens[s.id] + 1 and s.state is SlotState.READY for s in pool.slots())


async def test_scale_up_and_down(tmp_path: Path) -> None:
    async with gateway(config(tmp_path, replicas=1)) as (_gw, pool, admin, oai):
        async with admin.post("/admin/models/m/scale", json={"replicas": 3}) as resp:
            assert resp.status == 200 and (await resp.json())["result"] == ["m-0", "m-1", "m-2"]
        assert all(s.state is SlotState.READY for s in pool.slots())
        pgids = [s.process.pgid for s in pool.slots() if s.process is not None]
        async with admin.post("/admin/models/m/scale", json={"replicas": 1}) as resp:
            assert resp.status == 200 and (await resp.json())["result"] == ["m-0"]
        async with admin.get("/admin/replicas") as resp:
            assert [r["id"] for r in (await resp.json())["replicas"]] == ["m-0"]
        for pgid in pgids[1:]:
            try:
                os.killpg(pgid, 0)
                alive = True
            except ProcessLookupError:
                alive = False
            assert not alive
        async with admin.post("/admin/models/m/scale", json={"replicas": 0}) as resp:
            assert resp.status == 200 and (await resp.json())["result"] == []
        with pytest.raises(openai.APIStatusError) as refused:  # a model scaled to 0 is unavailable, not unknown
            await oai.completions.create(model="m", prompt="hi", max_tokens=2)
        assert refused.value.status_code == 503 and refused.value.response.headers["Retry-After"]


async def test_degradation_rule_restarts_failing_replica(tmp_path: Path) -> None:
    rule = {"window_s": 1.0, "check_interval_s": 0.1, "error_rate_max": 0.5, "min_requests": 3, "cooldown_s": 600}
    cfg = config(tmp_path, degradation=rule)
    cfg.retry.breaker_failures = 1000  # keep sending attempts to the failing replica: the rule, not the breaker, acts
    async with gateway(cfg) as (gw, pool, _admin, oai):
        bad = pool.slot("m-0")
        gen = bad.gen
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{bad.replica.url}/sim/faults", json={"error_rate": 1.0}) as resp,
        ):
            assert resp.status == 200
        restarted = asyncio.create_task(
            pool.supervisor.wait_for("m-0", {SlotState.READY}, newer_than=gen, timeout_s=60)
        )
        while not restarted.done():  # every request still succeeds: a failed attempt is retried on m-1
            await oai.completions.create(model="m", prompt="x", max_tokens=2)
        assert restarted.result() is SlotState.READY
        registry: CollectorRegistry = gw.app[REGISTRY]
        assert (
            registry.get_sample_value(
                "kvgate_pool_restarts_total", {"replica": "m-0", "model": "m", "reason": "degraded"}
            )
            == 1
        )


async def test_the_admin_cli_drives_the_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvgate admin` as an operator runs it: status, a drain, and a name that is no replica (any characters:
    quoted into the path) answered as the gateway's 404, not a traceback."""
    async with gateway(config(tmp_path)) as (gw, pool, _admin, _oai):
        base = ["--url", gw.url, "--key", KEY]
        assert await asyncio.to_thread(admin_main, [*base, "status"]) == 0
        assert "m-0" in capsys.readouterr().out
        assert await asyncio.to_thread(admin_main, [*base, "drain", "m-1"]) == 0
        assert json.loads(capsys.readouterr().out)["result"] == "stopped"
        assert pool.slot("m-1").state is SlotState.STOPPED
        for name in ("a b", "x?y", "../m-0"):
            assert await asyncio.to_thread(admin_main, [*base, "drain", name]) == 1
            assert "replica_not_found" in capsys.readouterr().err
        assert pool.slot("m-0").state is SlotState.READY
