"""A large pool (more replicas than routing.max_candidates): cache-aware routing weighs a bounded subset, and still
sends a cached prefix to its holder, keeps sessions, and spreads cold prompts over the whole pool (not the first
replicas listed). Real ReplicaSet and Router over one instant simulated engine (every replica id points at it)."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from prometheus_client import CollectorRegistry

from cacheindex.config import CacheConfig
from cacheindex.state import CacheAwareState
from engine_pool.http_client import UpstreamClient
from engine_pool.replica import Replica
from engine_pool.replica_set import ReplicaSet
from gateway.metrics import GatewayMetrics
from gateway.router import Router
from policies.cache_aware import CacheAware
from simengine import SimConfig, run_sim_engine
from tests.conftest import wait_for

POOL = 40


@asynccontextmanager
async def large_pool() -> AsyncIterator[tuple[Router, CacheAwareState]]:
    registry = CollectorRegistry()
    state = CacheAwareState(CacheConfig(tokenizers={"m": "sim"}, kv_events=False), registry)
    client = UpstreamClient()
    replicas = ReplicaSet(client, interval_s=3600, metrics_interval_s=3600)
    async with run_sim_engine(SimConfig(model="m", instant=True)) as sim:
        for i in range(POOL):
            replicas.add(Replica(f"r{i:02d}", sim.url, "m"))
            state.add_replica(
                f"r{i:02d}", model="m", block_size=16, num_blocks=4096, kv_events_endpoint=None, tokenizer="sim"
            )
        await wait_for(lambda: all(r.healthy for r in replicas), what="replicas healthy")
        try:
            yield Router(CacheAware(), replicas, GatewayMetrics(registry), state, max_candidates=16), state
        finally:
            await replicas.close()
            client.close()
            await state.stop()


def body(system: str, question: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


async def route(router: Router, state: CacheAwareState, b: dict[str, object], session: str | None = None) -> str:
    info = await state.request_info(model="m", endpoint="chat", body=b, tenant="t", session_key=session)
    replica, _ = await router.choose(info)
    assert len(router.view(info).replicas) <= 16  # the bound holds
    state.on_finished(info, replica.id, None)
    return replica.id


async def test_a_cached_prefix_goes_to_its_holder_in_a_pool_larger_than_the_candidates() -> None:
    async with large_pool() as (router, state):
        homes = {}
        for g in range(30):  # 30 prefixes placed cold, then asked again: each goes back where it is cached
            system = f"application {g} " + "instructions " * 200
            homes[g] = await route(router, state, body(system, "first"))
        for g in range(30):
            system = f"application {g} " + "instructions " * 200
            assert await route(router, state, body(system, "again")) == homes[g]
        # cold placement sampled the whole pool, not the first 16 replicas
        assert len(set(homes.values())) > 16


async def test_sessions_keep_their_replica_in_a_large_pool() -> None:
    async with large_pool() as (router, state):
        bound = {s: await route(router, state, body(f"agent {s}", "turn 1"), session=f"s{s}") for s in range(20)}
        for turn in range(2, 5):
            for s in range(20):
                assert await route(router, state, body(f"agent {s} turn {turn}", "next"), session=f"s{s}") == bound[s]


async def test_cold_prompts_spread_over_the_pool() -> None:
    async with large_pool() as (router, state):
        served = Counter([await route(router, state, body(f"unique {i}", "q")) for i in range(200)])
        assert len(served) >= POOL * 3 // 4  # the sample reaches most of the pool
