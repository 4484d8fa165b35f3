"""Shared fixtures: simulated engines and an in-process kvgate in front of them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import pytest
import uvloop

from gateway.config import GatewayConfig, load_config
from gateway.embedded import RunningGateway, running_gateway
from gateway.keys import REPLICAS
from simengine import SimConfig, SimServer, run_sim_engine


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def gateway_config(urls: list[str], **overrides: Any) -> GatewayConfig:
    base: dict[str, Any] = {
        "server": {"port": 0, "access_log": "off"},
        "health": {"interval_s": 0.1, "timeout_s": 1.0, "metrics_interval_s": 0.1},
        "engines": [{"url": u} for u in urls],
    }
    for key, value in overrides.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return load_config(overrides=base, environ={})


@asynccontextmanager
async def gateway_over_sims(
    sims: list[SimConfig], **overrides: Any
) -> AsyncIterator[tuple[RunningGateway, list[SimServer]]]:
    async with AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(run_sim_engine(cfg)) for cfg in sims]
        # attached with their KV-events endpoint when they publish events
        engines = [{"url": s.url, "kv_events_endpoint": s.kv_events_endpoint} for s in servers]
        config = gateway_config([], **{"engines": engines, **overrides})
        gw = await stack.enter_async_context(running_gateway(config))
        replicas = gw.app[REPLICAS]
        await wait_for(lambda: all(r.routable(time.monotonic()) for r in replicas), what="replicas ready")
        yield gw, servers


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Tests run on uvloop, as `kvgate serve` does (its transports differ from asyncio's)."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
