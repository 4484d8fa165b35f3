"""A large pool (more replicas than routing.max_candidates): cache-aware routing and admission's verdict on the
latency targets weigh a bounded subset (at most routing.max_weighed in full), and still send a cached prefix to its
holder, keep sessions, spread cold prompts over the whole pool (not the first replicas listed) onto its least loaded
replicas, and route within the replicas the verdict prefers.
Real ReplicaSet, Router and LatencyGate over one instant simulated engine (every replica id points at it); each
request takes the shipped default's steps: the verdict and its hold, the route, the release."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from prometheus_client import CollectorRegistry

from cacheindex.config import CacheConfig
from cacheindex.state import CacheAwareState
from engine_pool.http_client import UpstreamClient
from engine_pool.replica import Replica
from engine_pool.replica_set import ReplicaSet
from gateway.admission.auth import Identity
from gateway.admission.config import AdmissionConfig
from gateway.admission.metrics import AdmissionMetrics
from gateway.admission.targets import LatencyGate, place
from gateway.context import RequestContext
from gateway.metrics import GatewayMetrics
from gateway.router import Router, sample
from policies.cache_aware import CacheAware
from policies.latency import Targets
from simengine import SimConfig, run_sim_engine
from tests.conftest import gateway_over_sims, wait_for

POOL = 40
TARGETS = Targets(ttft_s=2.0, tpot_s=0.1)


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
    """One request as the gateway takes it: admission's verdict (and hold), the route (within the verdict's
    preferred replicas when it names some), the end."""
    gate = LatencyGate(AdmissionConfig(), router.replicas, router, AdmissionMetrics(CollectorRegistry()))
    info = await router.request_info(model="m", endpoint="chat", body=b, tenant="t", session_key=session)
    assert len(router.candidates(info)) <= 16  # the bound holds, for the verdict and the route alike
    ctx = RequestContext("test", "chat")
    verdict = gate.judge(info, info.prompt_tokens, None, TARGETS)
    assert verdict.admit and verdict.best is not None
    assert len(verdict.predictions) <= router.max_weighed  # the finalists only are weighed in full
    held = router.replicas.get(verdict.best.replica)
    assert held is not None
    gate.hold(ctx, held, verdict.best, info.prompt_tokens, None)
    # as the proxy does: among the replicas the verdict prefers, else those it weighed
    only = verdict.prefer or tuple(p.replica for p in verdict.predictions)
    replica, _ = await router.choose(info, hold=ctx.hold, only=only)
    place(ctx, replica, router.replicas)
    state.on_finished(info, replica.id, None)
    gate.finish(ctx, Identity("t", 0, "standard"), None)
    assert not any(r.held for r in router.replicas)
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


async def test_cold_prompts_go_to_the_idle_half_of_a_busy_pool() -> None:
    """Half the pool has requests in flight: every cold prompt lands on an idle replica (weighing 4 of the
    candidates drawn at random, one in 16 requests would find none idle)."""
    async with large_pool() as (router, state):
        busy = [r for i, r in enumerate(router.replicas) if i % 2]
        starts = [r.begin() for r in busy for _ in range(2)]
        served = [await route(router, state, body(f"fresh {i}", "q")) for i in range(100)]
        assert not {r.id for r in busy} & set(served)
        for r, started in zip([r for r in busy for _ in range(2)], starts, strict=True):
            r.end(started)


async def test_a_prefix_another_gateway_placed_goes_where_it_claimed_even_off_the_finalists() -> None:
    """The fleet's claim (`claim_cold`: another gateway placed this cold prefix first) is taken when the replica is
    busier than every finalist, and not when it is draining or excluded."""
    async with large_pool() as (router, state):
        claimed = router.replicas.get("r07")
        assert claimed is not None
        starts = [claimed.begin() for _ in range(5)]  # the busiest: no finalist of a cold prompt

        async def elsewhere(info: object, replica: str) -> str:
            return "r07"

        state.claim_cold = elsewhere  # type: ignore[method-assign]
        info = await router.request_info(
            model="m", endpoint="chat", body=body("cold", "q"), tenant="t", session_key=None
        )
        assert "r07" not in {r.id for r in router.candidates(info)}
        replica, decision = await router.choose(info)
        assert (replica.id, decision.reason) == ("r07", "fleet-claim")
        state.on_finished(info, replica.id, None)
        replica, decision = await router.choose(info, exclude=("r07",))
        assert replica.id != "r07" and decision.reason == "cold-least-load"
        claimed.draining = True
        replica, _ = await router.choose(info)
        assert replica.id != "r07"
        for started in starts:
            claimed.end(started)


async def test_a_route_within_given_replicas_keeps_to_them_in_a_large_pool() -> None:
    """Admission prefers the replicas with KV room when some have none: the route keeps to those, whichever of
    the pool they are (not only those the candidate sample happens to draw)."""
    async with large_pool() as (router, state):
        for g in range(20):
            info = await router.request_info(
                model="m", endpoint="chat", body=body(f"tool {g}", "q"), tenant="t", session_key=None
            )
            only = (f"r{(7 * g) % POOL:02d}", f"r{(7 * g + 3) % POOL:02d}")
            replica, _ = await router.choose(info, only=only)
            assert replica.id in only
            state.on_finished(info, replica.id, None)


def test_the_candidate_sample_is_distinct_repeatable_and_fair() -> None:
    pool = list(range(40))
    for seed in (1, 2, 3, 2**63 + 5):
        drawn = sample(pool, 14, seed)
        assert len(set(drawn)) == 14 and set(drawn) <= set(pool)
        assert sample(pool, 14, seed) == drawn  # the verdict and the route of one request draw the same
    assert sorted(sample(pool, 40, 9)) == pool
    assert sample([7], 1, 12345) == [7]
    counts = Counter(i for seed in range(1, 4001) for i in sample(pool, 8, seed))
    assert min(counts.values()) > 0.8 * 800 and max(counts.values()) < 1.2 * 800  # each replica as likely


async def test_a_gateway_over_more_replicas_than_its_candidates_admits_and_routes_to_the_holder() -> None:
    """Through HTTP, as shipped (cache-aware, latency targets on) over 12 engines with `routing.max_candidates` 9:
    every request is admitted, and a prefix asked again goes back to the replica that holds it."""
    sim = SimConfig(model="sim", instant=True, block_size=16)
    overrides = {"routing": {"max_candidates": 9}, "cache": {"tokenizers": {"sim": "sim"}}}
    async with aiohttp.ClientSession() as http, gateway_over_sims([sim] * 12, **overrides) as (gw, _):

        async def ask(system: str, question: str) -> tuple[str, str]:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            body = {"model": "sim", "messages": messages, "max_tokens": 4}
            async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return resp.headers["x-kvgate-replica"], resp.headers["x-kvgate-route-reason"]

        for g in range(6):
            system = f"workspace {g} " + "rules " * 120
            home, _ = await ask(system, "first")
            for question in ("second", "third"):
                assert await ask(system, question) == (home, "cache-hit")
