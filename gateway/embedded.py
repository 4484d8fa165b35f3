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


@dataclass
class RunningGateway:
    app: web.Application
    url: str
    port: int


@asynccontextmanager
async def running_gateway(config: GatewayConfig) -> AsyncIterator[RunningGateway]:
    app = build_app(config)
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=config.server.shutdown_grace_s
    )
    await runner.setup()
    site = web.TCPSite(runner, config.server.host, config.server.port)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield RunningGateway(app, f"http://{config.server.host}:{port}", port)
    finally:
        await runner.cleanup()
