"""Quotas shared through a real Redis (started here on a free port): two gateways enforce one tenant limit; Redis
stopped mid-test -> the failure policy holds and nothing crashes; Redis back -> shared limits resume."""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from engine_pool.launcher import free_port
from gateway.admission.config import LimitsConfig, RedisConfig, hash_key
from gateway.admission.metrics import AdmissionMetrics
from gateway.admission.quota import Lease
from gateway.admission.redis_store import RedisQuotaStore
from gateway.embedded import RunningGateway, running_gateway
from gateway.keys import ADMISSION, REGISTRY
from simengine import SimConfig, SimServer, run_sim_engine
from tests.conftest import TcpRelay, wait_for
from tests.test_admission_gateway import MODEL, chat, gateway_config, post, wait_ready

START_S = 15.0  # redis-server answers PING within milliseconds here

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(
        shutil.which("redis-server") is None, reason="redis-server not installed (apt-get install redis-server)"
    ),
]


class RedisProcess:
    """redis-server on a port below the kernel's ephemeral range (`free_port`, as the engine pool's): a test that
    stops and starts it on the same port while gateways reconnect must not find that port taken as the source port
    of some outgoing connection."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        client = aioredis.Redis.from_url(self.url, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            async with asyncio.timeout(START_S):  # a failure with its cause, not a test that waits forever
                while True:
                    if self.proc.returncode is not None:
                        raise RuntimeError(f"redis-server on port {self.port} exited ({self.proc.returncode})")
                    try:
                        await client.ping()
                        return
                    except (OSError, aioredis.ConnectionError, aioredis.TimeoutError):
                        await asyncio.sleep(0.02)
        finally:
            await client.aclose()

    async def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            await self.proc.wait()
            self.proc = None


@pytest.fixture
async def redis_server() -> AsyncIterator[RedisProcess]:
    server = RedisProcess()
    try:
        yield server
    finally:
        await server.stop()


def admission(url: str, policy: str, limits: dict[str, int] | None = None) -> dict[str, Any]:
    return {
        "auth": True,
        "tenants": {"acme": {"keys": [hash_key("sk-acme")], "limits": limits or {"max_concurrency": 2}}},
        "redis": {"url": url, "failure_policy": policy, "reconnect_min_s": 0.05, "reconnect_max_s": 0.2},
    }


@asynccontextmanager
async def two_gateways(
    url: str, policy: str, *, share_routing: bool = True, limits: dict[str, int] | None = None
) -> AsyncIterator[tuple[list[RunningGateway], list[SimServer], aiohttp.ClientSession]]:
    """`share_routing`: False leaves Redis to the quotas alone (no session lookup or claim before them)."""
    async with AsyncExitStack() as es:
        engine = await es.enter_async_context(run_sim_engine(SimConfig(model=MODEL, decode_ms=30)))
        config = gateway_config([engine], admission(url, policy, limits))
        config = config.model_copy(update={"fleet": config.fleet.model_copy(update={"share_routing": share_routing})})
        gws = [await es.enter_async_context(running_gateway(config)) for _ in range(2)]
        session = await es.enter_async_context(aiohttp.ClientSession())
        for gw in gws:
            await wait_ready(session, gw.url)
        yield gws, [engine], session


async def hold_two_slots(session: aiohttp.ClientSession, gws: list[RunningGateway]) -> list[asyncio.Task[Any]]:
    """One slow request through each gateway: together they use the tenant's 2 shared slots."""
    tasks = [asyncio.create_task(post(session, gw.url, chat(max_tokens=40), key="sk-acme")) for gw in gws]
    controllers = [gw.app[ADMISSION] for gw in gws]
    await wait_for(lambda: all(c.tenant_in_flight("acme") for c in controllers), 30.0, "both slots taken")
    return tasks


async def test_two_gateways_share_one_limit_survive_redis_loss_and_resume(redis_server: RedisProcess) -> None:
    await redis_server.start()
    async with two_gateways(redis_server.url, "open") as (gws, _, session):
        held = await hold_two_slots(session, gws)
        for gw in gws:  # each gateway holds only one slot itself, yet both refuse: the limit is shared
            status, headers, _ = await post(session, gw.url, chat(), key="sk-acme")
            assert status == 429 and "Retry-After" in headers
        assert [(await t)[0] for t in held] == [200, 200]
        assert (await post(session, gws[1].url, chat(), key="sk-acme"))[0] == 200

        await redis_server.stop()  # fail-open: each gateway enforces the limit alone, from memory
        assert (await post(session, gws[0].url, chat(), key="sk-acme"))[0] == 200
        stores = [gw.app[ADMISSION].store for gw in gws]
        assert all(isinstance(s, RedisQuotaStore) and not s.up for s in stores[:1])
        held = await hold_two_slots(session, gws)
        # both gateways now hold one local slot each and the local limit is 2: one more per gateway still passes
        assert (await post(session, gws[0].url, chat(), key="sk-acme"))[0] == 200
        assert [(await t)[0] for t in held] == [200, 200]
        reg = gws[0].app[REGISTRY]
        assert reg.get_sample_value("kvgate_quota_store_up", {"store": "redis"}) == 0
        assert reg.get_sample_value("kvgate_quota_store_fallbacks_total", {"policy": "open"})

        await redis_server.start()  # same port: the gateways reconnect by themselves
        for gw in gws:
            await post(session, gw.url, chat(), key="sk-acme")  # a check notices the loss if it has not yet
        redis_stores = [s for s in stores if isinstance(s, RedisQuotaStore)]
        await wait_for(lambda: all(s.up for s in redis_stores), 30.0, "redis stores up again")
        held = await hold_two_slots(session, gws)
        for gw in gws:
            assert (await post(session, gw.url, chat(), key="sk-acme"))[0] == 429  # shared again
        assert [(await t)[0] for t in held] == [200, 200]
        assert reg.get_sample_value("kvgate_quota_store_up", {"store": "redis"}) == 1


async def test_fail_closed_refuses_with_503_while_redis_is_down(redis_server: RedisProcess) -> None:
    await redis_server.start()
    async with two_gateways(redis_server.url, "closed") as (gws, _, session):
        assert (await post(session, gws[0].url, chat(), key="sk-acme"))[0] == 200
        await redis_server.stop()
        for _ in range(3):
            status, headers, raw = await post(session, gws[0].url, chat(), key="sk-acme")
            assert status == 503 and "Retry-After" in headers and b"quota_store_unavailable" in raw
        await redis_server.start()
        store = gws[0].app[ADMISSION].store
        assert isinstance(store, RedisQuotaStore)
        await wait_for(lambda: store.up, 30.0, "redis store up again")
        assert (await post(session, gws[0].url, chat(), key="sk-acme"))[0] == 200


async def wait_store_up(session: aiohttp.ClientSession, gws: list[RunningGateway]) -> None:
    for gw in gws:
        await post(session, gw.url, chat(), key="sk-acme")  # a check notices the loss if it has not yet
    stores = [gw.app[ADMISSION].store for gw in gws]
    assert all(isinstance(s, RedisQuotaStore) for s in stores)
    await wait_for(lambda: all(s.up for s in stores if isinstance(s, RedisQuotaStore)), 30.0, "redis stores up")


async def test_requests_granted_while_redis_was_down_count_once_it_is_back(redis_server: RedisProcess) -> None:
    """A limit of 2 shared by two gateways: two requests granted from memory while Redis was down are still
    running when it comes back (empty, restarted); they are counted there, so both gateways refuse a third."""
    await redis_server.start()
    async with two_gateways(redis_server.url, "open") as (gws, _, session):
        # concurrent checks: each gateway's Redis client pools several connections, all stale after the restart
        await asyncio.gather(*(post(session, gw.url, chat(), key="sk-acme") for gw in gws for _ in range(8)))
        await redis_server.stop()
        for gw in gws:
            await post(session, gw.url, chat(), key="sk-acme")  # the gateways see the loss
        held = [
            asyncio.create_task(post(session, gw.url, chat(max_tokens=120), key="sk-acme")) for gw in gws
        ]  # about 3.6 s each: still running after the restart
        controllers = [gw.app[ADMISSION] for gw in gws]
        await wait_for(lambda: all(c.tenant_in_flight("acme") for c in controllers), 30.0, "local grants running")
        await redis_server.start()
        stores = [c.store for c in controllers]
        await wait_for(lambda: all(isinstance(s, RedisQuotaStore) and s.up for s in stores), 30.0, "stores up")
        assert not all(t.done() for t in held), "the held requests ended before the store recovered"
        for gw in gws:
            assert (await post(session, gw.url, chat(), key="sk-acme"))[0] == 429  # 2 live grants, counted
        assert [(await t)[0] for t in held] == [200, 200]
        both = await asyncio.gather(*(post(session, gw.url, chat(max_tokens=20), key="sk-acme") for gw in gws))
        assert [r[0] for r in both] == [200, 200]  # and released there: nothing left behind
        for gw in gws:  # stale pooled connections to the old server were retried, not taken for new outages
            for _ in range(5):
                await post(session, gw.url, chat(), key="sk-acme")
            reg = gw.app[REGISTRY]
            assert (
                reg.get_sample_value("kvgate_quota_store_transitions_total", {"store": "redis", "state": "down"}) == 1
            )


async def test_live_slots_survive_a_redis_restart_that_lost_them(redis_server: RedisProcess) -> None:
    """Both of the tenant's 2 shared slots held by long requests when Redis restarts empty (no persistence), so fast
    that no request sees it down: the gateways put their slots back (within lease_s/3), and a third request is still
    refused; they are released there at the end."""
    await redis_server.start()
    limits = {"max_concurrency": 2}
    async with AsyncExitStack() as es:
        engine = await es.enter_async_context(run_sim_engine(SimConfig(model=MODEL, decode_ms=30)))
        adm = admission(redis_server.url, "open", limits)
        adm["redis"]["lease_s"] = 1.5
        gws = [await es.enter_async_context(running_gateway(gateway_config([engine], adm))) for _ in range(2)]
        session = await es.enter_async_context(aiohttp.ClientSession())
        for gw in gws:
            await wait_ready(session, gw.url)
        held = [asyncio.create_task(post(session, gw.url, chat(max_tokens=150), key="sk-acme")) for gw in gws]
        controllers = [gw.app[ADMISSION] for gw in gws]
        await wait_for(lambda: all(c.tenant_in_flight("acme") for c in controllers), 30.0, "both slots taken")
        await redis_server.stop()
        await redis_server.start()  # empty
        deadline = time.monotonic() + 10.0
        while await redis_slots(redis_server.url) != 2:  # until their gateways put the live slots back
            assert time.monotonic() < deadline, "the live slots were not put back"
            await asyncio.sleep(0.05)
        assert not any(t.done() for t in held), "the held requests ended before the slots were back"
        for gw in gws:
            assert (await post(session, gw.url, chat(), key="sk-acme"))[0] == 429
        assert [(await t)[0] for t in held] == [200, 200]
        assert await redis_slots(redis_server.url) == 0


async def redis_slots(url: str) -> int:
    """The tenant's concurrency slots taken in Redis."""
    redis = aioredis.Redis.from_url(url)
    try:
        return int(await redis.zcard("kvgate:{acme}:conc"))
    finally:
        await redis.aclose()


async def test_requests_that_finished_while_redis_was_frozen_leave_no_lease(redis_server: RedisProcess) -> None:
    """Redis stopped (SIGSTOP) with both slots held in it; the requests finish while it is frozen; once it resumes,
    both slots are free at once (not after the lease expiry)."""
    await redis_server.start()
    async with two_gateways(redis_server.url, "open") as (gws, _, session):
        held = await hold_two_slots(session, gws)
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            assert [(await t)[0] for t in held] == [200, 200]  # their releases cannot reach Redis now
            for gw in gws:
                await post(session, gw.url, chat(), key="sk-acme")  # the gateways see the store down
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        stores = [gw.app[ADMISSION].store for gw in gws]
        await wait_for(lambda: all(isinstance(s, RedisQuotaStore) and s.up for s in stores), 30.0, "stores up")
        both = await asyncio.gather(*(post(session, gw.url, chat(max_tokens=20), key="sk-acme") for gw in gws))
        assert [r[0] for r in both] == [200, 200]


async def redis_counted(url: str) -> int:
    """Requests the tenant was counted for in Redis (every minute's counter)."""
    redis = aioredis.Redis.from_url(url)
    try:
        return sum([int(await redis.get(key) or 0) for key in await redis.keys("kvgate:{acme}:req:*")])
    finally:
        await redis.aclose()


@pytest.mark.parametrize("policy", ["open", "closed"])
async def test_the_store_gauge_follows_redis_back_under_traffic(redis_server: RedisProcess, policy: str) -> None:
    """Redis (a few ms away) killed and restarted while clients keep sending (issue 33): the recovered store serves
    them and kvgate_quota_store_up reads 1 again, traffic still running. (Under steady traffic a fail-open gateway
    kept adopting into Redis the leases it granted meanwhile, each pass finding new ones, and never marked it up.)"""
    await redis_server.start()
    async with AsyncExitStack() as es:
        link = await es.enter_async_context(TcpRelay(redis_server.port, delay_s=0.005))
        cfg = admission(f"redis://127.0.0.1:{link.port}/0", policy)
        cfg["tenants"]["acme"]["limits"] = {"max_concurrency": 10_000}
        engine = await es.enter_async_context(run_sim_engine(SimConfig(model=MODEL, instant=True)))
        gw = await es.enter_async_context(running_gateway(gateway_config([engine], cfg)))
        session = await es.enter_async_context(aiohttp.ClientSession())
        await wait_ready(session, gw.url)
        reg = gw.app[REGISTRY]

        def gauge() -> float | None:
            return reg.get_sample_value("kvgate_quota_store_up", {"store": "redis"})

        statuses: dict[int, int] = {}
        stop = asyncio.Event()

        async def client() -> None:
            while not stop.is_set():
                status = (await post(session, gw.url, chat(max_tokens=1), key="sk-acme"))[0]
                statuses[status] = statuses.get(status, 0) + 1

        clients = [asyncio.create_task(client()) for _ in range(48)]
        try:
            await wait_for(lambda: sum(statuses.values()) > 100, 30.0, "traffic flowing")
            assert redis_server.proc is not None
            redis_server.proc.kill()
            await redis_server.proc.wait()
            redis_server.proc = None
            await wait_for(lambda: gauge() == 0, 30.0, "the loss seen")
            await redis_server.start()
            await wait_for(lambda: gauge() == 1, 30.0, "the gauge up again while clients keep sending")
        finally:
            stop.set()
            await asyncio.gather(*clients)
        assert set(statuses) <= {200, 503}, statuses  # 503 only from the fail-closed gateway while Redis was down
        # a command slower than timeout_s marks the store down again (a busy machine's relay can be): wait it out
        await wait_for(lambda: gauge() == 1, 30.0, "the gauge up after the traffic")
        counted = await redis_counted(redis_server.url)
        assert (await post(session, gw.url, chat(), key="sk-acme"))[0] == 200
        assert await redis_counted(redis_server.url) == counted + 1 and gauge() == 1  # served by the recovered store


async def test_a_client_that_leaves_during_the_quota_check_leaves_no_slot_behind(redis_server: RedisProcess) -> None:
    """Redis slow to answer (frozen) while a client gives up and leaves: the check still grants it a slot in Redis
    when it answers, and that slot is given back at once, not held for lease_s (the tenant locked out meanwhile)."""
    await redis_server.start()
    async with two_gateways(redis_server.url, "open", share_routing=False) as (gws, _, session):
        assert (await post(session, gws[0].url, chat(), key="sk-acme"))[0] == 200  # its connection to Redis open
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError):
                async with session.post(
                    f"{gws[0].url}/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer sk-acme"},
                    timeout=aiohttp.ClientTimeout(total=0.1),
                ):  # fmt: skip
                    pass
            await wait_for(lambda: gws[0].app[ADMISSION].tenant_in_flight("acme") == 0, 10.0, "the request gone")
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        # the give-back reaches Redis a round trip after it resumes (a request in that instant may still find the
        # slot taken, and is told to retry in 1 s): wait for it, not for a time
        store = gws[0].app[ADMISSION].store
        assert isinstance(store, RedisQuotaStore)
        await wait_for(lambda: not store._giving_back, 10.0, "the give-back answered")
        held = await hold_two_slots(session, gws)  # both slots free for the tenant (not held for lease_s)
        assert [(await t)[0] for t in held] == [200, 200]


async def test_a_release_run_before_its_check_leaves_no_slot_behind(redis_server: RedisProcess) -> None:
    """A client that left while Redis was frozen: its check and its give-back travel on two connections, and Redis
    may run the give-back first. The check that then runs grants nothing (it granted a slot held for lease_s, the
    tenant locked out at max_concurrency meanwhile: seen once in CI as the test above failing)."""
    await redis_server.start()
    store = RedisQuotaStore(RedisConfig(url=redis_server.url), AdmissionMetrics(CollectorRegistry()))
    limits = LimitsConfig(max_concurrency=1)
    try:
        await store.release(Lease("acme", "gone-1", 0, store.name), 0)  # the give-back, run first
        assert not (await store.check("acme", limits, 1, "gone-1")).allowed
        granted = await store.check("acme", limits, 1, "next-1")  # the tenant's one slot is free
        assert granted.allowed and granted.lease is not None
        assert not (await store.check("acme", limits, 1, "next-2")).allowed  # and the limit still holds
        await store.release(granted.lease, 1)
        assert (await store.check("acme", limits, 1, "next-3")).allowed
    finally:
        await store.close()


async def test_a_request_refused_after_its_quota_check_leaves_the_shared_minute(redis_server: RedisProcess) -> None:
    """requests_per_minute counts requests admitted, in Redis too: a lease released as not admitted (a gate refused
    its request after the quota check) takes its request out of the minute's count; one admitted does not."""
    await redis_server.start()
    await wait_for(lambda: time.time() % 60 < 50, 20.0, "a minute with room for the test")
    store = RedisQuotaStore(RedisConfig(url=redis_server.url), AdmissionMetrics(CollectorRegistry()))
    limits = LimitsConfig(requests_per_minute=2)
    try:
        for i in range(3):  # refused by a gate three times: none of them counted
            refused = await store.check("acme", limits, 1, f"refused-{i}")
            assert refused.allowed and refused.lease is not None
            await store.release(refused.lease, 0, admitted=False)
        served = [await store.check("acme", limits, 1, f"served-{i}") for i in range(3)]
        assert [r.allowed for r in served] == [True, True, False]
        assert served[1].remaining_requests == 0
    finally:
        await store.close()


async def test_requests_granted_from_memory_in_earlier_minutes_are_not_counted_in_the_current_one(
    redis_server: RedisProcess,
) -> None:
    """Ten requests a minute granted from memory while Redis was gone, in minutes that have since passed: once it is
    back they count in their own minutes, not all at once in the current one (the tenant was then refused for
    the rest of a minute in which it had sent nothing)."""
    await redis_server.start()
    config = RedisConfig(url=redis_server.url, reconnect_min_s=0.05, reconnect_max_s=0.2)
    store = RedisQuotaStore(config, AdmissionMetrics(CollectorRegistry()))
    limits = LimitsConfig(requests_per_minute=10)
    try:
        assert (await store.check("acme", limits, 1, "warm")).allowed  # connected
        await redis_server.stop()
        for ago in (180, 120):  # two earlier minutes, by the gateway's clock while it answered alone
            store.fallback.clock = lambda ago=ago: time.time() - ago  # type: ignore[misc]
            for i in range(10):
                granted = await store.check("acme", limits, 1, f"{ago}-{i}")
                assert granted.allowed and granted.lease is not None
                await store.release(granted.lease, 1)
        assert not store.up
        await redis_server.start()
        await wait_for(lambda: store.up and not store._behind(), 30.0, "the store back, its counts applied")
        now = await store.check("acme", limits, 1, "now")
        assert now.allowed and now.remaining_requests == 9
    finally:
        await store.close()


async def test_requests_that_finished_while_redis_was_frozen_are_counted_there(redis_server: RedisProcess) -> None:
    """Six requests a minute over two gateways: four granted from memory and finished while Redis was frozen are
    counted there once it answers, so the other gateway grants two more, not six."""
    await redis_server.start()
    # a minute's counter is what is checked: not across a minute's change (Redis' clock is this machine's)
    await wait_for(lambda: time.time() % 60 < 45, 20.0, "a minute with room for the test")
    async with two_gateways(redis_server.url, "open", limits={"requests_per_minute": 6}) as (gws, _, session):
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            for _ in range(4):
                assert (await post(session, gws[0].url, chat(), key="sk-acme"))[0] == 200
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        reg = gws[0].app[REGISTRY]
        await wait_for(lambda: reg.get_sample_value("kvgate_quota_store_up", {"store": "redis"}) == 1, 30.0, "up")
        statuses = [(await post(session, gws[1].url, chat(), key="sk-acme"))[0] for _ in range(4)]
        assert statuses == [200, 200, 429, 429]


async def test_a_gateway_without_redis_counts_its_running_requests_in_its_local_limit(
    redis_server: RedisProcess,
) -> None:
    """A limit of 2, both slots taken through one gateway when Redis goes away: that gateway, now enforcing the
    limit from memory, counts them and refuses a third (it granted two more: twice the limit)."""
    await redis_server.start()
    async with two_gateways(redis_server.url, "open") as (gws, _, session):
        held = [asyncio.create_task(post(session, gws[0].url, chat(max_tokens=60), key="sk-acme")) for _ in range(2)]
        await wait_for(lambda: gws[0].app[ADMISSION].tenant_in_flight("acme") == 2, 30.0, "both slots taken")
        await redis_server.stop()
        statuses = [(await post(session, gws[0].url, chat(), key="sk-acme"))[0] for _ in range(2)]
        assert 429 in statuses and 200 not in statuses
        assert [(await t)[0] for t in held] == [200, 200]


@pytest.mark.parametrize("store", ["local", "redis"])
async def test_a_tenant_limited_by_the_day_alone_is_told_its_daily_token_budget(
    redis_server: RedisProcess, store: str
) -> None:
    """`tokens_per_day` alone: the token headers carry the day's budget, what is left of it and the time to UTC
    midnight (they were absent: only a per-minute token limit had them), the same from either store."""
    if store == "redis":
        await redis_server.start()
    limits = {"tokens_per_day": 100_000}
    async with AsyncExitStack() as es:
        engine = await es.enter_async_context(run_sim_engine(SimConfig(model=MODEL, instant=True)))
        adm = admission(redis_server.url, "open", limits) if store == "redis" else {
            "auth": True, "tenants": {"acme": {"keys": [hash_key("sk-acme")], "limits": limits}},
        }  # fmt: skip
        gw = await es.enter_async_context(running_gateway(gateway_config([engine], adm)))
        session = await es.enter_async_context(aiohttp.ClientSession())
        await wait_ready(session, gw.url)
        _, first, _ = await post(session, gw.url, chat(), key="sk-acme")
        _, second, _ = await post(session, gw.url, chat(), key="sk-acme")
    assert first["x-ratelimit-limit-tokens"] == second["x-ratelimit-limit-tokens"] == "100000"
    assert 100_000 > int(first["x-ratelimit-remaining-tokens"]) > int(second["x-ratelimit-remaining-tokens"])
    to_midnight = 86_400 - time.time() % 86_400
    reset = first["x-ratelimit-reset-tokens"]  # OpenAI's duration format, e.g. 6h3m2s
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    seconds = sum(int(n) * units[u] for n, u in re.findall(r"(\d+)(ms|h|m|s)", reset))
    assert abs(seconds - to_midnight) < 120, reset
