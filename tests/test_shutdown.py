"""Shutdown as clients see it: what outlasts `server.shutdown_grace_s` is ended in the client's API shape (a stream
with an error event and its proper end, an unanswered request 503 with Retry-After) and its engine request aborted;
`kvgate serve` ignores SIGHUP while it drains, and a second SIGTERM ends what is in flight at once."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

import aiohttp
import anthropic
import pytest
import yaml

from engine_pool.launcher import free_port
from gateway.admission.config import hash_key
from gateway.embedded import running_gateway
from gateway.serve import _announce_ready
from simengine import SimConfig, run_sim_engine
from tests.conftest import gateway_config, gateway_over_sims, wait_for

SLOW = SimConfig(model="sim", overhead_ms=0, prefill_us_per_token=0, decode_ms=20)  # 50 tokens a second
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5000}


def sse_events(raw: bytes) -> list[bytes]:
    return [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.startswith(b"data: ")]


async def test_what_outlasts_the_grace_is_ended_in_the_clients_api_shape() -> None:
    async with (
        gateway_over_sims([SLOW], server={"shutdown_grace_s": 0.5}) as (gw, sims),
        aiohttp.ClientSession() as http,
    ):
        url = gw.url + "/v1/chat/completions"
        stream = await http.post(url, json={**CHAT, "stream": True})
        assert stream.status == 200
        await stream.content.readuntil(b"\n\n")  # tokens are arriving
        whole = asyncio.create_task(http.post(url, json=CHAT))
        messages = anthropic.AsyncAnthropic(base_url=gw.url, api_key="x", max_retries=0)
        anthropic_stream = await messages.messages.create(
            model="sim", max_tokens=5000, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        await wait_for(lambda: sims[0].engine.running == 3, what="three requests generating")

        await gw.listener.stop()

        rest = await stream.read()  # the stream ended as HTTP means it: no payload error
        *_, last, done = sse_events(rest)  # the error event, then `[DONE]` as vLLM ends a stream after its error
        assert json.loads(last)["error"]["code"] == "shutting_down" and done == b"[DONE]"
        answer = await whole
        assert answer.status == 503 and answer.headers["Retry-After"]
        assert (await answer.json())["error"]["code"] == "shutting_down"
        kinds = []
        try:
            async for event in anthropic_stream:
                kinds.append(event.type)
        except anthropic.APIStatusError as err:  # the SDK raises an `error` event as an API error
            assert "shutting down" in str(err) and kinds and "message_stop" not in kinds
        else:
            raise AssertionError(f"the Messages stream ended without an error: {kinds}")
        await messages.close()
        await wait_for(lambda: sims[0].engine.running == 0, what="the engine's requests aborted")


def config(path: Path, engine: str, port: int) -> None:
    server = {"port": port, "access_log": "plain", "shutdown_grace_s": 60}
    path.write_text(yaml.safe_dump({"server": server, "engines": [{"url": engine}], "health": {"interval_s": 0.1}}))


async def test_serve_ignores_sighup_while_draining_and_a_second_sigterm_ends_streams_at_once(
    tmp_path: Path,
) -> None:
    async with run_sim_engine(SLOW) as sim, aiohttp.ClientSession() as http:
        port = free_port()
        config(tmp_path / "kvgate.yaml", sim.url, port)
        log = tmp_path / "kvgate.log"
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvgate", "serve", "-c", str(tmp_path / "kvgate.yaml"), stdout=out, stderr=out
            )
        try:
            await wait_for(lambda: b"ready: sim" in log.read_bytes(), timeout_s=30, what="the gateway ready")
            stream = await http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={**CHAT, "stream": True})
            assert stream.status == 200
            await stream.content.readuntil(b"\n\n")

            proc.send_signal(signal.SIGTERM)  # drains: the stream goes on
            await wait_for(lambda: b"shutting down" in log.read_bytes(), what="the drain begun")
            proc.send_signal(signal.SIGHUP)
            await wait_for(lambda: b"SIGHUP ignored" in log.read_bytes(), what="SIGHUP refused")
            seen = len(await stream.content.readuntil(b"\n\n"))
            assert proc.returncode is None and seen  # still serving the stream
            proc.send_signal(signal.SIGTERM)  # the second: ended now, in the API's shape

            rest = await asyncio.wait_for(stream.read(), 30)
            assert json.loads(sse_events(rest)[-2])["error"]["code"] == "shutting_down"
            assert await asyncio.wait_for(proc.wait(), 30) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        text = log.read_text()
        assert "status=503" in text and "shutting_down" in text, text[-2000:]


async def test_the_ready_line_names_the_engines_not_reached_yet(caplog: pytest.LogCaptureFixture) -> None:
    """Two engines configured, one not running: the gateway says it is ready with the one it reached, and names the
    other (it counted 1/1 replicas as if there were no other)."""
    dead = f"http://127.0.0.1:{free_port()}"
    async with run_sim_engine(SLOW) as sim, running_gateway(gateway_config([sim.url, dead])) as gw:
        with caplog.at_level(logging.INFO, logger="kvgate"):
            await asyncio.wait_for(_announce_ready(gw.app, gw.url), 30)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready: ")]
    assert line.startswith(f"ready: sim (1/1 replicas ready); 1 more engine not reached yet ({dead}). "), line


async def test_the_ready_line_comes_when_ready_says_ready_with_the_key_its_curl_needs(
    caplog: pytest.LogCaptureFixture, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """A tokenizer that does not load keeps /ready 503 until it falls back: the line came before (its curl then
    failed), and with auth on its curl had no key (401)."""
    cfg = gateway_config(
        [],
        cache={"tokenizers": {"sim": str(tmp_path / "missing")}},
        admission={"auth": True, "tenants": {"t": {"keys": [hash_key("sk-t")]}}},
    )
    async with run_sim_engine(SLOW) as sim:
        cfg = cfg.model_copy(update={"engines": gateway_config([sim.url]).engines})
        async with running_gateway(cfg) as gw:
            with caplog.at_level(logging.INFO, logger="kvgate"):
                await asyncio.wait_for(_announce_ready(gw.app, gw.url), 60)
                async with http.get(gw.url + "/ready") as resp:
                    assert resp.status == 200, await resp.text()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready: ")]
    assert "-H 'Authorization: Bearer YOUR_KEY'" in line, line
