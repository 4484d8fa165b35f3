"""Shared fixtures: simulated engines and an in-process kvgate in front of them."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import pytest
import uvloop
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway.config import GatewayConfig
from gateway.config_load import load_config
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


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """`app` served on a free loopback port for the block: yields its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


TEARDOWN_GRACE_S = 10.0


def timeout_ending_loop() -> asyncio.AbstractEventLoop:
    """uvloop, made to end a test that pytest-timeout times out. uvloop runs the SIGALRM handler inside its own
    signal callback and logs what it raises (pytest's failure included), so a test hung on an idle loop ran on past
    its timeout until CI's limit. Here that failure prints every pending task's stack to stderr (where the test hung)
    and stops the loop, which fails the test ("Event loop stopped before Future completed"). The timeout is spent
    then (pytest-timeout cancels its alarm on a failure): a teardown still running on the loop TEARDOWN_GRACE_S later
    is stopped the same way, every TEARDOWN_GRACE_S, until the loop is closed."""
    loop = uvloop.new_event_loop()

    def stop_teardowns() -> None:
        while not loop.is_closed():
            time.sleep(TEARDOWN_GRACE_S)
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                loop.call_soon_threadsafe(loop.stop)

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not isinstance(context.get("exception"), pytest.fail.Exception):
            loop.default_exception_handler(context)
            return
        print(f"\n--- timed out: {len(asyncio.all_tasks(loop))} pending tasks ---", file=sys.stderr)
        for task in asyncio.all_tasks(loop):
            task.print_stack(file=sys.stderr)
        loop.stop()
        threading.Thread(target=stop_teardowns, name="teardown-watchdog", daemon=True).start()

    loop.set_exception_handler(handle)
    return loop


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Tests run on uvloop, as `kvgate serve` does (its transports differ from asyncio's)."""
    return {"uvloop": timeout_ending_loop}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


class TcpRelay:
    """A TCP relay to a local port, both ways, that holds every chunk `delay_s` before passing it on (a Redis at a
    network's distance) and keeps what the clients sent in `sent` (what reached the server). A connection it cannot
    open upstream is closed."""

    def __init__(self, port: int, delay_s: float = 0.0) -> None:
        self.target, self.delay_s, self.port = port, delay_s, 0
        self.sent = bytearray()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> TcpRelay:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            self._writers.discard(writer)
            return
        self._writers.add(up_writer)
        for src, dst, kept in ((reader, up_writer, self.sent), (up_reader, writer, None)):
            task = asyncio.create_task(self._pipe(src, dst, kept))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, kept: bytearray | None) -> None:
        try:
            while data := await reader.read(65536):
                if kept is not None:
                    kept += data
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
            self._writers.discard(writer)


async def scrape(http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> list[Sample]:
    """Every sample of the gateway's /metrics."""
    async with http.get(url + "/metrics", headers=headers) as resp:
        text = await resp.text()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


async def kept_after(warm_up: Awaitable[None], work: Awaitable[None]) -> int:
    """Bytes still allocated (tracemalloc) after `work` that were not before it, `warm_up` run first (what the first
    requests allocate once: buffers, free lists)."""
    await warm_up
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        await work
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
