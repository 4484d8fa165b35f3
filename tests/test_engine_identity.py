"""Engines that are not what the configuration says: an address with nothing listening, an HTTP server that is not
an engine, an engine that now serves another model. Each is named in a warning with its reason and never routed to,
and none of them keeps the gateway from ready while the engines that do serve are ready."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from engine_pool.launcher import free_port
from gateway.embedded import running_gateway
from gateway.keys import REPLICAS
from simengine import SimConfig, run_sim_engine
from tests.conftest import gateway_config, serving, wait_for

SIM = SimConfig(model="sim", instant=True)
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@asynccontextmanager
async def not_an_engine() -> AsyncIterator[str]:
    """A web server that answers 200 to everything, with HTML."""

    async def page(request: web.Request) -> web.Response:
        return web.Response(text="<html>hello</html>", content_type="text/html")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", page)
    async with serving(app) as url:
        yield url


async def test_engines_that_are_not_engines_are_named_and_never_routed_to(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvgate.replicas")
    dead = f"http://127.0.0.1:{free_port()}"
    async with (
        run_sim_engine(SIM) as sim,
        not_an_engine() as html,
        not_an_engine() as html_named,
        aiohttp.ClientSession() as http,
    ):
        engines = [{"url": sim.url}, {"url": dead}, {"url": html}, {"url": html_named, "model": "sim"}]
        async with running_gateway(gateway_config([], engines=engines)) as gw:
            bad = (dead, html, html_named)
            await wait_for(lambda: all(f"({url}) is not routed to" in caplog.text for url in bad), what="warnings")
            assert "not an OpenAI model list" in caplog.text
            async with http.get(gw.url + "/ready") as resp:
                assert resp.status == 200  # the engine that serves is ready
            for _ in range(6):
                async with http.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                    assert resp.status == 200 and resp.headers["x-kvgate-replica"] == sim.url.split("://")[1]


async def test_an_engine_that_comes_back_serving_another_model_leaves_its_models_pool(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvgate.replicas")
    port = free_port()
    async with run_sim_engine(SIM) as other, aiohttp.ClientSession() as http:
        engines = [{"url": other.url}, {"url": f"http://127.0.0.1:{port}"}]
        cfg = gateway_config([], engines=engines, health={"interval_s": 0.05})
        async with running_gateway(cfg) as gw:
            replica = next(r for r in gw.app[REPLICAS] if r.port == port)
            async with run_sim_engine(SIM.model_copy(update={"port": port})):
                await wait_for(lambda: replica.healthy, what="the engine serving sim")
            async with run_sim_engine(SimConfig(model="llama", instant=True, port=port)):
                await wait_for(lambda: "serves ['llama'], not 'sim'" in caplog.text, what="the other model seen")
                assert not replica.healthy
                for _ in range(4):
                    async with http.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                        assert resp.status == 200 and resp.headers["x-kvgate-replica"] == other.url.split("://")[1]
