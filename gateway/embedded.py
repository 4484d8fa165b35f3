"""Run a gateway inside the current event loop (tests, benchmarks, loadgen self-checks).

async with running_gateway(config) as gw:
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x")
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web

from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.config_load import ConfigSource
from gateway.keys import CONFIG_SOURCE
from gateway.listener import GatewayListener


@dataclass
class RunningGateway:
    app: web.Application
    url: str
    port: int
    listener: GatewayListener  # `await gw.listener.stop()` shuts down early; leaving the block then does nothing


@asynccontextmanager
async def running_gateway(
    config: GatewayConfig, *, source: ConfigSource | None = None
) -> AsyncIterator[RunningGateway]:
    """`source`: where `config` came from, read again by a reload (SIGHUP, POST /admin/reload)."""
    app = build_app(config)
    if source is not None:
        app[CONFIG_SOURCE] = source
    listener = GatewayListener(app, config)
    port = await listener.start()
    try:
        yield RunningGateway(app, f"http://{config.server.host}:{port}", port, listener)
    finally:
        await listener.stop()
