"""The fast lane (gateway.lane) against real simulated engines: which requests it answers itself, and how it hands
the others, and its own failures, to `CompletionService.handle` in a task."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from engine_pool.sim import Faults, SimConfig
from gateway import completion
from gateway.http1 import DateHeader
from gateway.keys import ADMISSION, COMPLETIONS, REPLICAS
from gateway.lane import Handler, Lane, dispatch
from gateway.request_parse import Endpoint, ParsedRequest, parse_request
from gateway.responder import FastResponder
from tests.conftest import gateway_over_sims, wait_for

SIM = SimConfig(model="sim", instant=True)


class _Transport:
    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return False


class _Server:
    date = DateHeader()


class _Request:
    keep_alive = True
    http10 = False


class _Connection:
    """The fast path's connection as a lane and its responder see it: records the answer and the hand-overs."""

    def __init__(self) -> None:
        self.transport = _Transport()
        self.server = _Server()
        self.write_paused = False
        self.closing = False
        self.tasks: list[asyncio.Task[None]] = []
        self.answered = asyncio.Event()  # by the lane itself
        self.settled = asyncio.Event()  # answered by the lane, or handed to a task

    async def drain(self) -> None:
        return None

    def run_handler(self, handler: Handler, out: FastResponder) -> None:
        self.tasks.append(asyncio.ensure_future(handler))
        self.settled.set()

    def lane_done(self, out: FastResponder) -> None:
        self.answered.set()
        self.settled.set()

    def status(self) -> int:
        return int(self.transport.data.split(b" ", 2)[1])

    def json(self) -> Any:
        return json.loads(self.transport.data.partition(b"\r\n\r\n")[2])


def _dispatch(gw: Any, conn: _Connection, body: dict[str, Any]) -> Lane | Handler:
    out = FastResponder(conn, _Request(), "req-1")
    raw = json.dumps(body).encode()
    return dispatch(gw.app[COMPLETIONS], "completions", {}, raw, "req-1", out, conn)


async def _warm(http: aiohttp.ClientSession, url: str, n: int) -> None:
    """Requests through the gateway, so that each replica has an idle kept-alive connection for the lane."""
    for _ in range(n):
        async with http.post(url + "/v1/completions", json={"model": "sim", "prompt": "x"}) as resp:
            await resp.read()


async def test_the_lane_answers_a_plain_request_without_a_task(http: aiohttp.ClientSession) -> None:
    async with gateway_over_sims([SIM]) as (gw, sims):
        await _warm(http, gw.url, 1)
        conn = _Connection()
        running = _dispatch(gw, conn, {"model": "sim", "prompt": "hello", "max_tokens": 3})
        assert isinstance(running, Lane)
        await asyncio.wait_for(conn.answered.wait(), 10)
        assert conn.status() == 200 and conn.json()["usage"]["completion_tokens"] == 3
        assert conn.tasks == [] and sims[0].engine.stats.completed == 2


async def test_streams_and_invalid_requests_go_to_a_task(http: aiohttp.ClientSession) -> None:
    async with gateway_over_sims([SIM]) as (gw, _):
        await _warm(http, gw.url, 1)
        cases: list[tuple[dict[str, Any], int]] = [
            ({"model": "sim", "prompt": "x", "stream": True}, 200),
            ({"model": "sim"}, 400),
            ({"model": "nope", "prompt": "x"}, 404),
        ]
        for body, status in cases:
            conn = _Connection()
            running = _dispatch(gw, conn, body)
            assert not isinstance(running, Lane), body
            await running
            assert conn.status() == status, body


async def test_a_failed_first_attempt_leaves_the_lane_and_is_retried(http: aiohttp.ClientSession) -> None:
    async with gateway_over_sims([SIM, SIM], routing={"policy": "round-robin"}) as (gw, sims):
        await _warm(http, gw.url, 2)  # both replicas hold an idle connection
        conn = _Connection()
        running = _dispatch(gw, conn, {"model": "sim", "prompt": "x"})
        assert isinstance(running, Lane) and running.begun.first is not None
        chosen = running.begun.first.replica.url
        broken = next(s for s in sims if s.url == chosen)
        broken.engine.set_faults(Faults(error_rate=1.0))  # the engine has not read the request yet: it fails it
        await asyncio.wait_for(conn.settled.wait(), 10)
        assert len(conn.tasks) == 1  # the engine's 500 handed the request to `handle`...
        await conn.tasks[0]
        assert conn.status() == 200  # ...which retried it on the other replica
        assert broken.engine.stats.failed == 1 and sum(s.engine.stats.completed for s in sims) == 3


async def test_cancelling_a_lane_aborts_the_engine_request_and_ends_the_request(http: aiohttp.ClientSession) -> None:
    async with gateway_over_sims([SIM]) as (gw, sims):
        await _warm(http, gw.url, 1)
        engine = sims[0].engine
        engine.set_faults(Faults(stall_s=30, stall_rate=1.0))
        conn = _Connection()
        running = _dispatch(gw, conn, {"model": "sim", "prompt": "x"})
        assert isinstance(running, Lane)
        await wait_for(lambda: engine.stats.started == 2, what="the engine has the request")
        running.cancel()  # what the fast path does when the client leaves
        await wait_for(lambda: engine.stats.cancelled == 1, what="the engine saw the cancellation")
        assert conn.settled.is_set() and conn.tasks == [] and conn.transport.data == b""
        replica = next(iter(gw.app[REPLICAS]))
        assert replica.in_flight == 0 and gw.app[ADMISSION].tenant_in_flight("anonymous") == 0
        metrics = await (await http.get(gw.url + "/metrics")).text()
        assert 'kvgate_client_disconnects_total{model="sim"} 1.0' in metrics


async def test_a_bug_in_the_lane_is_a_500_and_the_request_still_ends(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with gateway_over_sims([SIM]) as (gw, _):
        await _warm(http, gw.url, 1)
        proxy = gw.app[COMPLETIONS].proxy

        def broken(*args: object) -> dict[str, str]:
            raise RuntimeError("boom")

        monkeypatch.setattr(proxy, "answer_headers", broken)
        conn = _Connection()
        running = _dispatch(gw, conn, {"model": "sim", "prompt": "x"})
        assert isinstance(running, Lane)
        await asyncio.wait_for(conn.answered.wait(), 10)  # the connection moves on
        assert conn.status() == 500 and conn.json()["error"]["type"] == "internal_error"
        replica = next(iter(gw.app[REPLICAS]))
        assert replica.in_flight == 0 and gw.app[ADMISSION].tenant_in_flight("anonymous") == 0
        assert "fast lane: request req-1 failed" in caplog.text


async def test_a_stream_is_parsed_once_and_sent_upstream_before_its_task_runs(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with gateway_over_sims([SIM]) as (gw, sims):
        await _warm(http, gw.url, 1)
        parses: list[bytes] = []

        def counting_parse(endpoint: Endpoint, raw: bytes) -> ParsedRequest:
            parses.append(raw)
            return parse_request(endpoint, raw)

        monkeypatch.setattr(completion, "parse_request", counting_parse)
        conn = _Connection()
        running = _dispatch(gw, conn, {"model": "sim", "prompt": "x", "stream": True})
        assert not isinstance(running, Lane)
        await wait_for(lambda: sims[0].engine.stats.started == 2, what="the engine has the stream, no task yet")
        await running
        assert conn.status() == 200 and b"data: [DONE]" in conn.transport.data
        assert len(parses) == 1
