"""The engine client's bounds on what it reads (engine_pool.http_client)."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from engine_pool.http_client import ResponseTooLarge, UpstreamClient


async def test_a_fetched_body_over_its_bound_fails_and_one_within_it_is_read() -> None:
    """A scrape or probe reads at most `max_bytes`: an engine's endless page fails the fetch (a ConnectionError, as
    its callers expect of a broken engine) instead of growing in the gateway's memory."""

    async def page(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * int(request.query["n"]))

    app = web.Application()
    app.router.add_get("/page", page)
    async with TestServer(app) as server:
        client = UpstreamClient()
        url = str(server.make_url("/page"))
        assert await client.fetch("GET", url + "?n=1000", timeout_s=5, max_bytes=1000) == (200, b"x" * 1000)
        with pytest.raises(ResponseTooLarge) as failed:
            await client.fetch("GET", url + "?n=5000000", timeout_s=5, max_bytes=1_000_000)
        assert isinstance(failed.value, ConnectionError) and failed.value.limit == 1_000_000
        assert await client.fetch("GET", url + "?n=10", timeout_s=5) == (200, b"x" * 10)  # the pool still works
        client.close()
