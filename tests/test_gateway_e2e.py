"""A real kvgate on loopback in front of simulated engines, driven by the official openai client."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.keys import REPLICAS
from simengine import Faults, SimConfig
from tests.conftest import gateway_over_sims, scrape, wait_for

SIM = SimConfig(model="sim", overhead_ms=1, prefill_us_per_token=1, decode_ms=1, block_size=16)
MESSAGES = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "hello there"}]


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_chat_and_completions_stream_and_not() -> None:
    async with gateway_over_sims([SIM, SIM]) as (gw, _), client(gw.url) as c:
        models = await c.models.list()
        assert [m.id for m in models.data] == ["sim"]

        chat = await c.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=7)  # type: ignore[arg-type]
        assert chat.choices[0].message.content and chat.usage is not None
        assert chat.usage.completion_tokens == 7 and chat.usage.prompt_tokens > 0

        comp = await c.completions.create(model="sim", prompt="once upon a time", max_tokens=5)
        assert comp.choices[0].text and comp.usage is not None and comp.usage.completion_tokens == 5

        chunks = [
            ch
            async for ch in await c.chat.completions.create(
                model="sim",
                messages=MESSAGES,
                max_tokens=6,
                stream=True,  # type: ignore[arg-type]
                stream_options={"include_usage": True},
            )
        ]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6

        # without include_usage the client sees no usage chunk (kvgate asked the engine for it and dropped it), also
        # when it asked for continuous_usage_stats alone (vLLM's rule: the running usage only with the usage event)
        for options in (None, {"continuous_usage_stats": True}):
            plain = [
                ch
                async for ch in await c.completions.create(
                    model="sim",
                    prompt="abc",
                    max_tokens=4,
                    stream=True,
                    stream_options=options,  # type: ignore[arg-type]
                )
            ]
            assert plain and all(ch.usage is None for ch in plain) and all(ch.choices for ch in plain)
        # an empty model name means none, as vLLM takes it
        empty = await c.completions.create(model="", prompt="x", max_tokens=2)
        assert empty.model == "sim"


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_the_system_fingerprint_reaches_the_client_where_the_engine_puts_it(kind: str) -> None:
    """vLLM's `system_fingerprint` is on the finish event of a stream without usage, on the usage event of one
    with it, and on a whole answer. kvgate asks the engine for the usage the client did not, which moves it to the
    usage event the client does not get: the client still gets it on the finish event, as directly from vLLM."""
    sim = SIM.model_copy(update={"system_fingerprint": "vllm-0.32-fp1"})
    async with gateway_over_sims([sim, sim]) as (gw, sims), client(gw.url) as via, client(sims[0].url) as direct:

        async def stream(c: openai.AsyncOpenAI, **options: object) -> list[tuple[str | None, bool, bool]]:
            """(fingerprint, finishes, usage) of each chunk."""
            args: dict[str, Any] = {"model": "sim", "max_tokens": 4, "stream": True, **options}
            if kind == "chat":
                chunks = [c async for c in await c.chat.completions.create(messages=MESSAGES, **args)]
            else:
                chunks = [c async for c in await c.completions.create(prompt="once upon a time", **args)]
            return [(c.system_fingerprint, bool(c.choices and c.choices[0].finish_reason), c.usage is not None)
                    for c in chunks]  # fmt: skip

        plain, counted = await stream(via), await stream(via, stream_options={"include_usage": True})
        assert plain == await stream(direct)
        assert [fp for fp, finishes, _ in plain if finishes] == ["vllm-0.32-fp1"]
        assert counted == await stream(direct, stream_options={"include_usage": True})
        assert counted[-1] == ("vllm-0.32-fp1", False, True)
        if kind == "chat":
            whole: Any = await via.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=2)
        else:
            whole = await via.completions.create(model="sim", prompt="x", max_tokens=2)
        assert whole.system_fingerprint == "vllm-0.32-fp1"


async def metric_samples(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    """(sample name, its `kind` or `status` label) -> value, summed over the other labels."""
    out: dict[tuple[str, str], float] = {}
    for s in await scrape(http, url):
        key = (s.name, s.labels.get("kind") or s.labels.get("status") or "")
        out[key] = out.get(key, 0.0) + s.value
    return out


async def test_counting_and_tokenizing_feed_no_latency_histogram(
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """A token count or a tokenization generates nothing: it is no sample of time to first token or of end-to-end
    latency (Claude Code counts often: its ~1 ms would pull the percentiles down), nor does the access log give it
    one; a completion is one of each."""
    ttft, e2e = ("kvgate_time_to_first_token_seconds_count", ""), ("kvgate_e2e_request_latency_seconds_count", "")
    async with gateway_over_sims([SIM], server={"access_log": "plain"}) as (gw, _):
        count = {"model": "sim", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        with caplog.at_level(logging.INFO, logger="kvgate.access"):
            async with http.post(gw.url + "/v1/messages/count_tokens", json=count) as resp:
                assert resp.status == 200 and (await resp.json())["input_tokens"] > 0
            async with http.post(gw.url + "/tokenize", json={"model": "sim", "prompt": "hello"}) as resp:
                assert resp.status == 200
        lines = [r.getMessage() for r in caplog.records if r.name == "kvgate.access"]
        assert len(lines) == 2 and all(" ttft_ms=- " in line for line in lines), lines
        before = await metric_samples(http, gw.url)
        assert before[("kvgate_requests_total", "200")] == 2
        assert before.get(ttft, 0.0) == before.get(e2e, 0.0) == 0.0
        async with http.post(gw.url + "/v1/completions", json={"model": "sim", "prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 200
        after = await metric_samples(http, gw.url)
        assert after[ttft] == after[e2e] == 1.0


@pytest.mark.parametrize("route", ["chat", "messages"])
async def test_a_stream_the_client_leaves_counts_its_prompt_and_the_tokens_it_delivered(
    route: str, http: aiohttp.ClientSession
) -> None:
    """The client reads ten tokens and leaves: the engine computed the prompt and the ten tokens reached the client,
    so both are counted (the prompt as the engine reported it when the stream began)."""
    slow = SIM.model_copy(update={"decode_ms": 20.0})
    async with gateway_over_sims([slow]) as (gw, _):
        body: dict[str, Any] = {"model": "sim", "max_tokens": 200, "stream": True, "messages": MESSAGES[1:]}
        whole = {**body, "stream": False, "max_tokens": 2}
        path = "/v1/chat/completions" if route == "chat" else "/v1/messages"
        async with http.post(gw.url + path, json=whole) as resp:
            usage = (await resp.json())["usage"]
        prompt = usage["prompt_tokens"] if route == "chat" else usage["input_tokens"]
        prompt += usage.get("cache_read_input_tokens") or 0
        token = b'"delta":{"content":' if route == "chat" else b"content_block_delta"
        async with http.post(gw.url + path, json=body) as resp:
            seen = 0
            while seen < 10:
                seen += token in await resp.content.readuntil(b"\n\n")
        # (the block's end closed the connection: the client left)
        counted: dict[tuple[str, str], float] = {}

        async def left() -> bool:
            counted.update(await metric_samples(http, gw.url))
            return counted.get(("kvgate_requests_total", "499"), 0.0) == 1.0

        deadline = asyncio.get_running_loop().time() + 10
        while not await left():
            assert asyncio.get_running_loop().time() < deadline, "the gateway did not see the client leave"
            await asyncio.sleep(0.02)
        assert counted[("kvgate_tokens_total", "prompt")] == 2 * prompt
        assert 10 <= counted[("kvgate_tokens_total", "completion")] - 2 <= 12


async def test_request_id_and_route_headers(http: aiohttp.ClientSession) -> None:
    async with gateway_over_sims([SIM, SIM], routing={"policy": "round-robin"}) as (gw, _):
        body = {"model": "sim", "prompt": "x", "max_tokens": 2}
        async with http.post(gw.url + "/v1/completions", json=body, headers={"x-request-id": "abc-123"}) as resp:
            assert resp.status == 200 and resp.headers["x-request-id"] == "abc-123"
            first = resp.headers["x-kvgate-replica"]
            assert resp.headers["x-kvgate-route-reason"] == "round-robin"
        async with http.post(gw.url + "/v1/completions", json=body) as resp:
            assert len(resp.headers["x-request-id"]) >= 16 and resp.headers["x-kvgate-replica"] != first


@pytest.mark.parametrize("stream", [False, True])
async def test_the_engines_own_headers_reach_the_client(stream: bool, http: aiohttp.ClientSession) -> None:
    """A transparent gateway relays the headers it does not own; hop-by-hop ones and its own replace the engine's."""
    own = {
        "x-ratelimit-remaining-requests": "41",
        "openai-processing-ms": "12",
        "x-engine-trace": "t-1",
        "x-kvgate-replica": "forged",
        "Server": "engine",
        "Keep-Alive": "timeout=99",
    }
    sim = SIM.model_copy(update={"response_headers": own})
    async with gateway_over_sims([sim]) as (gw, _):
        body = {"model": "sim", "prompt": "x", "max_tokens": 2, "stream": stream}
        async with http.post(gw.url + "/v1/completions", json=body, headers={"x-request-id": "mine"}) as resp:
            assert resp.status == 200
            await resp.read()
            assert resp.headers["x-ratelimit-remaining-requests"] == "41"
            assert resp.headers["openai-processing-ms"] == "12" and resp.headers["x-engine-trace"] == "t-1"
            assert resp.headers["x-kvgate-replica"] != "forged" and resp.headers["x-request-id"] == "mine"
            assert resp.headers.get("Server") != "engine" and "timeout=99" not in resp.headers.get("Keep-Alive", "")


async def test_client_disconnect_cancels_the_engine_request(http: aiohttp.ClientSession) -> None:
    slow = SIM.model_copy(update={"decode_ms": 20})
    async with gateway_over_sims([slow]) as (gw, sims):
        engine = sims[0].engine
        body = {"model": "sim", "prompt": "tell me a long story", "max_tokens": 2000, "stream": True}
        resp = await http.post(gw.url + "/v1/completions", json=body)
        assert resp.status == 200
        await resp.content.readline()  # the stream has started
        resp.close()  # the client leaves
        await wait_for(lambda: engine.stats.cancelled == 1, what="engine saw the cancellation")
        assert engine.running == 0 and engine.stats.generated_tokens < 2000


async def test_non_streaming_disconnect_cancels_too(http: aiohttp.ClientSession) -> None:
    slow = SIM.model_copy(update={"decode_ms": 20})
    async with gateway_over_sims([slow]) as (gw, sims):
        engine = sims[0].engine
        task = asyncio.create_task(
            http.post(gw.url + "/v1/completions", json={"model": "sim", "prompt": "x", "max_tokens": 2000})
        )
        await wait_for(lambda: engine.running == 1, what="request running")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: engine.stats.cancelled == 1, what="engine saw the cancellation")


async def test_retry_on_failing_replica_and_breaker(http: aiohttp.ClientSession) -> None:
    broken = SIM.model_copy(update={"faults": Faults(error_rate=1.0)})
    async with gateway_over_sims(
        [broken, SIM], routing={"policy": "round-robin"}, retry={"breaker_failures": 2, "breaker_cooldown_s": 60}
    ) as (gw, sims):
        for _ in range(6):
            async with http.post(gw.url + "/v1/completions", json={"model": "sim", "prompt": "x"}) as resp:
                assert resp.status == 200
        assert sims[0].engine.stats.failed == 2  # two failures opened the breaker; no traffic after that
        metrics = await (await http.get(gw.url + "/metrics")).text()
        assert 'kvgate_retries_total{model="sim"} 2.0' in metrics


def samples(text: str, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


async def test_a_stream_its_client_leaves_counts_its_first_token_and_the_tokens_delivered(
    http: aiohttp.ClientSession,
) -> None:
    """Clients that give up are the slow ones: their time to first token is in the histogram (the engine's own
    counts them too) and the tokens delivered are in the gateway's token counter, as the tenant is charged them."""
    async with gateway_over_sims([SimConfig(model="sim", decode_ms=10.0)]) as (gw, sims):
        body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": True}
        async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
            for _ in range(10):
                await resp.content.readuntil(b"\n\n")
        await wait_for(lambda: sims[0].engine.running == 0, what="the engine's request aborted")
        await wait_for(lambda: sum(r.in_flight for r in gw.app[REPLICAS]) == 0, what="the gateway's request ended")
        async with http.get(gw.url + "/metrics") as resp:
            text = await resp.text()
    assert samples(text, "kvgate_time_to_first_token_seconds_count") == 1
    assert 9 <= samples(text, "kvgate_tokens_total") < 400
