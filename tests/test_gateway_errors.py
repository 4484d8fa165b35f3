"""Every bad input and every upstream failure gets its status and OpenAI's error shape; random bodies never 500."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_pool.launcher import free_port
from gateway.anthropic import messages_as_chat
from gateway.embedded import RunningGateway, running_gateway
from gateway.errors import Overloaded
from gateway.keys import REPLICAS
from gateway.request_parse import parse_request
from simengine import Faults, SimConfig, run_sim_engine
from tests.conftest import gateway_config, gateway_over_sims, kept_after, wait_for

SIM = SimConfig(model="sim", instant=True)
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def assert_error_shape(body: Any) -> None:
    assert set(body) == {"error"}
    assert {"message", "type", "param", "code"} <= set(body["error"])
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


BAD_INPUTS: list[tuple[str, str, bytes, int, str | None]] = [
    ("malformed json", CHAT, b"{not json", 400, None),
    ("not an object", CHAT, b"[1, 2]", 400, None),
    (
        "model not a string",
        CHAT,
        json.dumps({"model": 42, "messages": [{"role": "user", "content": "x"}]}).encode(),
        400,
        "model",
    ),
    ("model not a string", COMP, json.dumps({"model": 3, "prompt": "x"}).encode(), 400, "model"),
    ("missing messages", CHAT, json.dumps({"model": "sim"}).encode(), 400, "messages"),
    ("empty messages", CHAT, json.dumps({"model": "sim", "messages": []}).encode(), 400, "messages"),
    (
        "message without role",
        CHAT,
        json.dumps({"model": "sim", "messages": [{"content": "x"}]}).encode(),
        400,
        "messages[0].role",
    ),
    ("missing prompt", COMP, json.dumps({"model": "sim"}).encode(), 400, "prompt"),
    ("prompt wrong type", COMP, json.dumps({"model": "sim", "prompt": {"a": 1}}).encode(), 400, "prompt"),
    ("stream not bool", COMP, json.dumps({"model": "sim", "prompt": "x", "stream": "maybe"}).encode(), 400, "stream"),
    (
        "negative max_tokens",
        COMP,
        json.dumps({"model": "sim", "prompt": "x", "max_tokens": -1}).encode(),
        400,
        "max_tokens",
    ),
    (
        "fractional max_tokens",
        COMP,
        json.dumps({"model": "sim", "prompt": "x", "max_tokens": 4.5}).encode(),
        400,
        "max_tokens",
    ),
    ("unknown model", COMP, json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404, "model"),
    ("body too large", COMP, json.dumps({"model": "sim", "prompt": "x" * 70_000}).encode(), 413, None),
    ("engine rejects n=2", COMP, json.dumps({"model": "sim", "prompt": "x", "n": 2}).encode(), 400, None),
]


@pytest.fixture
async def gateway() -> AsyncIterator[RunningGateway]:
    async with gateway_over_sims([SIM], server={"max_body_bytes": 65_536}) as (gw, _):
        yield gw


async def test_bad_inputs_table(gateway: RunningGateway, http: aiohttp.ClientSession) -> None:
    for name, path, body, status, param in BAD_INPUTS:
        async with http.post(gateway.url + path, data=body, headers={"Content-Type": "application/json"}) as resp:
            payload = await resp.json()
            assert resp.status == status, (name, payload)
            assert_error_shape(payload)
            if param is not None:
                assert payload["error"]["param"] == param, name
            assert resp.headers.get("x-request-id"), name


@pytest.mark.parametrize(("max_tokens", "stream"), [("4", "true"), (4.0, 1)])
def test_a_field_is_read_as_vllm_reads_it(max_tokens: object, stream: object) -> None:
    """vLLM's request models take 4.0 and "4" for an integer, "true" and 1 for a boolean (pydantic's lax mode):
    the gateway is no stricter, and knows such a request streams."""
    raw = json.dumps({"model": "m", "prompt": "x", "max_tokens": max_tokens, "stream": stream}).encode()
    parsed = parse_request("completions", raw, max_depth=64)
    assert parsed.max_tokens == 4 and parsed.stream is True
    body = {"max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]}
    assert messages_as_chat(body) is not None


async def test_wrong_method_and_unknown_path(gateway: RunningGateway, http: aiohttp.ClientSession) -> None:
    async with http.get(gateway.url + CHAT) as resp:
        assert resp.status == 405 and resp.headers["Allow"] == "POST"  # RFC 9110: the methods it takes
        assert_error_shape(await resp.json())
    async with http.get(gateway.url + "/v1/nothing") as resp:
        assert resp.status == 404
        assert_error_shape(await resp.json())
    # below Anthropic's Messages API, in its shape (the anthropic SDK reads that): a method, a route kvgate lacks
    for method, path, status in (("GET", "/v1/messages", 405), ("POST", "/v1/messages/batches", 404)):
        async with http.request(method, gateway.url + path) as resp:
            body = await resp.json()
            assert resp.status == status and body["type"] == "error" and body["error"]["type"], body
    async with http.get(gateway.url + "/metrics") as resp:  # a scan shows in the metrics, in bounded series
        text = await resp.text()
    assert 'kvgate_requests_total{endpoint="unrouted",model="-",replica="-",status="404"} 2.0' in text
    assert 'kvgate_requests_total{endpoint="unrouted",model="-",replica="-",status="405"} 2.0' in text


async def _post(http: aiohttp.ClientSession, url: str, **extra: Any) -> tuple[int, Any, Any]:
    async with http.post(url + COMP, json={"model": "sim", "prompt": "x", **extra}) as resp:
        return resp.status, await resp.json(), resp.headers


async def test_no_ready_replica_is_503_with_retry_after(http: aiohttp.ClientSession) -> None:
    sick = SIM.model_copy(update={"faults": Faults(fail_health=True)})
    async with run_sim_engine(sick) as engine:
        cfg = gateway_config([], engines=[{"url": engine.url, "model": "sim"}])
        async with running_gateway(cfg) as gw:
            status, body, headers = await _post(http, gw.url)
            assert status == 503 and int(headers["Retry-After"]) >= 1
            assert_error_shape(body)
            async with http.get(gw.url + "/ready") as resp:
                assert resp.status == 503


async def test_upstream_timeout_is_504(http: aiohttp.ClientSession) -> None:
    stalled = SIM.model_copy(update={"faults": Faults(stall_s=30, stall_rate=1.0)})
    timeouts = {"first_byte_s": 0.3, "total_s": 0.6}  # a whole answer: total_s; a stream's first event: first_byte_s
    async with gateway_over_sims([stalled], timeouts=timeouts, retry={"max_attempts": 1}) as (gw, _):
        status, body, _ = await _post(http, gw.url)
        assert status == 504 and body["error"]["code"] == "upstream_timeout"
        status, body, _ = await _post(http, gw.url, stream=True)
        assert status == 504


async def test_upstream_error_is_relayed_with_its_status(http: aiohttp.ClientSession) -> None:
    failing = SIM.model_copy(update={"faults": Faults(error_rate=1.0)})
    async with gateway_over_sims([failing], retry={"max_attempts": 1}) as (gw, _):
        status, body, _ = await _post(http, gw.url)
        assert status == 500
        assert_error_shape(body)


async def test_replica_killed_mid_run_loses_no_unstarted_request(http: aiohttp.ClientSession) -> None:
    slow = SimConfig(model="sim", overhead_ms=50, prefill_us_per_token=0, decode_ms=1)
    async with run_sim_engine(slow) as survivor:
        doomed_cm = run_sim_engine(slow)
        doomed = await doomed_cm.__aenter__()
        cfg = gateway_config(
            [doomed.url, survivor.url],
            routing={"policy": "round-robin"},
            retry={"breaker_failures": 1, "breaker_cooldown_s": 60},
        )
        async with running_gateway(cfg) as gw:
            await wait_for(lambda: all(r.routable(time.monotonic()) for r in gw.app[REPLICAS]))
            tasks = [asyncio.create_task(_post(http, gw.url, max_tokens=4)) for _ in range(20)]
            await wait_for(lambda: doomed.engine.running > 0, what="requests on the doomed replica")
            await doomed_cm.__aexit__(None, None, None)  # the replica dies with requests in flight
            results = await asyncio.gather(*tasks)
            assert [status for status, _, _ in results] == [200] * 20
            assert survivor.engine.stats.completed >= 10


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "model",
                        "messages",
                        "prompt",
                        "stream",
                        "max_tokens",
                        "n",
                        "stream_options",
                        "role",
                        "content",
                        "x",
                    ]
                ),
                children,
                max_size=5,
            )
        ),
        max_leaves=12,
    )
)
def test_random_json_bodies_never_500(body: Any) -> None:
    async def run() -> None:
        async with gateway_over_sims([SIM]) as (gw, _), aiohttp.ClientSession() as http:
            for path in (CHAT, COMP):
                async with http.post(gw.url + path, json=body) as resp:
                    assert resp.status < 500, await resp.text()

    asyncio.run(run())


async def test_unknown_models_do_not_grow_metric_labels(gateway: RunningGateway, http: aiohttp.ClientSession) -> None:
    for i in range(5):
        async with http.post(gateway.url + COMP, json={"model": f"nope-{i}", "prompt": "x"}) as resp:
            assert resp.status == 404
    metrics = await (await http.get(gateway.url + "/metrics")).text()
    assert "nope-" not in metrics
    assert 'kvgate_requests_total{endpoint="completions",model="-",replica="-",status="404"} 5.0' in metrics


def established_to(port: int) -> int:
    """TCP connections in this process's network namespace that are established to `port` (what the OS sees)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                    count += 1
    return count


@pytest.mark.parametrize("request_id", ["price-in-€", "x" * 1000, "two words"])
async def test_a_request_id_that_cannot_travel_is_400_and_leaks_no_connection(
    request_id: str, http: aiohttp.ClientSession
) -> None:
    async with gateway_over_sims([SIM]) as (gw, sims):
        body = {"model": "sim", "prompt": "x", "max_tokens": 2}
        async with http.post(gw.url + COMP, json=body) as resp:
            assert resp.status == 200  # warm: one kept-alive connection to the engine
        before = established_to(sims[0].port)
        for _ in range(20):
            headers = {"x-request-id": request_id.encode().decode("latin-1")}  # the client's raw UTF-8 bytes
            async with http.post(gw.url + COMP, json=body, headers=headers) as resp:
                assert resp.status == 400
                error = (await resp.json())["error"]
                assert error["param"] == "x-request-id" and resp.headers["x-request-id"] != request_id
        assert established_to(sims[0].port) <= before
        async with http.post(gw.url + COMP, json=body, headers={"x-request-id": "fine-123"}) as resp:
            assert resp.status == 200 and resp.headers["x-request-id"] == "fine-123"


async def test_a_model_asked_for_before_its_engine_answered_is_503_not_404(http: aiohttp.ClientSession) -> None:
    """An attached engine kvgate has not reached yet may serve the model: 503 with Retry-After, then 200."""
    port = free_port()
    cfg = gateway_config([f"http://127.0.0.1:{port}"])  # no model given: learned from the engine's /v1/models
    async with running_gateway(cfg) as gw:
        body = {"model": "sim", "prompt": "x", "max_tokens": 2}
        async with http.post(gw.url + COMP, json=body) as resp:
            assert resp.status == 503 and resp.headers["Retry-After"]
            assert (await resp.json())["error"]["code"] == "engines_not_discovered"
        async with run_sim_engine(SIM.model_copy(update={"port": port})):
            replicas = gw.app[REPLICAS]  # discovered, then routable (healthy): a first check may lag the discovery
            await wait_for(
                lambda: any(r.routable(time.monotonic()) for r in replicas.for_model("sim")), what="the model routable"
            )
            async with http.post(gw.url + COMP, json=body) as resp:
                assert resp.status == 200
            async with http.post(gw.url + COMP, json={**body, "model": "other"}) as resp:
                assert resp.status == 404  # every engine answered: an unknown model does not exist


def test_retry_after_is_rounded_up() -> None:
    """A client that waits exactly Retry-After must find room: 16.3 s left is 17, not 16."""
    assert Overloaded("full", retry_after_s=16.3).headers["Retry-After"] == "17"
    assert Overloaded("full", retry_after_s=0.2).headers["Retry-After"] == "1"
    assert Overloaded("behind an overdue request", retry_after_s=900).headers["Retry-After"] == "60"  # at most a minute


async def test_unknown_model_names_are_not_kept(http: aiohttp.ClientSession) -> None:
    """The model-name caches kept every name asked about (up to 1,024, of any length): 200 requests naming a
    distinct 1 MiB model kept 200 MiB for good, and filled the caches so real names were no longer cached. The 404
    quoted the whole name back (orjson reserved 16x its size to write it)."""

    async def unknown(names: range) -> None:
        for i in names:
            body = {"model": f"{i}" + "m" * 2**19, "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:  # not quoted back whole
                assert resp.status == 404 and len(await resp.read()) < 4096

    async with gateway_over_sims([SimConfig(model="sim", instant=True)]) as (gw, _):
        assert await kept_after(unknown(range(8)), unknown(range(8, 32))) < 2**22  # 24 names of 512 KiB: 12 MiB
