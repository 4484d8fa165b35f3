"""An engine address that leads back to the gateway: refused as a loop (508), never multiplied.

How CI met it: the engine pool chose a port for a launched vLLM at random, before the gateway's own listener had
bound its configured port, and drew that port. The engine died on `Address already in use`; the gateway's probes of
the engine's address reached the gateway itself, which answered them, so the replica was routed to, and each request
sent "to the engine" came back into the gateway and went out again: one Codex request became 22 nested ones.
Now the pool never gives an engine the gateway's port, and every request the gateway sends names it
(`x-kvgate-via`), so one that comes back is refused at once: by the probes (the replica is never routed to) and
through a chain of gateways (the loop is cut where it closes, and the gateway before it tries another replica).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from engine_pool import launcher
from engine_pool.launcher import free_port
from gateway.embedded import running_gateway
from gateway.keys import IDS, POOL, REPLICAS
from simengine import SimConfig, run_sim_engine
from tests.conftest import gateway_config, wait_for

CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


@pytest.fixture
def access_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.INFO, logger="kvgate.access")
    caplog.set_level(logging.INFO, logger="kvgate.replicas")
    yield caplog


def records(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvgate.access"]


async def test_an_engine_address_that_is_the_gateway_itself_is_never_routed_to(
    access_log: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = gateway_config([], server={"port": port, "access_log": "json"}, engines=[{"url": url, "model": "sim"}])
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        await wait_for(lambda: "answers as this gateway" in access_log.text, what="the loop seen by the probe")
        assert not any(r.healthy for r in gw.app[REPLICAS])
        async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 503, await resp.text()  # no replica: the request went nowhere
        # a request that carries this gateway's mark came back to it: refused in the client's API shape
        own = {"x-kvgate-via": f"0123456789ab, {gw.app[IDS].instance}"}
        async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers=own) as resp:
            assert resp.status == 508
            assert (await resp.json())["error"]["code"] == "loop_detected"
        messages = {"model": "sim", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        async with http.post(f"{gw.url}/v1/messages", json=messages, headers=own) as resp:
            assert resp.status == 508
            assert (await resp.json())["error"]["type"] == "api_error"
        async with http.get(f"{gw.url}/health", headers={"x-kvgate-via": "0123456789ab"}) as resp:
            assert resp.status == 200  # another gateway's mark: a chain of gateways is no loop
    chats = [r for r in records(access_log) if r["endpoint"] == "chat"]
    # the first one once, not once per pass through itself; the one sent with its mark refused (and logged) once
    assert [r["status"] for r in chats] == [503, 508], chats


async def test_a_loop_through_two_gateways_is_cut_where_it_closes(access_log: pytest.LogCaptureFixture) -> None:
    """Gateway A routes to gateway B; B routes to an engine and to A. A request that B sends back to A is refused
    there (508: a middleware refusal, logged there as refused) and B answers it from its engine: every client
    request answered once."""
    a_port, b_port = free_port(), free_port()
    a_url, b_url = f"http://127.0.0.1:{a_port}", f"http://127.0.0.1:{b_port}"
    async with run_sim_engine(SimConfig(model="sim", instant=True)) as sim:
        sim_id = sim.url.removeprefix("http://")
        a_config = gateway_config([b_url], server={"port": a_port, "access_log": "json"})
        b_config = gateway_config(
            [], server={"port": b_port, "access_log": "json"}, routing={"policy": "round-robin"},
            engines=[{"url": sim.url}, {"url": a_url}],
        )  # fmt: skip
        async with running_gateway(b_config) as b, running_gateway(a_config) as a, aiohttp.ClientSession() as http:
            everyone = [*a.app[REPLICAS], *b.app[REPLICAS]]
            await wait_for(lambda: all(r.routable(time.monotonic()) for r in everyone), what="both gateways ready")
            statuses = []
            for i in range(6):
                body = {**CHAT, "messages": [{"role": "user", "content": f"question {i}"}]}
                async with http.post(f"{a.url}/v1/chat/completions", json=body) as resp:
                    statuses.append(resp.status)
    assert statuses == [200] * 6
    seen = records(access_log)
    answered = [r for r in seen if r["status"] == 200]
    assert len(answered) == 12  # A's six, then B's six: none multiplied
    # B tried A for some (round-robin), was refused there (A's 508 lines, one each), and answered from its engine
    retried = [r for r in answered if r["attempts"] == 2 and r["replica"] == sim_id]
    refused = [r["status"] for r in seen if r["endpoint"] == "chat" and r["status"] != 200]
    assert retried and refused == [508] * len(retried)  # (B's probes of A, as of an engine, are A's lines too)


async def test_the_pool_never_gives_an_engine_the_gateways_own_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's port is bound after its start-up launched the engines: the pool must not draw it for one."""
    port = free_port()
    drawn = iter([port - launcher._LOWEST_PORT])  # the first port drawn at random is the gateway's own

    def randbelow(n: int) -> int:
        return next(drawn, None) or launcher.secrets.SystemRandom().randrange(n)

    monkeypatch.setattr(launcher.secrets, "randbelow", randbelow)
    config = gateway_config(
        [], server={"port": port},
        pool={"log_dir": str(tmp_path / "logs"), "models": [{"name": "sim", "kind": "sim", "replicas": 1}]},
    )  # fmt: skip
    async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
        await gw.app[POOL].wait_ready(timeout_s=60)
        assert [r.url for r in gw.app[REPLICAS]] != [gw.url]
        async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200, await resp.text()
