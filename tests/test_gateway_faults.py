"""Engine faults as a client sees them through the real gateway: poison requests, streams cut or stalled by their
engine, long non-streamed generations, and timeouts that must not multiply the engine's work."""

from __future__ import annotations

import asyncio
import json
import socket
from types import SimpleNamespace
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.keys import COMPLETIONS, REPLICAS
from gateway.relay import ClientEvents
from gateway.request_parse import parse_request
from simengine import Faults, SimConfig
from tests.conftest import gateway_over_sims, scrape, wait_for

SIM = SimConfig(model="sim", instant=True)


async def requests_by_status(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvgate_requests_total":
                out[s.labels["status"]] = out.get(s.labels["status"], 0.0) + s.value
    return out


async def post(http: aiohttp.ClientSession, url: str, **body: Any) -> tuple[int, Any]:
    payload = {"model": "sim", "prompt": "hello", "max_tokens": 4, **body}
    async with http.post(url + "/v1/completions", json=payload) as resp:
        return resp.status, await resp.json()


async def test_requests_that_fail_on_every_engine_do_not_take_the_pool_out(http: aiohttp.ClientSession) -> None:
    """A body every engine answers 5xx is the client's problem: answered with the engine's error after two
    replicas refused it, and it opens no breaker, so good traffic right after it is served."""
    poison = SIM.model_copy(update={"faults": Faults(error_rate=1.0)})
    async with gateway_over_sims([poison, poison], retry={"breaker_failures": 3}) as (gw, sims):
        for _ in range(4):
            status, body = await post(http, gw.url)
            assert status == 500 and body["error"]["message"]
        assert sum(s.engine.stats.started for s in sims) == 8  # two replicas per request, not three attempts
        for sim in sims:
            async with http.post(f"{sim.url}/sim/faults", json={"error_rate": 0.0}) as resp:
                assert resp.status == 200
        status, body = await post(http, gw.url)
        assert status == 200, body


async def test_a_replica_that_fails_where_another_succeeds_is_counted_against(http: aiohttp.ClientSession) -> None:
    broken = SIM.model_copy(update={"faults": Faults(error_rate=1.0)})
    async with gateway_over_sims([broken, SIM], retry={"breaker_failures": 2}) as (gw, sims):
        for _ in range(6):
            status, _ = await post(http, gw.url)
            assert status == 200  # retried on the good replica
        tries_on_broken = sims[0].engine.stats.started
        assert 2 <= tries_on_broken < 6  # its breaker opened after two faults: it stopped getting traffic


@pytest.mark.parametrize("fault", ["cut", "stall"])
async def test_a_stream_its_engine_cuts_or_stalls_ends_with_an_error_event(
    fault: str, http: aiohttp.ClientSession
) -> None:
    faults = Faults(cut_after_tokens=3) if fault == "cut" else Faults(stall_after_tokens=3, stall_s=60)
    sim = SimConfig(model="sim", overhead_ms=0, prefill_us_per_token=0, decode_ms=5, faults=faults)
    async with gateway_over_sims([sim], timeouts={"stream_idle_s": 0.5}) as (gw, _):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
            stream = await client.completions.create(model="sim", prompt="hello", max_tokens=20, stream=True)
            texts: list[str] = []
            with pytest.raises(openai.APIError) as caught:
                async for chunk in stream:
                    texts.append(chunk.choices[0].text)
        assert texts and len(texts) <= 3  # the tokens that came, then the error, not a clean end
        code = "upstream_reset" if fault == "cut" else "stream_idle_timeout"
        assert code in str(caught.value.body) or code in str(caught.value)
        counted = await requests_by_status(http, gw.url)
        assert counted.get("200", 0) == 0 and counted.get("502" if fault == "cut" else "504") == 1


@pytest.mark.parametrize(("kind", "include_usage"), [("chat", False), ("chat", True), ("completions", False)])
async def test_a_stream_cut_after_its_answer_before_its_last_event_ends_whole(
    kind: str, include_usage: bool, http: aiohttp.ClientSession
) -> None:
    """The engine died as it finished: every token, the finish reason (and the usage asked for) reached the client,
    only `data: [DONE]` did not. The client gets a whole answer and a clean end, not an error event after a finished
    answer, and nothing is run again."""
    cut = SIM.model_copy(update={"faults": Faults(cut_before_end=True)})
    async with gateway_over_sims([cut, cut]) as (gw, sims):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
            options: dict[str, Any] = {"stream_options": {"include_usage": True}} if include_usage else {}
            if kind == "chat":
                messages: Any = [{"role": "user", "content": "hello"}]
                stream: Any = await client.chat.completions.create(
                    model="sim", messages=messages, max_tokens=5, stream=True, **options
                )
            else:
                stream = await client.completions.create(model="sim", prompt="hello", max_tokens=5, stream=True)
            chunks = [chunk async for chunk in stream]  # ends without an error
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["length"]
        assert (chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5) == include_usage
        assert sum(s.engine.stats.started for s in sims) == 1
        assert (await requests_by_status(http, gw.url)) == {"200": 1.0}


async def test_a_cut_chat_stream_ends_with_its_error_event_then_done_as_vllms(http: aiohttp.ClientSession) -> None:
    """vLLM ends a chat or completions stream that failed with its error event and then `data: [DONE]` (clients
    that read until `[DONE]` end there); kvgate ends a stream whose engine failed the same way."""
    cut = SimConfig(model="sim", overhead_ms=0, prefill_us_per_token=0, decode_ms=5, faults=Faults(cut_after_tokens=3))
    async with gateway_over_sims([cut], retry={"migrate_streams": False}) as (gw, _):
        body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}
        async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
            events = [e for e in (await resp.read()).split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        assert b'"code":"upstream_reset"' in events[-2] and events[-2].startswith(b'data: {"error"')


async def test_a_steady_stream_longer_than_many_idle_windows_is_not_cut(http: aiohttp.ClientSession) -> None:
    """The idle window bounds the silence between chunks, not the stream: tokens 0.1 s apart for ~2 s under a
    0.6 s window (moved out once in a while rather than per chunk) all arrive, and the stream ends cleanly."""
    slow = SimConfig(model="sim", overhead_ms=0, prefill_us_per_token=0, decode_ms=100)
    async with gateway_over_sims([slow], timeouts={"stream_idle_s": 0.6}) as (gw, _):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
            stream = await client.completions.create(model="sim", prompt="hello", max_tokens=20, stream=True)
            texts = [chunk.choices[0].text async for chunk in stream if chunk.choices]
        assert len([t for t in texts if t]) == 20
        assert (await requests_by_status(http, gw.url)) == {"200": 1.0}


async def test_a_non_streamed_generation_longer_than_first_byte_s_succeeds(http: aiohttp.ClientSession) -> None:
    """A whole answer's headers come when the generation is done: first_byte_s must not bound it."""
    slow = SimConfig(model="sim", overhead_ms=0, prefill_us_per_token=0, decode_ms=25)
    async with gateway_over_sims([slow, slow], timeouts={"first_byte_s": 0.2}) as (gw, sims):
        status, body = await post(http, gw.url, max_tokens=30)  # about 0.75 s of decoding
        assert status == 200 and body["usage"]["completion_tokens"] == 30
        assert sum(s.engine.stats.started for s in sims) == 1


async def test_a_non_streamed_timeout_is_not_rerun_on_other_replicas(http: aiohttp.ClientSession) -> None:
    stalled = SIM.model_copy(update={"faults": Faults(stall_s=30, stall_rate=1.0)})
    async with gateway_over_sims([stalled, stalled], timeouts={"total_s": 0.5}) as (gw, sims):
        status, body = await post(http, gw.url)
        assert status == 504 and body["error"]["code"] == "upstream_timeout"
        assert sum(s.engine.stats.started for s in sims) == 1


async def test_a_stream_past_its_total_deadline_before_its_first_token_is_not_rerun_nor_blamed(
    http: aiohttp.ClientSession,
) -> None:
    """total_s shorter than first_byte_s, and engines slower than both to a first token: the request's own deadline
    passed, with no time left for another replica; one engine ran it, and no replica's breaker counts it."""
    slow = SimConfig(model="sim", overhead_ms=1500)
    async with gateway_over_sims([slow, slow, slow], timeouts={"total_s": 0.5, "first_byte_s": 10}) as (gw, sims):
        body = {"model": "sim", "prompt": "hi", "max_tokens": 4, "stream": True}
        async with http.post(gw.url + "/v1/completions", json=body) as resp:
            assert resp.status == 504 and (await resp.json())["error"]["code"] == "total_timeout"
        assert sum(s.engine.stats.started for s in sims) == 1
        assert all(r.consecutive_failures == 0 for r in gw.app[REPLICAS])


async def test_a_client_that_takes_nothing_of_its_stream_is_disconnected_without_blaming_the_engine(
    http: aiohttp.ClientSession,
) -> None:
    """A client that stops reading a long stream for stream_idle_s: its connection is closed (a 499), the engine
    request ends with it, and neither the replica's breaker nor a migration to another replica follows (its
    stall was taken for the engine's: a slow reader could open every breaker)."""
    fast = SimConfig(model="sim", decode_ms=0.2, max_model_len=65536)
    async with gateway_over_sims([fast, fast], timeouts={"stream_idle_s": 0.5}) as (gw, sims):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", gw.port))
        body = json.dumps({"model": "sim", "prompt": "hi", "max_tokens": 20000, "stream": True}).encode()
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        await asyncio.get_running_loop().sock_sendall(sock, head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        try:  # and reads nothing
            completions = gw.app[COMPLETIONS]
            await wait_for(lambda: completions.in_flight > 0, 10.0, "the request running")
            await wait_for(lambda: completions.in_flight == 0, 30.0, "the request ended with its client")
        finally:
            sock.close()
        samples = await scrape(http, gw.url)
        statuses = {s.labels["status"] for s in samples if s.name == "kvgate_requests_total" and s.value}
        assert statuses == {"499"}
        assert not [s for s in samples if s.name == "kvgate_upstream_errors_total" and s.value]
        assert sum(s.engine.stats.started for s in sims) == 1
        assert all(r.consecutive_failures == 0 for r in gw.app[REPLICAS])


@pytest.mark.parametrize(
    ("body", "whole"),
    [
        ({"prompt": "a"}, True),
        ({"prompt": [1, 2, 3]}, True),  # one prompt of token ids
        ({"prompt": ["a"]}, True),
        ({"prompt": ["a", "b"]}, False),  # a batch: the other prompt's choice may still be open
        ({"prompt": "a", "n": 2}, False),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, False),  # its usage event was still to come
    ],
)
def test_a_finish_event_makes_a_cut_completions_stream_whole_only_with_one_choice_and_no_usage_to_come(
    body: dict[str, Any], whole: bool
) -> None:
    parsed = parse_request("completions", json.dumps({"model": "m", "stream": True, **body}).encode(), max_depth=64)
    ex = SimpleNamespace(parsed=parsed, out=SimpleNamespace(started=True), info=SimpleNamespace(session_key=None))
    client = ClientEvents(ex, SimpleNamespace(observe=lambda _: None))  # type: ignore[arg-type]
    client.last = b'data: {"id":"c","choices":[{"index":0,"text":"x","finish_reason":"length"}]}\n\n'
    assert (client.closing() == b"data: [DONE]\n\n") is whole


@pytest.mark.parametrize("route", ["chat", "completions", "messages"])
async def test_a_cut_stream_is_charged_the_tokens_its_client_got(route: str, http: aiohttp.ClientSession) -> None:
    """The engine dies after five tokens (not migrated): the client got five, and five are counted, whatever events
    come before the first token (chat's role, the Messages API's message_start and content_block_start; none in
    completions: one token was lost there, one added in Messages)."""
    cut = SimConfig(model="sim", overhead_ms=0, prefill_us_per_token=0, decode_ms=5, faults=Faults(cut_after_tokens=5))
    async with gateway_over_sims([cut], retry={"migrate_streams": False}) as (gw, _):
        body: dict[str, Any] = {"model": "sim", "max_tokens": 20, "stream": True}
        if route == "completions":
            path, body["prompt"] = "/v1/completions", "hi"
        else:
            path = "/v1/chat/completions" if route == "chat" else "/v1/messages"
            body["messages"] = [{"role": "user", "content": "hi"}]
        async with http.post(gw.url + path, json=body) as resp:
            await resp.read()
        async with http.get(gw.url + "/metrics") as resp:
            text = await resp.text()
    completion = sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "kvgate_tokens_total" and s.labels["kind"] == "completion"
    )
    assert completion == 5


async def test_a_replica_removed_for_good_takes_its_series_with_it(http: aiohttp.ClientSession) -> None:
    """Engines found by DNS come and go: each one's request and error series stayed for the life of the process."""
    failing = SimConfig(model="sim", instant=True, faults=Faults(error_rate=1.0))
    async with gateway_over_sims([SimConfig(model="sim", instant=True), failing]) as (gw, _):
        body = {"model": "sim", "prompt": "hi", "max_tokens": 2}
        for _ in range(6):  # both replicas answer (the failing one's errors retried on the other)
            async with http.post(gw.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
        replicas = gw.app[REPLICAS]
        failed = {s.labels["replica"] for s in await scrape(http, gw.url) if s.name == "kvgate_upstream_errors_total"}
        (gone,) = failed
        await replicas.remove(gone)
        after = await scrape(http, gw.url)
    assert not [s for s in after if s.labels.get("replica") == gone], gone
    assert any(s.name == "kvgate_requests_total" and s.value > 0 for s in after)  # the other replica's stay


async def test_a_whole_answer_over_max_answer_bytes_is_cut_off_with_502_and_not_rerun(
    http: aiohttp.ClientSession,
) -> None:
    """An engine's whole answer is read up to `server.max_answer_bytes`: a larger one is cut off (not grown until
    the total deadline), the client gets 502 in OpenAI's shape, and another replica is not asked (it would answer
    the same); a smaller answer passes."""
    async with gateway_over_sims([SIM, SIM], server={"max_answer_bytes": 2048}) as (gw, sims):
        status, body = await post(http, gw.url, max_tokens=4)
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        status, body = await post(http, gw.url, max_tokens=1000)
        assert status == 502 and body["error"]["code"] == "upstream_error"
        assert "server.max_answer_bytes (2048 bytes)" in body["error"]["message"]
        assert sum(s.engine.stats.started for s in sims) == 2
        status, body = await post(http, gw.url, max_tokens=4)  # the pool is still whole
        assert status == 200
        assert (await requests_by_status(http, gw.url)) == {"200": 2.0, "502": 1.0}
