"""An engine that publishes neither KV events nor its capacity: kvgate learns its cache from `cached_tokens`."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from simengine import SimConfig
from tests.conftest import gateway_over_sims


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


async def test_capacity_is_estimated_and_stale_entries_dropped(http: aiohttp.ClientSession) -> None:
    sim = SimConfig(model="sim", block_size=16, num_blocks=64, hide_cache_config=True, prefill_us_per_token=0)
    cache = {"tokenizers": {"sim": "sim"}, "default_block_size": 16}
    async with gateway_over_sims([sim], routing={"policy": "cache-aware"}, cache=cache) as (gw, _):
        prompts = [f"prompt {i:02d} " + "x" * 640 for i in range(12)]  # ~10 blocks each: 120 blocks > 64

        async def complete(prompt: str) -> int:
            body = {"model": "sim", "prompt": prompt, "max_tokens": 1}
            async with http.post(f"{gw.url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                data = await resp.json()
            cached: int = data["usage"]["prompt_tokens_details"]["cached_tokens"]
            return cached

        for p in prompts:  # one at a time: every block is settled when the next request is routed
            assert await complete(p) == 0
        assert await complete(prompts[0]) == 0  # evicted by the engine; kvgate believed it cached
        async with http.get(f"{gw.url}/metrics") as resp:
            text = await resp.text()
        capacity = samples(text, "kvgate_prefix_index_capacity_blocks")
        ((labels, estimate),) = capacity.items()
        assert dict(labels)["source"] == "estimated"
        assert 16 <= estimate < 200  # learned from the age of the missing blocks, down from 65,536
        corrections = samples(text, "kvgate_prefix_index_corrections_total")
        assert sum(corrections.values()) > 0
