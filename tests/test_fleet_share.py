"""Two in-process gateways share their routing through a real Redis (engines without KV events): a session bound by
one is kept by the other, a prefix one routed is predicted cached by the other, a gateway started later finds the
sessions bound before it, and losing Redis fails no request."""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from gateway.embedded import RunningGateway, running_gateway
from gateway.keys import CACHE, REGISTRY
from simengine import SimConfig, SimServer, run_sim_engine
from tests.conftest import gateway_config, wait_for
from tests.test_admission_gateway import wait_ready
from tests.test_admission_redis import RedisProcess, redis_server  # noqa: F401 (fixture)

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed"),
]

MODEL = "sim"
SYSTEM = "You are a careful assistant who answers briefly. " * 30


def config(servers: list[SimServer], redis_url: str, **fleet: Any) -> Any:
    return gateway_config(
        [s.url for s in servers],
        routing={"policy": "cache-aware"},
        cache={"tokenizers": {MODEL: "sim"}},
        fleet={"redis_url": redis_url, **fleet},
    )


@asynccontextmanager
async def sims(n: int) -> AsyncIterator[list[SimServer]]:
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(run_sim_engine(SimConfig(model=MODEL, seed=i))) for i in range(n)]


async def chat(
    http: aiohttp.ClientSession, gw: RunningGateway, content: str, *, session: str | None = None, system: str = SYSTEM
) -> tuple[str, str]:
    """(replica, route reason) of one chat request."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
    body = {"model": MODEL, "max_tokens": 2, "messages": messages}
    headers = {"x-session-id": session} if session else {}
    async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-kvgate-replica"], resp.headers["x-kvgate-route-reason"]


def metric(gw: RunningGateway, name: str, **labels: str) -> float:
    return gw.app[REGISTRY].get_sample_value(name, labels) or 0.0


async def wait_subscribed(gw: RunningGateway, replicas: int | None = None) -> None:
    """Reading the shared stream, and (with `replicas`) that many replicas registered in the cache state."""
    await wait_for(lambda: metric(gw, "kvgate_fleet_connected") == 1, what="reading the routing stream")
    if replicas is not None:
        await wait_for(lambda: len(gw.app[CACHE].index.sizes()) == replicas, what="replicas registered")


async def test_a_session_and_a_prefix_routed_by_one_gateway_are_known_to_the_other(
    redis_server: RedisProcess,  # noqa: F811
    http: aiohttp.ClientSession,
) -> None:
    await redis_server.start()
    async with sims(3) as servers, running_gateway(config(servers, redis_server.url)) as a:
        async with running_gateway(config(servers, redis_server.url)) as b:
            for gw in (a, b):
                await wait_subscribed(gw, 3)
            sessions = [f"agent-{i}" for i in range(6)]
            bound = {s: (await chat(http, a, f"turn 1 of {s}", session=s))[0] for s in sessions}
            await wait_for(
                lambda: metric(b, "kvgate_fleet_decisions_total", outcome="applied") >= len(sessions),
                what="b applied a's decisions",
            )
            for s in sessions:  # b never routed these sessions: it keeps them where a put them
                assert await chat(http, b, f"turn 2 of {s}", session=s) == (bound[s], "session")
            # a prompt only a routed: b predicts it cached there (on its own it would see no replica holding it)
            other = "Another system prompt, for a different application. " * 30
            replica, reason = await chat(http, a, "a question", system=other)
            assert reason == "cold-least-load"
            await wait_for(
                lambda: metric(b, "kvgate_fleet_decisions_total", outcome="applied") >= len(sessions) + 1,
                what="b applied the prefix",
            )
            assert await chat(http, b, "another question", system=other) == (replica, "cache-hit")
        # a gateway started later learns what was routed before it from the stream's history
        async with running_gateway(config(servers, redis_server.url)) as c:
            await wait_subscribed(c, 3)
            assert await chat(http, c, "a third question", system=other) == (replica, "cache-hit")
            for s in sessions:
                assert await chat(http, c, f"turn 3 of {s}", session=s) == (bound[s], "session")


async def test_a_gateway_started_after_the_history_finds_sessions_in_redis(
    redis_server: RedisProcess,  # noqa: F811
    http: aiohttp.ClientSession,
) -> None:
    await redis_server.start()
    async with sims(3) as servers:
        async with running_gateway(config(servers, redis_server.url, history=1)) as a:
            await wait_subscribed(a, 3)
            sessions = [f"agent-{i}" for i in range(6)]
            bound = {s: (await chat(http, a, f"turn 1 of {s}", session=s))[0] for s in sessions}
            await wait_for(
                lambda: metric(a, "kvgate_fleet_decisions_total", outcome="published") == len(sessions),
                what="a published its decisions",
            )
        async with running_gateway(config(servers, redis_server.url, history=1)) as c:
            await wait_subscribed(c, 3)
            for s in sessions:
                assert await chat(http, c, f"turn 2 of {s}", session=s) == (bound[s], "session")
            # the stream kept the last decision only: the other sessions' bindings came from their Redis keys
            assert metric(c, "kvgate_fleet_session_lookups_total", outcome="found") == len(sessions) - 1


async def test_losing_redis_fails_no_request_and_sharing_resumes(
    redis_server: RedisProcess,  # noqa: F811
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.fleet")
    await redis_server.start()
    async with sims(2) as servers, running_gateway(config(servers, redis_server.url)) as a:
        async with running_gateway(config(servers, redis_server.url)) as b:
            for gw in (a, b):
                await wait_subscribed(gw)
            await redis_server.stop()
            await wait_for(lambda: metric(a, "kvgate_fleet_connected") == 0, what="a saw Redis go")
            results = await asyncio.gather(
                *(chat(http, gw, f"q{i}", session=f"s{i}") for i in range(8) for gw in (a, b))
            )
            assert len(results) == 16  # every request answered while Redis was down
            await wait_for(
                lambda: metric(a, "kvgate_fleet_decisions_total", outcome="dropped") > 0, what="a dropped decisions"
            )
            await redis_server.start()
            for gw in (a, b):
                await wait_for(lambda gw=gw: metric(gw, "kvgate_fleet_connected") == 1, 15.0, "subscribed again")
            messages = [r.getMessage() for r in caplog.records if r.name == "kvgate.fleet"]
            assert "lost the shared routing stream" in " ".join(messages)  # the loss and the return, both logged
            assert messages.count("reading the shared routing stream again") >= 2  # a and b
            applied = metric(b, "kvgate_fleet_decisions_total", outcome="applied")
            replica, _ = await chat(http, a, "after the outage", session="late")
            await wait_for(
                lambda: metric(b, "kvgate_fleet_decisions_total", outcome="applied") > applied, 15.0, "b applied it"
            )
            assert await chat(http, b, "after the outage, again", session="late") == (replica, "session")


async def test_a_hung_redis_costs_one_lookup_timeout_not_one_per_request(
    redis_server: RedisProcess,  # noqa: F811
    http: aiohttp.ClientSession,
) -> None:
    """Redis frozen (it accepts, never answers): the first request's lookups (its session, its cold prefix's claim)
    wait fleet.timeout_s and fail; the requests after it route on the gateway's own knowledge without asking Redis
    again (each waited the timeout twice)."""
    await redis_server.start()
    async with sims(2) as servers, running_gateway(config(servers, redis_server.url)) as gw:
        await wait_subscribed(gw)
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            for i in range(6):
                await chat(http, gw, f"q{i}", session=f"hung-{i}")
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        tried = metric(gw, "kvgate_fleet_session_lookups_total", outcome="error")
        assert tried == 1 and metric(gw, "kvgate_fleet_session_lookups_total", outcome="skipped") == 5


async def test_a_stored_response_is_found_through_another_gateway(
    redis_server: RedisProcess,  # noqa: F811
    http: aiohttp.ClientSession,
) -> None:
    """vLLM keeps a stored response on the replica that ran it: a retrieve that reaches another gateway (any policy)
    still goes there."""
    await redis_server.start()
    async with sims(3) as servers:
        cfg = gateway_config([s.url for s in servers], fleet={"redis_url": redis_server.url})
        async with running_gateway(cfg) as a, running_gateway(cfg) as b:
            for gw in (a, b):
                await wait_ready(http, gw.url)
            created = []
            for i in range(6):
                async with http.post(f"{a.url}/v1/responses", json={"model": MODEL, "input": f"hello {i}"}) as resp:
                    assert resp.status == 200, await resp.text()
                    created.append(((await resp.json())["id"], resp.headers["x-kvgate-replica"]))
            store = aioredis.Redis.from_url(redis_server.url)
            try:  # a's records are sent within fleet.flush_ms
                async with asyncio.timeout(10):
                    while True:
                        if await store.exists(*(f"kvgate:response:{r}" for r, _ in created)) == len(created):
                            break
                        await asyncio.sleep(0.01)
            finally:
                await store.aclose()
            for response_id, replica in created:
                async with http.get(f"{b.url}/v1/responses/{response_id}") as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-kvgate-replica"] == replica
                    assert (await resp.json())["id"] == response_id
            async with http.get(f"{b.url}/v1/responses/resp-unknown") as resp:
                assert resp.status == 404


async def test_a_new_prefix_sent_through_two_gateways_at_once_lands_on_one_replica(
    redis_server: RedisProcess,  # noqa: F811
    http: aiohttp.ClientSession,
) -> None:
    """The stream tells the other gateway a few milliseconds late; the cold-placement claim decides at once."""
    await redis_server.start()
    async with sims(3) as servers:
        async with (
            running_gateway(config(servers, redis_server.url)) as a,
            running_gateway(config(servers, redis_server.url)) as b,
        ):
            for gw in (a, b):
                await wait_subscribed(gw, 3)
            await chat(http, b, "warm-up")  # the two gateways' tie-breaks now differ, as their views would
            for i in range(6):
                system = f"Application {i} has its own long instructions. " * 30
                (ra, _), (rb, _) = await asyncio.gather(
                    chat(http, a, "first", system=system), chat(http, b, "second", system=system)
                )
                assert ra == rb
            claims = {
                o: metric(a, "kvgate_fleet_claims_total", outcome=o) + metric(b, "kvgate_fleet_claims_total", outcome=o)
                for o in ("won", "joined")
            }
            assert claims == {"won": 7, "joined": 6}  # the warm-up's prefix was claimed too


async def test_an_agent_awaited_through_one_gateway_is_spared_by_the_others_cold_placements(
    redis_server: RedisProcess,  # noqa: F811
    http: aiohttp.ClientSession,
) -> None:
    """Two engines of 64 blocks filled past capacity through gateway b; an agent's turn through a ends in a tool
    call (streamed); b's next cold prompts go where no agent waits, and the agent's next turn through b ends the
    wait in both gateways."""
    await redis_server.start()
    small = SimConfig(model=MODEL, num_blocks=64, overhead_ms=0, prefill_us_per_token=0, decode_ms=0,
                      decode_ms_per_seq=0)  # fmt: skip
    async with AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(run_sim_engine(small)) for _ in range(2)]
        a = await stack.enter_async_context(running_gateway(config(servers, redis_server.url)))
        b = await stack.enter_async_context(running_gateway(config(servers, redis_server.url)))
        for gw in (a, b):
            await wait_subscribed(gw, 2)
            await wait_for(lambda g=gw: all(c[1] for c in g.app[CACHE].index.capacities().values()), what="capacities")
        cold = iter(f"document {d}: " + "lorem ipsum dolor sit amet " * 40 for d in range(16))  # ~20 blocks each
        for _ in range(8):
            await chat(http, b, "summarise", system=next(cold))
        system, task = "you are a coding agent. " + "follow the rules. " * 60, "fix the failing test"
        tools = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
        turn = {
            "model": MODEL, "max_tokens": 8, "stream": True, "tools": tools, "tool_choice": "required",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": task}],
        }  # fmt: skip
        async with http.post(f"{a.url}/v1/chat/completions", json=turn, headers={"x-session-id": "agent-1"}) as resp:
            home, events = resp.headers["x-kvgate-replica"], (await resp.read()).decode()
        assert '"finish_reason":"tool_calls"' in events
        await wait_for(lambda: metric(b, "kvgate_sessions_awaited") == 1, what="b heard the agent is expected back")
        placed = [(await chat(http, b, "summarise", system=next(cold)))[0] for _ in range(6)]
        assert placed.count(home) == 0
        assert await chat(http, b, task, session="agent-1", system=system) == (home, "session")
        assert metric(b, "kvgate_sessions_awaited") == 0
        await wait_for(lambda: metric(a, "kvgate_sessions_awaited") == 0, what="a heard the agent came back")


async def test_a_stored_response_is_found_through_another_gateway_at_once_and_after_a_drain(
    redis_server: RedisProcess,  # noqa: F811
    http: aiohttp.ClientSession,
) -> None:
    """A client that retrieves (or continues) its response through another gateway right after the answer finds it,
    though the record reaches Redis a few ms after the answer (it got 404, and a `previous_response_id` went to the
    wrong replica); so does one whose response was answered as its gateway shut down (the buffered record was
    dropped at close)."""
    await redis_server.start()
    async with sims(3) as servers:
        cfg = gateway_config([s.url for s in servers], fleet={"redis_url": redis_server.url})
        async with running_gateway(cfg) as b:
            async with running_gateway(cfg) as a:
                for gw in (a, b):
                    await wait_ready(http, gw.url)
                for i in range(6):
                    async with http.post(f"{a.url}/v1/responses", json={"model": MODEL, "input": f"hi {i}"}) as resp:
                        assert resp.status == 200, await resp.text()
                        response_id, replica = (await resp.json())["id"], resp.headers["x-kvgate-replica"]
                    async with http.get(f"{b.url}/v1/responses/{response_id}") as resp:  # at once
                        assert resp.status == 200, await resp.text()
                        assert resp.headers["x-kvgate-replica"] == replica
                async with http.post(f"{a.url}/v1/responses", json={"model": MODEL, "input": "last"}) as resp:
                    assert resp.status == 200
                    last, replica = (await resp.json())["id"], resp.headers["x-kvgate-replica"]
            # a is shut down (the answer's record still in its buffer when it began to close)
            async with http.get(f"{b.url}/v1/responses/{last}") as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-kvgate-replica"] == replica


async def test_a_response_not_stored_leaves_no_record(
    redis_server: RedisProcess,  # noqa: F811
    http: aiohttp.ClientSession,
) -> None:
    """`store: false` (what Codex sends): the engine keeps nothing, so no gateway records a holder, in Redis or here
    (a record a request for 24 h grew Redis with the request rate)."""
    await redis_server.start()
    async with sims(2) as servers:
        cfg = gateway_config([s.url for s in servers], fleet={"redis_url": redis_server.url})
        async with running_gateway(cfg) as a:
            await wait_ready(http, a.url)
            ids = []
            for store in (False, True):
                body = {"model": MODEL, "input": "hello", "store": store}
                async with http.post(f"{a.url}/v1/responses", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    ids.append((await resp.json())["id"])
            redis = aioredis.Redis.from_url(redis_server.url)
            try:  # the stored one's record arrives within flush_ms: then the other's would have too
                async with asyncio.timeout(10):
                    while True:
                        if await redis.exists(f"kvgate:response:{ids[1]}"):
                            break
                        await asyncio.sleep(0.01)
                assert not await redis.exists(f"kvgate:response:{ids[0]}")
            finally:
                await redis.aclose()


async def test_a_stored_response_asked_for_while_redis_is_down_is_a_503_to_retry(
    redis_server: RedisProcess,  # noqa: F811
    http: aiohttp.ClientSession,
) -> None:
    """Another gateway's record cannot be read: 503 with Retry-After (retry), not 404 (it does not exist)."""
    await redis_server.start()
    async with sims(2) as servers:
        cfg = gateway_config([s.url for s in servers], fleet={"redis_url": redis_server.url})
        async with running_gateway(cfg) as b:
            await wait_ready(http, b.url)
            await redis_server.stop()
            async with http.get(f"{b.url}/v1/responses/resp-made-elsewhere") as resp:
                assert resp.status == 503 and "Retry-After" in resp.headers
                assert (await resp.json())["error"]["code"] == "fleet_unavailable"
