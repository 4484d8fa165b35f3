"""What an engine answers, as the client gets it through the gateway, for answers a healthy vLLM gives rarely or an
unhealthy engine gives: a binary answer keeps its type, a body that is not the JSON it claims and a status no API
answers with are the replica's failure (retried elsewhere, 502 when none is left), a stream that breaks after it
started counts against its replica, vLLM's own error event in a stream is recorded as a failed request, and
FastAPI's `{"detail": ...}` errors keep their message. The misbehaving engine is a small aiohttp app of the test
(it speaks the routes a gateway needs: /health, /v1/models, /v1/completions), beside the simulated engine."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web

from gateway.embedded import RunningGateway, running_gateway
from gateway.keys import REGISTRY, REPLICAS
from simengine import Faults, SimConfig, run_sim_engine
from tests.conftest import gateway_config, gateway_over_sims, scrape, serving, wait_for

MODEL = "sim"
Answer = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def fake_engine(answer: Answer) -> AsyncIterator[tuple[str, list[int]]]:
    """An engine serving MODEL whose completions are `answer`'s; yields its URL and the count of completions."""
    calls = [0]

    async def completions(request: web.Request) -> web.StreamResponse:
        calls[0] += 1
        await request.read()
        return await answer(request)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", completions)
    app.router.add_post("/v1/messages", completions)
    app.router.add_post("/v1/responses", completions)
    async with serving(app) as url:
        yield url, calls


@asynccontextmanager
async def gateway_over(urls: list[str], **overrides: Any) -> AsyncIterator[RunningGateway]:
    engines = [{"url": url, "model": MODEL} for url in urls]
    config = gateway_config([], engines=engines, routing={"policy": "round-robin"}, **overrides)
    async with running_gateway(config) as gw:
        replicas = gw.app[REPLICAS]
        await wait_for(lambda: all(r.routable(time.monotonic()) for r in replicas), what="replicas ready")
        yield gw


async def upstream_errors(http: aiohttp.ClientSession, gw: RunningGateway, kind: str) -> float:
    samples = await scrape(http, gw.url)
    return sum(s.value for s in samples if s.name == "kvgate_upstream_errors_total" and s.labels["kind"] == kind)


async def complete(
    http: aiohttp.ClientSession, gw: RunningGateway, route: str = "completions"
) -> tuple[int, aiohttp.typedefs.LooseHeaders, bytes]:
    body = (
        {"model": MODEL, "prompt": "hello", "max_tokens": 4}
        if route == "completions"
        else {"model": MODEL, "input": "hi"}
    )
    async with http.post(f"{gw.url}/v1/{route}", json=body) as resp:
        return resp.status, resp.headers, await resp.read()


async def html(_: web.Request) -> web.StreamResponse:
    return web.Response(text="<html><body>502 Bad Gateway</body></html>", content_type="application/json")


async def html_page(_: web.Request) -> web.StreamResponse:  # said to be HTML: a completion must be JSON anyway
    return web.Response(text="<html><body>maintenance</body></html>", content_type="text/html")


async def redirect(_: web.Request) -> web.StreamResponse:
    return web.Response(status=302, headers={"Location": "http://evil.example/"}, content_type="application/json")


@pytest.mark.parametrize("answer", [html, html_page, redirect], ids=["html-as-json", "html", "302"])
async def test_an_answer_that_is_no_api_answer_is_retried_elsewhere_then_502(
    answer: Answer, http: aiohttp.ClientSession
) -> None:
    async with fake_engine(answer) as (bad, calls), run_sim_engine(SimConfig(model=MODEL, instant=True)) as good:
        async with gateway_over([bad, good.url]) as gw:
            for _ in range(2):  # round-robin: one of them goes to the bad engine first, then to the good one
                status, headers, raw = await complete(http, gw)
                assert status == 200 and b'"choices"' in raw and "Location" not in headers
            kind = "bad_status" if answer is redirect else "not_json"
            assert await upstream_errors(http, gw, kind) == calls[0] >= 1  # each answer it gave counted against it
        async with gateway_over([bad]) as gw:  # nothing else to ask: the client's 502, never the engine's page
            status, headers, raw = await complete(http, gw)
            assert status == 502 and "Location" not in headers
            assert b"upstream_error" in raw and b"<html>" not in raw


async def test_a_binary_answer_keeps_its_content_type(http: aiohttp.ClientSession) -> None:
    """vLLM's embeddings with encoding_format bytes answer application/octet-stream: the client gets that type."""
    floats = bytes(range(16))

    async def octets(_: web.Request) -> web.StreamResponse:
        return web.Response(body=floats, content_type="application/octet-stream", headers={"metadata": "{}"})

    async with fake_engine(octets) as (url, _), gateway_over([url]) as gw:
        status, headers, raw = await complete(http, gw, "embeddings")
    assert (status, headers["Content-Type"], raw, headers["metadata"]) == (
        200,
        "application/octet-stream",
        floats,
        "{}",
    )


async def test_fastapis_detail_errors_keep_their_message(http: aiohttp.ClientSession) -> None:
    async def not_found(_: web.Request) -> web.StreamResponse:
        return web.json_response({"detail": "Not Found"}, status=404)

    async with fake_engine(not_found) as (url, _), gateway_over([url]) as gw:
        status, _, raw = await complete(http, gw)
    assert status == 404 and b'"message":"Not Found"' in raw


async def test_vllms_own_error_event_in_a_stream_is_a_failed_request(http: aiohttp.ClientSession) -> None:
    """vLLM ends a stream that failed on the way with an error event, then `[DONE]`: relayed as it came (the SDK
    raises it), and the request is recorded as failed, not as a 200."""

    async def error_event(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"a"}]}\n\n')
        await resp.write(b'data: {"error": {"object": "error", "message": "grammar failed", "code": 400}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async with fake_engine(error_event) as (url, _), gateway_over([url]) as gw:
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
            stream = await client.completions.create(model=MODEL, prompt="hello", max_tokens=4, stream=True)
            with pytest.raises(openai.APIError, match="grammar failed"):
                async for _ in stream:
                    pass
        (replica,) = list(gw.app[REPLICAS])
        labels = {"model": MODEL, "replica": replica.id, "endpoint": "completions", "status": "502"}
        assert gw.app[REGISTRY].get_sample_value("kvgate_requests_total", labels) == 1


def _anthropic_event(kind: str, **payload: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n".encode()


async def test_a_messages_stream_whose_last_events_arrive_together_with_a_chat_terminator_ends_whole(
    http: aiohttp.ClientSession,
) -> None:
    """Engines that turn a chat stream into Anthropic's (some vLLM releases) write `data: [DONE]` right after
    `message_stop`; arriving in one read with the closing events, the stream is whole (the SDK's final message, a
    200), not cut short (an error event after message_stop, a 502), and the client never sees the chat terminator."""
    start = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": MODEL,
             "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 5, "output_tokens": 0}}  # fmt: skip

    async def messages(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_anthropic_event("message_start", message=start))
        await resp.write(_anthropic_event("content_block_start", index=0, content_block={"type": "text", "text": ""}))
        await resp.write(_anthropic_event("content_block_delta", index=0, delta={"type": "text_delta", "text": "hi"}))
        await resp.write(
            _anthropic_event("content_block_stop", index=0)
            + _anthropic_event("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 1})
            + _anthropic_event("message_stop")
            + b"data: [DONE]\n\n"
        )
        return resp

    async with fake_engine(messages) as (url, _), gateway_over([url]) as gw:
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="x", max_retries=0) as client:
            messages_ = [{"role": "user", "content": "x"}]
            async with client.messages.stream(model=MODEL, max_tokens=8, messages=messages_) as stream:
                message = await stream.get_final_message()
        assert message.stop_reason == "end_turn" and message.content[0].text == "hi"
        body = {"model": MODEL, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "x"}]}
        async with http.post(gw.url + "/v1/messages", json=body) as resp:
            raw = await resp.read()
        assert raw.endswith(b'event: message_stop\ndata: {"type": "message_stop"}\n\n') and b"[DONE]" not in raw
        (replica,) = list(gw.app[REPLICAS])
        labels = {"model": MODEL, "replica": replica.id, "endpoint": "messages", "status": "200"}
        assert gw.app[REGISTRY].get_sample_value("kvgate_requests_total", labels) == 2


def _responses_event(kind: str, seq: int, **payload: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **payload})}\n\n".encode()


async def test_a_responses_stream_starts_with_the_engines_work_not_with_its_preamble(
    http: aiohttp.ClientSession,
) -> None:
    """vLLM's Responses stream sends response.created and response.in_progress before the engine runs anything:
    held back, they start nothing, so a queue and prefill longer than stream_idle_s (not first_byte_s) is waited
    for, and a replica that fails before its first token is retried on another, whose response the client gets."""
    calls = [0]

    async def responses(request: web.Request) -> web.StreamResponse:
        calls[0] += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        rid = f"resp_{calls[0]}"
        opened = {"response": {"id": rid, "object": "response", "status": "in_progress", "output": []}}
        await resp.write(_responses_event("response.created", 0, **opened))
        await resp.write(_responses_event("response.in_progress", 1, **opened))
        if calls[0] == 1:
            assert request.transport is not None
            request.transport.abort()  # the first replica fails before its first token
            return resp
        await asyncio.sleep(0.6)  # its queue and prefill: longer than stream_idle_s
        delta = {"delta": "hi", "item_id": "m", "output_index": 0, "content_index": 0}
        await resp.write(_responses_event("response.output_text.delta", 2, **delta))
        usage = {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}
        done = {"response": {"id": rid, "object": "response", "status": "completed", "output": [], "usage": usage}}
        await resp.write(_responses_event("response.completed", 3, **done))
        return resp

    async with fake_engine(responses) as (one, _), fake_engine(responses) as (two, _):
        async with gateway_over([one, two], timeouts={"stream_idle_s": 0.3, "first_byte_s": 10}) as gw:
            body = {"model": MODEL, "input": "hi", "stream": True}
            async with http.post(gw.url + "/v1/responses", json=body) as resp:
                raw = await resp.read()
        assert b"event: error" not in raw and raw.count(b"event: response.created") == 1
        assert b'"resp_2"' in raw and b'"resp_1"' not in raw and b"event: response.completed" in raw
        assert calls[0] == 2


async def test_a_replica_whose_streams_stall_after_they_start_is_taken_out(http: aiohttp.ClientSession) -> None:
    """Each stream of the stalling replica starts, then goes silent: that is its failure each time (a started stream
    was counted a success, so the breaker never opened and every other stream waited stream_idle_s there)."""
    stalling = SimConfig(model=MODEL, decode_ms=2, faults=Faults(stall_after_tokens=2, stall_s=60))
    good = SimConfig(model=MODEL, decode_ms=2)
    retry = {"breaker_failures": 2, "breaker_cooldown_s": 600}
    async with gateway_over_sims(
        [stalling, good], routing={"policy": "round-robin"}, timeouts={"stream_idle_s": 0.3}, retry=retry
    ) as (gw, sims):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
            for _ in range(8):
                stream = await client.completions.create(model=MODEL, prompt="hello", max_tokens=8, stream=True)
                async for _ in stream:  # each one whole: a stalled one continues on the good replica
                    pass
        assert sims[0].engine.stats.started == 2  # two stalls opened its breaker: no stream went there after


async def test_an_engines_5xx_reaches_the_client_with_its_retry_after(http: aiohttp.ClientSession) -> None:
    async def busy(_: web.Request) -> web.StreamResponse:
        body = {"error": {"message": "engine sleeping", "type": "ServiceUnavailable", "code": 503}}
        return web.json_response(body, status=503, headers={"Retry-After": "7"})

    async with fake_engine(busy) as (url, _), gateway_over([url]) as gw:
        status, headers, raw = await complete(http, gw)
    assert (status, headers["Retry-After"], "x-kvgate-replica" in headers) == (503, "7", True)
    assert b"engine sleeping" in raw


async def test_an_answer_that_breaks_http_is_a_502_sent_once(http: aiohttp.ClientSession) -> None:
    """A head past the client's bound (engine_pool.http_client): 502, counted as the replica's `protocol` failure,
    and the engine asked once per request (no second try on a fresh connection, which would get the same)."""

    async def huge_head(_: web.Request) -> web.StreamResponse:
        return web.json_response({"choices": []}, headers={"X-Big": "a" * 100_000})

    async with fake_engine(huge_head) as (url, calls), gateway_over([url]) as gw:
        for _ in range(3):
            status, _, raw = await complete(http, gw)
            assert status == 502 and b"a" * 1000 not in raw
        assert calls[0] == 3 and await upstream_errors(http, gw, "protocol") == 3


async def test_an_engines_429_is_retried_on_another_replica_and_relayed_when_all_are_busy(
    http: aiohttp.ClientSession,
) -> None:
    """A replica answering 429 (an engine or the ingress in front of it at its limit) is busy, not broken: the
    request goes to another replica, and the busy one is not taken out of routing; when every replica is busy the
    client gets the last 429 with its Retry-After."""

    async def busy(_: web.Request) -> web.StreamResponse:
        body = {"error": {"message": "too many requests", "type": "RateLimitError", "code": 429}}
        return web.json_response(body, status=429, headers={"Retry-After": "3"})

    retry = {"breaker_failures": 2, "breaker_cooldown_s": 600}
    async with AsyncExitStack() as es:
        busy_url, busy_calls = await es.enter_async_context(fake_engine(busy))
        sim = await es.enter_async_context(run_sim_engine(SimConfig(model=MODEL, instant=True)))
        gw = await es.enter_async_context(gateway_over([busy_url, sim.url], retry=retry))
        busy_id = next(r.id for r in gw.app[REPLICAS] if r.url == busy_url)
        for _ in range(6):  # round-robin: every other request is sent to the busy replica first
            status, headers, _ = await complete(http, gw)
            assert status == 200 and headers["x-kvgate-replica"] != busy_id
        assert busy_calls[0] >= 3  # still routed to after two 429s: no breaker opened (it would stop at 2)
        assert await upstream_errors(http, gw, "http_429") == busy_calls[0]
    async with fake_engine(busy) as (a, _), fake_engine(busy) as (b, _), gateway_over([a, b]) as gw:
        status, headers, raw = await complete(http, gw)
    assert (status, headers["Retry-After"]) == (429, "3") and b"too many requests" in raw


async def test_a_stream_continues_past_a_busy_replica_without_spending_its_migration(
    http: aiohttp.ClientSession,
) -> None:
    """One migration allowed. The stream's engine dies after 3 tokens; the continuation is first sent to a replica
    that answers 429 (busy: it ran nothing), then to one that serves it: the stream completes."""

    async def busy(_: web.Request) -> web.StreamResponse:
        body = {"error": {"message": "too many requests", "type": "RateLimitError", "code": 429}}
        return web.json_response(body, status=429)

    async with AsyncExitStack() as es:
        dying = await es.enter_async_context(
            run_sim_engine(SimConfig(model=MODEL, decode_ms=5, faults=Faults(cut_after_tokens=3)))
        )
        busy_url, busy_calls = await es.enter_async_context(fake_engine(busy))
        healthy = await es.enter_async_context(run_sim_engine(SimConfig(model=MODEL, decode_ms=5)))
        # round-robin over the names' order: the first request goes to the second replica (b-dying), the
        # continuation to the first of those not tried (a-busy), then to c-healthy
        named = [("a-busy", busy_url), ("b-dying", dying.url), ("c-healthy", healthy.url)]
        engines = [{"url": url, "model": MODEL, "name": name} for name, url in named]
        config = gateway_config([], engines=engines, routing={"policy": "round-robin"}, retry={"max_migrations": 1})
        gw = await es.enter_async_context(running_gateway(config))
        await wait_for(lambda: all(r.routable(time.monotonic()) for r in gw.app[REPLICAS]), what="replicas ready")
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
            stream = await client.completions.create(model=MODEL, prompt="hello", max_tokens=8, stream=True)
            text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
        assert len(text.split()) == 8
        assert busy_calls[0] == 1 and dying.engine.stats.started == 1 and healthy.engine.stats.started == 1
