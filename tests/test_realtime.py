"""`/v1/realtime` through kvgate (gateway/realtime.py) in front of simulated engines that speak vLLM's realtime
transcription protocol: a session relayed both ways to one replica, counted in its load; its bounds (sessions at
once, message size); what a client gets when it cannot have one (401, 404, 503 in OpenAI's shape, before the
upgrade); the engine closing and the gateway shutting down close the client's side with a code."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from typing import Any

import aiohttp
import pytest

from gateway.admission.auth import hash_key
from gateway.embedded import running_gateway
from gateway.keys import REGISTRY, REPLICAS
from simengine import SimConfig, run_sim_engine
from tests.conftest import gateway_config, gateway_over_sims, wait_for

MODEL = "sim-model"


def sims(n: int = 2) -> list[SimConfig]:
    return [SimConfig(model=MODEL, instant=True) for _ in range(n)]


async def transcribe(ws: aiohttp.ClientWebSocketResponse, audio: bytes) -> dict[str, Any]:
    await ws.send_json({"type": "session.update", "model": MODEL})
    for i in range(0, len(audio), 3200):
        await ws.send_json(
            {"type": "input_audio_buffer.append", "audio": base64.b64encode(audio[i : i + 3200]).decode()}
        )
    await ws.send_json({"type": "input_audio_buffer.commit"})
    delta = await ws.receive_json(timeout=10)
    assert delta["type"] == "transcription.delta", delta
    done = await ws.receive_json(timeout=10)
    assert done["type"] == "transcription.done", done
    return done


async def test_a_session_is_relayed_both_ways_to_one_replica_and_counted_in_its_load() -> None:
    audio = bytes(range(256)) * 400  # 102,400 bytes of "PCM": more than a request head may carry (64 KiB)
    async with gateway_over_sims(sims()) as (gw, _), aiohttp.ClientSession() as http:
        replicas = list(gw.app[REPLICAS])
        async with http.ws_connect(f"{gw.url}/v1/realtime?model={MODEL}") as ws:
            created = await ws.receive_json(timeout=10)
            assert created["type"] == "session.created" and created["id"].startswith("sess-")
            assert sorted(r.in_flight for r in replicas) == [0, 1]  # the session holds its replica
            done = await transcribe(ws, audio)
            assert done["text"] == f"{len(audio)} bytes, sum {sum(audio) % 65536}"  # every byte arrived, in order
            again = await transcribe(ws, audio[:640])
            assert again["text"].startswith("640 bytes")
            await ws.send_json({"type": "nonsense"})
            error = await ws.receive_json(timeout=10)
            assert error == {"type": "error", "error": "Unknown event type: nonsense", "code": "unknown_event"}
            async with http.ws_connect(f"{gw.url}/v1/realtime") as second:  # the only model, on the other replica
                assert (await second.receive_json(timeout=10))["type"] == "session.created"
                assert sorted(r.in_flight for r in replicas) == [1, 1]
        await wait_for(lambda: all(r.in_flight == 0 for r in replicas), what="sessions released")
        assert ws.close_code == aiohttp.WSCloseCode.OK
        # recorded as requests are: each session once, on its replica (and so in the access log)
        registry = gw.app[REGISTRY]
        counted = [
            registry.get_sample_value(
                "kvgate_requests_total", {"model": MODEL, "replica": r.id, "endpoint": "realtime", "status": "101"}
            )
            for r in replicas
        ]
        assert sorted(counted) == [1.0, 1.0]


async def test_bounds_and_refusals_are_answered_before_the_upgrade() -> None:
    keys = {"auth": True, "tenants": {"t": {"keys": [hash_key("sk-rt")]}}}
    overrides = {"server": {"realtime_max_sessions": 1, "realtime_max_message_bytes": 4096}, "admission": keys}
    auth = {"Authorization": "Bearer sk-rt"}
    async with gateway_over_sims(sims(1), **overrides) as (gw, _), aiohttp.ClientSession() as http:
        async with http.get(f"{gw.url}/v1/realtime", headers={"Upgrade": "websocket", "Connection": "Upgrade"}) as r:
            assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
        with pytest.raises(aiohttp.WSServerHandshakeError) as unknown:
            await http.ws_connect(f"{gw.url}/v1/realtime?model=nope", headers=auth)
        assert unknown.value.status == 404
        async with http.ws_connect(f"{gw.url}/v1/realtime", headers=auth) as ws:
            await ws.receive_json(timeout=10)
            with pytest.raises(aiohttp.WSServerHandshakeError) as full:
                await http.ws_connect(f"{gw.url}/v1/realtime", headers=auth)
            assert full.value.status == 503 and full.value.headers is not None and "Retry-After" in full.value.headers
            await ws.send_str("x" * 5000)  # over realtime_max_message_bytes: the session ends, 1009
            closing = await ws.receive(timeout=10)
            assert closing.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING)
            assert ws.close_code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
        (replica,) = gw.app[REPLICAS]
        await wait_for(lambda: replica.in_flight == 0, what="the session released")
        async with http.ws_connect(f"{gw.url}/v1/realtime", headers=auth) as ws:  # its place is free again
            assert (await ws.receive_json(timeout=10))["type"] == "session.created"


async def test_a_session_counts_in_its_tenants_quotas_and_a_bad_upgrade_reaches_no_engine() -> None:
    """A tenant limited to one request at once holds it with an open session: a second session and a chat request
    are refused 429 (sessions used to pass every quota); a plain GET, or an upgrade in HTTP/1.0, is 400 in OpenAI's
    shape before an engine is asked for a session (one was opened, and the refusal logged as the client leaving)."""
    tenants = {"t": {"keys": [hash_key("sk-rt")], "limits": {"max_concurrency": 1}}}
    auth = {"Authorization": "Bearer sk-rt"}
    async with (
        gateway_over_sims(sims(1), admission={"auth": True, "tenants": tenants}) as (gw, engines),
        aiohttp.ClientSession() as http,
    ):
        async with http.get(f"{gw.url}/v1/realtime", headers=auth) as plain:
            assert plain.status == 400 and (await plain.json())["error"]["code"] == "invalid_websocket_handshake"
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(
            b"GET /v1/realtime HTTP/1.0\r\nHost: x\r\nAuthorization: Bearer sk-rt\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        )
        assert (await reader.readline()).startswith(b"HTTP/1.0 400")
        writer.close()
        assert engines[0].engine.stats.realtime_sessions == 0
        async with http.ws_connect(f"{gw.url}/v1/realtime", headers=auth) as ws:
            assert (await ws.receive_json(timeout=10))["type"] == "session.created"
            with pytest.raises(aiohttp.WSServerHandshakeError) as limited:
                await http.ws_connect(f"{gw.url}/v1/realtime", headers=auth)
            assert limited.value.status == 429
            body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
            async with http.post(f"{gw.url}/v1/completions", json=body, headers=auth) as resp:
                assert resp.status == 429
        assert engines[0].engine.stats.realtime_sessions == 1
        registry = gw.app[REGISTRY]
        assert (
            registry.get_sample_value(
                "kvgate_requests_total", {"model": "-", "replica": "-", "endpoint": "realtime", "status": "400"}
            )
            == 2
        )


async def test_the_engine_going_away_and_the_gateway_shutting_down_close_the_session() -> None:
    async with contextlib.AsyncExitStack() as stack, aiohttp.ClientSession() as http:
        engine = contextlib.AsyncExitStack()
        sim = await engine.enter_async_context(run_sim_engine(SimConfig(model=MODEL, instant=True)))
        stack.push_async_callback(engine.aclose)
        gw = await stack.enter_async_context(running_gateway(gateway_config([sim.url])))
        (replica,) = gw.app[REPLICAS]
        await wait_for(lambda: replica.routable(time.monotonic()), what="the engine routable")
        async with http.ws_connect(f"{gw.url}/v1/realtime") as ws:
            await ws.receive_json(timeout=10)
            await engine.aclose()  # the engine stops: the client's session ends with it, told why
            msg = await ws.receive(timeout=10)
            assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == aiohttp.WSCloseCode.INTERNAL_ERROR, msg
    async with gateway_over_sims(sims(1)) as (gw, _), aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{gw.url}/v1/realtime") as ws:
            await ws.receive_json(timeout=10)
            started = time.monotonic()
            stopping = asyncio.create_task(gw.listener.stop())  # SIGTERM's path: open sessions told 1001
            msg = await ws.receive(timeout=10)
            assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == aiohttp.WSCloseCode.GOING_AWAY, msg
            await stopping
            assert time.monotonic() - started < 10


async def test_a_session_busy_one_way_is_not_idle_and_an_idle_one_is_closed_with_1001() -> None:
    """The client streams audio (the engine says nothing until a commit) for twice the idle bound: the session
    stays; then nothing either way for the bound: closed with 1001, not as a normal end."""
    async with (
        gateway_over_sims(sims(1), server={"keepalive_timeout_s": 1.0}) as (gw, _),
        aiohttp.ClientSession() as http,
    ):
        async with http.ws_connect(f"{gw.url}/v1/realtime") as ws:
            await ws.receive_json(timeout=10)
            await ws.send_json({"type": "session.update", "model": MODEL})
            chunk = base64.b64encode(bytes(320)).decode()
            for _ in range(8):  # 2.4 s of audio, a chunk every 0.3 s, one way only
                await ws.send_json({"type": "input_audio_buffer.append", "audio": chunk})
                await asyncio.sleep(0.3)
            await ws.send_json({"type": "input_audio_buffer.commit"})
            assert (await ws.receive_json(timeout=10))["type"] == "transcription.delta"  # the session lived on
            assert (await ws.receive_json(timeout=10))["type"] == "transcription.done"
            msg = await ws.receive(timeout=10)
            assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == aiohttp.WSCloseCode.GOING_AWAY, msg


async def test_a_client_that_takes_nothing_sent_to_it_gives_its_session_up() -> None:
    """The client sends messages the engine answers (error events) and never reads: the gateway's sends block. They
    used to block for good, holding the session's slot, its replica's load and its tenant's concurrency."""
    async with (
        gateway_over_sims(sims(1), server={"send_timeout_s": 1.0}) as (gw, _),
        aiohttp.ClientSession() as http,
    ):
        replicas = list(gw.app[REPLICAS])
        ws = await http.ws_connect(f"{gw.url}/v1/realtime", max_msg_size=0)
        await ws.receive_json(timeout=10)
        junk = "x" * 100_000
        for _ in range(300):  # 30 MB of echoed errors: far more than the socket buffers take
            await ws.send_json({"type": junk})
        await wait_for(lambda: all(r.in_flight == 0 for r in replicas), timeout_s=30, what="the session given up")
        ws._response.connection.transport.abort()  # type: ignore[union-attr]  # its unread answers go with it
        await ws.close()
