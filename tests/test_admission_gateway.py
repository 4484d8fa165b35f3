"""Admission through a real kvgate server on loopback in front of simulated engines: auth, quotas and headers,
reload without losing requests, fast-fail under 3x overload, fair sharing between a flooding and a light tenant."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from gateway.admission.config import hash_key
from gateway.config import GatewayConfig
from gateway.embedded import RunningGateway, running_gateway
from gateway.keys import ADMISSION, REGISTRY
from simengine import SimConfig, SimServer, run_sim_engine
from tests.conftest import gateway_over_sims, kept_after, wait_for

MODEL = "sim-model"


def gateway_config(
    engines: Sequence[SimServer], admission: dict[str, Any], server: dict[str, Any] | None = None
) -> GatewayConfig:
    return GatewayConfig.model_validate(
        {
            "server": {"port": 0, "access_log": "off", "shutdown_grace_s": 1, **(server or {})},
            "health": {"interval_s": 0.2, "metrics_interval_s": 0.1},
            "engines": [{"url": e.url, "model": MODEL} for e in engines],
            "admin": {"key": "admin-key"},
            "admission": admission,
        }
    )


@asynccontextmanager
async def stack(
    admission: dict[str, Any], engines: int = 1, server: dict[str, Any] | None = None, **sim: Any
) -> AsyncIterator[tuple[RunningGateway, list[SimServer], aiohttp.ClientSession]]:
    async with AsyncExitStack() as es:
        servers = [
            await es.enter_async_context(run_sim_engine(SimConfig(model=MODEL, seed=i, **sim))) for i in range(engines)
        ]
        gw = await es.enter_async_context(running_gateway(gateway_config(servers, admission, server)))
        session = await es.enter_async_context(aiohttp.ClientSession())
        await wait_ready(session, gw.url)
        yield gw, servers, session


async def wait_ready(session: aiohttp.ClientSession, url: str) -> None:
    while True:
        async with session.get(f"{url}/ready") as resp:
            if resp.status == 200:
                return
        await asyncio.sleep(0.05)


def chat(max_tokens: int = 4, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


async def post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str | None = None, **headers: str
) -> tuple[int, dict[str, str], bytes]:
    hdrs = dict(headers)
    if key is not None:
        hdrs["Authorization"] = f"Bearer {key}"
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=hdrs) as resp:
        return resp.status, dict(resp.headers), await resp.read()


TENANTS = {
    "alice": {"keys": [hash_key("sk-alice")], "limits": {"max_concurrency": 1, "requests_per_minute": 1000}},
    "bob": {"keys": [hash_key("sk-bob")], "cache_isolation": True},
}
ADMISSION_CFG = {"auth": True, "tenants": TENANTS, "cache_salt_secret": "s3cret"}


async def test_auth_quota_429_and_ratelimit_headers() -> None:
    async with stack(ADMISSION_CFG, decode_ms=40) as (gw, _, session):
        status, _, raw = await post(session, gw.url, chat())
        err = json.loads(raw)["error"]
        assert (
            status == 401 and err["type"] == "authentication_error" and set(err) == {"message", "type", "param", "code"}
        )
        assert (await post(session, gw.url, chat(), key="sk-wrong"))[0] == 401
        for headers, status in (({}, 401), ({"Authorization": "Bearer sk-alice"}, 200), ({"x-api-key": "sk-bob"}, 200)):
            async with session.get(f"{gw.url}/v1/models", headers=headers) as resp:  # guarded, as vLLM's --api-key
                assert resp.status == status
        assert (await post(session, gw.url, chat(), key="sk-alice", **{"x-kvgate-tenant": "bob"}))[0] == 200

        status, headers, _ = await post(session, gw.url, chat(stream=True), key="sk-alice")
        assert status == 200 and headers["x-ratelimit-limit-requests"] == "1000"
        assert int(headers["x-ratelimit-remaining-requests"]) < 1000 and "x-ratelimit-reset-requests" in headers

        slow = asyncio.create_task(post(session, gw.url, chat(max_tokens=40), key="sk-alice"))
        adm = gw.app[ADMISSION]
        await wait_for(lambda: adm.tenant_in_flight("alice") > 0, 30.0, "alice admitted")
        status, headers, raw = await post(session, gw.url, chat(), key="sk-alice")
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert json.loads(raw)["error"]["code"] == "rate_limit_exceeded"
        assert "x-ratelimit-limit-requests" in headers
        assert (await post(session, gw.url, chat(), key="sk-bob"))[0] == 200  # other tenants unaffected
        assert (await slow)[0] == 200
        assert (await post(session, gw.url, chat(), key="sk-alice"))[0] == 200  # slot released
        reg = gw.app[REGISTRY]
        assert (
            reg.get_sample_value("kvgate_admission_rejections_total", {"tenant": "alice", "reason": "concurrency"}) == 1
        )
        assert reg.get_sample_value("kvgate_tenant_tokens_total", {"tenant": "alice", "kind": "completion"})


async def test_a_stream_its_client_leaves_is_charged_the_tokens_it_delivered() -> None:
    """A client that reads most of a stream and leaves before its usage event still used those tokens: the tenant
    is charged them (else leaving early would dodge a token quota)."""
    async with stack(ADMISSION_CFG, decode_ms=10) as (gw, _, session):
        reg = gw.app[REGISTRY]
        async with session.post(
            f"{gw.url}/v1/chat/completions", json=chat(max_tokens=400, stream=True),
            headers={"Authorization": "Bearer sk-alice"},
        ) as resp:  # fmt: skip
            for _ in range(30):
                await resp.content.readuntil(b"\n\n")
        await wait_for(lambda: gw.app[ADMISSION].tenant_in_flight("alice") == 0, 30.0, "the request ended")
        charged = reg.get_sample_value("kvgate_tenant_tokens_total", {"tenant": "alice", "kind": "completion"})
        assert charged is not None and 29 <= charged < 400


async def test_cache_salt_isolation() -> None:
    async with stack(ADMISSION_CFG) as (gw, _, session):
        adm = gw.app[ADMISSION]
        bob = adm.identify(CIMultiDict({"authorization": "Bearer sk-bob"}))
        alice = adm.identify(CIMultiDict({"authorization": "Bearer sk-alice"}))
        body: dict[str, Any] = {"cache_salt": "mine"}
        assert adm.apply_cache_salt(bob, body) and body["cache_salt"].startswith("kvgate:")
        assert body["cache_salt"].endswith(":mine")
        assert not adm.apply_cache_salt(alice, {})
        status, _, raw = await post(session, gw.url, chat(cache_salt="kvgate:forged"), key="sk-alice")
        assert status == 400 and json.loads(raw)["error"]["param"] == "cache_salt"
        assert (await post(session, gw.url, chat(), key="sk-bob"))[0] == 200  # salted body reaches the engine


async def test_reload_keeps_in_flight_requests() -> None:
    async with stack(ADMISSION_CFG, decode_ms=30) as (gw, _, session):
        slow = asyncio.create_task(post(session, gw.url, chat(max_tokens=30), key="sk-alice"))
        await wait_for(lambda: gw.app[ADMISSION].tenant_in_flight("alice") > 0, 30.0, "request admitted")
        new = {"admission": {"auth": True, "tenants": {"carol": {"keys": [hash_key("sk-carol")]}}}}
        async with session.post(f"{gw.url}/admin/reload", json=new, headers={"Authorization": "Bearer no"}) as r:
            assert r.status == 401
        async with session.post(
            f"{gw.url}/admin/reload", json={"auth": "maybe"}, headers={"Authorization": "Bearer admin-key"}
        ) as r:
            assert r.status == 400
        async with session.post(f"{gw.url}/admin/reload", json=new, headers={"Authorization": "Bearer admin-key"}) as r:
            assert r.status == 200 and (await r.json())["tenants"] == ["carol"]
        assert (await post(session, gw.url, chat(), key="sk-carol"))[0] == 200
        assert (await post(session, gw.url, chat(), key="sk-alice"))[0] == 401
        assert (await slow)[0] == 200  # admitted before the reload, finished after it


async def test_a_reload_body_changes_only_the_keys_it_gives() -> None:
    """Posting one key of the admission section (a new tenant table) keeps the rest running: auth stays on, the
    cache-salt secret stays; a key of another section or a bad value is refused with its path, changing nothing."""
    async with stack(ADMISSION_CFG) as (gw, _, session):
        admin = {"Authorization": "Bearer admin-key"}
        new = {"tenants": {"carol": {"keys": [hash_key("sk-carol")]}}}
        async with session.post(f"{gw.url}/admin/reload", json=new, headers=admin) as r:
            answer = await r.json()
            assert r.status == 200 and answer["tenants"] == ["carol"] and answer["auth"] is True
        assert (await post(session, gw.url, chat()))[0] == 401  # no key: still refused
        assert (await post(session, gw.url, chat(), key="sk-carol"))[0] == 200
        assert gw.app[ADMISSION].config.cache_salt_secret == "s3cret"
        for body, where in (
            ({"admission": new, "routing": {"policy": "round-robin"}}, "routing"),
            ({"tenants": {"dave": {"keys": ["plain"]}}}, "admission.tenants.dave.keys"),
        ):
            async with session.post(f"{gw.url}/admin/reload", json=body, headers=admin) as r:
                assert r.status == 400 and where in (await r.json())["error"]["message"]
        assert (await post(session, gw.url, chat(), key="sk-carol"))[0] == 200


async def test_a_gate_reloaded_away_lets_requests_through() -> None:
    """`replica_max_concurrency: 1` and no queue, then reloaded to null: the second of two concurrent requests, refused
    before, is served."""
    admission = {"replica_max_concurrency": 1, "queue": {"max_queued": 0}, "targets": {"enabled": False}}
    async with stack(admission, decode_ms=30) as (gw, _, session):

        async def two() -> list[int]:
            first = asyncio.create_task(post(session, gw.url, chat(max_tokens=20)))
            await wait_for(lambda: gw.app[ADMISSION].tenant_in_flight("anonymous") > 0, 30.0, "request admitted")
            second = (await post(session, gw.url, chat()))[0]
            return [(await first)[0], second]

        assert await two() == [200, 503]
        admin = {"Authorization": "Bearer admin-key"}
        async with session.post(f"{gw.url}/admin/reload", json={"replica_max_concurrency": None}, headers=admin) as r:
            assert r.status == 200, await r.text()
        assert await two() == [200, 200]


async def test_queue_timeout_is_503_with_retry_after() -> None:
    admission = {"replica_max_concurrency": 1, "queue": {"max_wait_s": 0.2}}
    async with stack(admission, decode_ms=50) as (gw, _, session):
        slow = asyncio.create_task(post(session, gw.url, chat(max_tokens=40)))
        await wait_for(lambda: gw.app[ADMISSION].tenant_in_flight("anonymous") > 0, 30.0, "request admitted")
        status, headers, raw = await post(session, gw.url, chat())
        assert status == 503 and int(headers["Retry-After"]) >= 1
        assert json.loads(raw)["error"]["code"] == "queue_timeout"
        assert (await slow)[0] == 200


async def test_overload_3x_fails_fast_and_never_overfills() -> None:
    """Two engines of 4 slots each (capacity 8), 24 closed-loop clients: every request completes or gets 429/503
    with Retry-After; the gateway queue never exceeds its bound; the engines never queue (TTFT stays at capacity)."""
    admission = {"replica_max_concurrency": 4, "queue": {"max_queued": 6, "max_wait_s": 30}}
    async with stack(admission, engines=2, max_num_seqs=4, decode_ms=5, prefill_us_per_token=200) as (
        gw,
        servers,
        session,
    ):
        adm = gw.app[ADMISSION]
        peak = {"queued": 0, "engine_waiting": 0, "active": 0}
        done = asyncio.Event()

        async def monitor() -> None:
            while not done.is_set():
                peak["queued"] = max(peak["queued"], adm.capacity_gate.queued())
                peak["engine_waiting"] = max([peak["engine_waiting"], *(s.engine.waiting for s in servers)])
                peak["active"] = max(peak["active"], adm.capacity_gate._active.get(MODEL, 0))
                await asyncio.sleep(0.002)

        results: list[tuple[int, dict[str, str]]] = []

        async def client(i: int) -> None:
            for _ in range(4):
                status, headers, _ = await post(session, gw.url, chat(max_tokens=8, stream=i % 2 == 0))
                results.append((status, headers))

        mon = asyncio.create_task(monitor())
        await asyncio.gather(*(client(i) for i in range(24)))
        done.set()
        await mon
        assert len(results) == 96
        statuses = {s for s, _ in results}
        assert statuses <= {200, 429, 503} and 200 in statuses and 503 in statuses
        assert all(int(h["Retry-After"]) >= 1 for s, h in results if s != 200)
        assert peak["queued"] <= 6 and peak["active"] <= 8 and peak["engine_waiting"] == 0
        assert adm.capacity_gate.queued() == 0 and adm.capacity_gate._active.get(MODEL, 0) == 0  # nothing left behind
        reg = gw.app[REGISTRY]
        assert reg.get_sample_value(
            "kvgate_admission_rejections_total", {"tenant": "anonymous", "reason": "queue_full"}
        )


async def test_fairness_light_tenant_is_not_starved() -> None:
    tenants = {"flood": {"keys": [hash_key("sk-flood")]}, "light": {"keys": [hash_key("sk-light")]}}
    admission = {
        "auth": True,
        "tenants": tenants,
        "replica_max_concurrency": 2,
        "queue": {"max_queued": 64, "max_queued_per_tenant": 24, "max_wait_s": 60},
    }
    async with stack(admission, max_num_seqs=2, decode_ms=4) as (gw, _, session):
        flood_status: list[int] = []
        light_status: list[int] = []

        async def flooder() -> None:
            for _ in range(6):
                flood_status.append((await post(session, gw.url, chat(max_tokens=6), key="sk-flood"))[0])

        async def light() -> None:
            await wait_for(lambda: gw.app[ADMISSION].capacity_gate.queued_for("flood") >= 10, 30.0, "flood queued")
            for _ in range(6):
                light_status.append((await post(session, gw.url, chat(max_tokens=6), key="sk-light"))[0])

        await asyncio.gather(light(), *(flooder() for _ in range(30)))
        assert light_status == [200] * 6
        assert 200 in flood_status
        reg = gw.app[REGISTRY]

        def mean_wait(tenant: str) -> float:
            total = reg.get_sample_value("kvgate_queue_wait_seconds_sum", {"tenant": tenant}) or 0.0
            count = reg.get_sample_value("kvgate_queue_wait_seconds_count", {"tenant": tenant}) or 1.0
            return total / count

        assert mean_wait("light") < mean_wait("flood")


async def test_with_latency_targets_a_flood_of_streams_leaves_the_light_tenant_its_share() -> None:
    """Latency targets on (a 1 s TTFT target) beside a gate: a tenant flooding with streams queues; the waits the
    gateway's own fair queue grants are not the latency model's lateness, so the light tenant's queued streams keep
    their budget and are served first. When those waits were learned as lateness, the margin grew to the target,
    queued requests timed out at once, and the light tenant was refused (503 queue_timeout) while the flood got in by
    volume. Every request the queue refuses counts as a refused one of its targets, and the flood's backlog is
    refused at once (`queue_wait`: its wait predicted past its budget) rather than after waiting for it."""
    tenants = {"flood": {"keys": [hash_key("sk-flood")]}, "light": {"keys": [hash_key("sk-light")]}}
    admission = {
        "auth": True,
        "tenants": tenants,
        "replica_max_concurrency": 2,
        "queue": {"max_queued": 64, "max_queued_per_tenant": 32, "max_wait_s": 30},
        "targets": {"default": {"ttft_s": 1.0}},
    }
    async with stack(admission, max_num_seqs=2, decode_ms=20) as (gw, _, session):
        flood_status: list[int] = []
        light_status: list[int] = []
        flooding = True

        async def flooder() -> None:
            while flooding:
                flood_status.append((await post(session, gw.url, chat(max_tokens=10, stream=True), key="sk-flood"))[0])
                if flood_status[-1] != 200:
                    await asyncio.sleep(0.05)  # a client that tries again soon

        async def light() -> None:
            nonlocal flooding
            await wait_for(lambda: flood_status.count(200) >= 8, 60.0, "the flood's first answers")
            await wait_for(lambda: gw.app[ADMISSION].capacity_gate.queued_for("flood") >= 10, 30.0, "flood queued")
            for _ in range(6):
                light_status.append((await post(session, gw.url, chat(max_tokens=10, stream=True), key="sk-light"))[0])
            flooding = False

        await asyncio.gather(light(), *(flooder() for _ in range(24)))
        assert light_status == [200] * 6
        reg = gw.app[REGISTRY]
        refused = flood_status.count(503)
        slo = {"model": MODEL, "priority": "interactive", "tenant": "flood", "outcome": "refused"}
        assert (reg.get_sample_value("kvgate_slo_requests_total", slo) or 0.0) == refused
        # the flood's backlog is refused at once (its wait predicted past its budget), not after waiting for it
        by_reason = {
            reason: reg.get_sample_value("kvgate_admission_rejections_total", {"tenant": "flood", "reason": reason})
            or 0.0
            for reason in ("queue_wait", "queue_timeout")
        }
        assert by_reason["queue_wait"] > 2 * by_reason["queue_timeout"], by_reason


@pytest.mark.parametrize("access", ["auto", "public"])
async def test_metrics_and_readiness_detail_need_the_admin_key_on_an_authenticated_gateway(access: str) -> None:
    async with stack(ADMISSION_CFG, server={"metrics_access": access}) as (gw, _, session):
        admin = {"Authorization": "Bearer admin-key"}
        async with session.get(gw.url + "/metrics") as resp:
            assert resp.status == (401 if access == "auto" else 200)
        async with session.get(gw.url + "/metrics", headers=admin) as resp:
            assert resp.status == 200 and "kvgate_requests_total" in await resp.text()
        async with session.get(gw.url + "/ready") as resp:
            body = await resp.json()
            assert resp.status == 200 and body["ready"] is True
            assert ("models" in body) == (access == "public")  # no tenant or engine inventory for anyone
        async with session.get(gw.url + "/ready", headers=admin) as resp:
            assert "models" in await resp.json()


async def test_a_megabyte_session_key_is_not_kept_per_program(http: aiohttp.ClientSession) -> None:
    """The attained-service table kept each session's key as sent: 200 requests with a distinct 1 MiB `user` field
    held 200 MiB for good (its 65,536 entries bounded the count, not the bytes)."""

    async def sessions(users: range) -> None:
        body = {"model": "sim", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        for i in users:
            async with http.post(gw.url + "/v1/chat/completions", json={**body, "user": f"{i}" + "u" * 2**19}) as r:
                assert r.status == 200, await r.text()

    sim = SimConfig(model="sim", instant=True)
    async with gateway_over_sims([sim], cache={"tokenizers": {"sim": "sim"}}) as (gw, _):
        assert await kept_after(sessions(range(8)), sessions(range(8, 32))) < 2**22  # 24 keys of 512 KiB: 12 MiB


REFUSALS_CFG = {
    "auth": True,
    "replica_max_concurrency": 1,
    "queue": {"max_queued": 0},
    "targets": {"enabled": False},
    "tenants": {"t": {"keys": [hash_key("sk-t")], "limits": {"requests_per_minute": 3}}},
}


async def test_requests_refused_by_a_gate_do_not_spend_the_tenants_requests_per_minute() -> None:
    """requests_per_minute counts requests admitted: two 503s while the pool was full (a client retrying as
    Retry-After tells it) leave the tenant two of its three requests once the pool is free."""
    async with stack(REFUSALS_CFG, decode_ms=40) as (gw, _, session):
        slow = asyncio.create_task(post(session, gw.url, chat(max_tokens=30), key="sk-t"))
        await wait_for(lambda: gw.app[ADMISSION].tenant_in_flight("t") > 0, 30.0, "the first request admitted")
        refused = [(await post(session, gw.url, chat(), key="sk-t"))[0] for _ in range(2)]
        assert refused == [503, 503] and (await slow)[0] == 200
        status, headers, _ = await post(session, gw.url, chat(), key="sk-t")
        assert status == 200
        assert headers["x-ratelimit-remaining-requests"] in ("1", "2")  # 1 (the first and this one); 2 in a new minute


async def test_an_audio_upload_is_charged_its_audio_not_its_bytes() -> None:
    """A transcription's tokens are its audio: estimated from its bytes at 16 kHz PCM's rate (100 KiB: 160), then
    its usage in seconds (the simulated engine reports 1 s: 50 positions); not a token per 4 bytes (25,600, which
    left a tenant of 20,000 tokens a minute refused its next chat for the rest of the minute)."""
    limits = {"tokens_per_minute": 20_000}
    adm = {"auth": True, "tenants": {"t": {"keys": [hash_key("sk-t")], "limits": limits}}}
    async with stack(adm) as (gw, _, session):
        form = aiohttp.FormData({"model": MODEL})
        form.add_field("file", bytes(range(256)) * 400, filename="clip.wav")
        headers = {"Authorization": "Bearer sk-t"}
        async with session.post(f"{gw.url}/v1/audio/transcriptions", data=form, headers=headers) as resp:
            assert resp.status == 200
            assert int(resp.headers["x-ratelimit-remaining-tokens"]) == 20_000 - 160
        status, headers_, _ = await post(session, gw.url, chat(), key="sk-t")
        assert status == 200 and int(headers_["x-ratelimit-remaining-tokens"]) > 19_000
