"""Simulated vLLM engine: tokenizer, prefix-cache model, scheduler, HTTP endpoints, faults, KV events, CLI."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import aiohttp
import msgpack
import openai
import pytest
import zmq
import zmq.asyncio
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from simengine import Faults, SimConfig, run_sim_engine
from simengine.cache import Allocation, CacheFullError, PrefixCache, blocks_for, chain_block_hashes
from simengine.engine import SimEngine
from simengine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventDecodeError,
    decode_kv_event_batch,
    decode_seq,
    encode_kv_event_batch,
)
from simengine.tokenize import detokenize, render_chat, tokenize_chat, tokenize_text

REPO = Path(__file__).resolve().parents[1]
CHAT = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "Say something."}]
OAI_CHAT = cast("list[ChatCompletionMessageParam]", CHAT)


# --- tokenizer ------------------------------------------------------------------------------------------------
def test_render_chat_template() -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_chat(msgs) == "<|user|>\nab\n<|assistant|>\n"
    assert render_chat([{"role": "system", "content": "s"}], add_generation_prompt=False) == "<|system|>\ns\n"
    with pytest.raises(ValueError):
        render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(ValueError):
        render_chat([{"content": "no role"}])


def test_tokenizer_is_byte_chunks_and_reversible() -> None:
    assert tokenize_text("abcdef") == [int.from_bytes(b"abcd", "little"), int.from_bytes(b"ef", "little")]
    text = "héllo wörld, 漢字 " * 7
    ids = tokenize_text(text)
    assert ids == tokenize_text(text)
    assert len(ids) == -(-len(text.encode()) // 4)
    assert detokenize(ids) == text
    assert tokenize_chat(CHAT) == tokenize_text(render_chat(CHAT))
    with pytest.raises(ValueError):
        detokenize([2**40])


def test_chain_block_hashes_prefix_property() -> None:
    tokens = list(range(40))
    h = chain_block_hashes(tokens, 16, "m")
    assert len(h) == 2  # the partial third block is not hashed
    assert chain_block_hashes(tokens[:32], 16, "m") == h
    assert chain_block_hashes([*tokens[:16], 99, *tokens[17:]], 16, "m")[0] == h[0]
    assert chain_block_hashes([*tokens[:16], 99, *tokens[17:]], 16, "m")[1] != h[1]
    assert chain_block_hashes(tokens, 16, "other")[0] != h[0]
    assert all(0 <= x < 2**64 for x in h)


# --- cache model ------------------------------------------------------------------------------------------------
def _cache(num_blocks: int, block_size: int = 4) -> PrefixCache:
    return PrefixCache(num_blocks, block_size, "m", record_events=True)


def _admit(cache: PrefixCache, tokens: Sequence[int], max_tokens: int = 1) -> Allocation:
    return cache.admit(tokens, cache.block_hashes(tokens), len(tokens) + max_tokens)


def test_cache_hits_capped_before_last_token() -> None:
    cache = _cache(16)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = _admit(cache, prompt)
    assert a.cached_tokens == 0 and a.private_blocks == blocks_for(11, 4) - 2
    cache.release(a)
    b = _admit(cache, prompt)
    assert b.cached_tokens == 8 and b.hit_blocks == 2
    cache.release(b)
    exact = list(range(8))  # prompt fully cached: the last block is recomputed, like vLLM
    assert _admit(cache, exact).cached_tokens == 4
    assert cache.queries_tokens == 28 and cache.hit_tokens == 12


def test_cache_lru_evicts_oldest_released_tail_first() -> None:
    cache = _cache(6)
    a, b = list(range(100, 108)), list(range(200, 208))  # 2 full blocks each, +1 private block
    cache.release(_admit(cache, a))
    cache.release(_admit(cache, b))
    ha, hb = cache.block_hashes(a), cache.block_hashes(b)
    assert cache.lookup(ha) == 2 and cache.lookup(hb) == 2
    cache.drain_events()
    c = list(range(300, 308))
    cache.release(_admit(cache, c))  # needs 3 blocks, 2 free: evicts a's tail block first
    assert cache.lookup(ha) == 1 and cache.lookup(hb) == 2
    events = cache.drain_events()
    assert events[0] == BlockRemoved(block_hashes=(ha[1],))
    stored = events[1]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == tuple(cache.block_hashes(c)) and stored.parent_block_hash is None
    assert stored.token_ids == tuple(c) and stored.block_size == 4


def test_cache_pins_running_blocks_and_shares_them() -> None:
    cache = _cache(6)
    prompt = list(range(8))
    first = _admit(cache, prompt, max_tokens=4)  # 3 blocks: 2 shared prompt blocks + 1 private
    assert cache.usage == pytest.approx(0.5)
    assert cache.fits(cache.block_hashes(prompt), 12)  # same prompt: only its private block is new
    second = _admit(cache, prompt, max_tokens=4)
    assert second.cached_tokens == 4 and cache.used_blocks == 4
    other = list(range(50, 58))
    assert not cache.fits(cache.block_hashes(other), 12)  # needs 3, 2 left: pinned blocks are not evictable
    with pytest.raises(CacheFullError):
        _admit(cache, other, max_tokens=4)
    cache.release(first)  # its private block is freed; the prompt blocks stay pinned by `second`
    assert cache.used_blocks == 3 and cache.fits(cache.block_hashes(other), 12)
    cache.release(second)
    assert cache.used_blocks == 0 and cache.lookup(cache.block_hashes(prompt)) == 2
    assert not cache.can_ever_fit(25)


def test_cache_stored_event_parent_and_reset() -> None:
    cache = _cache(16)
    prompt = list(range(12))
    cache.release(_admit(cache, prompt[:4]))
    cache.drain_events()
    held = _admit(cache, prompt)
    (stored,) = cache.drain_events()
    hashes = cache.block_hashes(prompt)
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash == hashes[0] and stored.block_hashes == tuple(hashes[1:])
    assert stored.token_ids == tuple(prompt[4:12])
    assert not cache.reset()  # blocks in use
    cache.release(held)
    assert cache.reset() and cache.cached_blocks == 0
    assert cache.drain_events() == [AllBlocksCleared()]


def test_cpu_tier_keeps_what_the_gpu_evicts_and_loads_it_back() -> None:
    cache = PrefixCache(3, 4, "m", record_events=True, cpu_blocks=4)
    a, b = list(range(100, 109)), list(range(200, 209))  # 2 full blocks + 1 token each, +1 private block
    ha, hb = cache.block_hashes(a), cache.block_hashes(b)
    cache.release(_admit(cache, a))
    stored_gpu, stored_cpu = cache.drain_events()
    assert isinstance(stored_gpu, BlockStored) and stored_gpu.medium == "GPU"
    assert isinstance(stored_cpu, BlockStored) and stored_cpu.medium == "CPU"
    assert stored_cpu.block_hashes == tuple(ha) and stored_cpu.token_ids == tuple(a[:8])  # self-describing
    cache.release(_admit(cache, b))  # the GPU (3 blocks) evicts a; the CPU tier (4) holds both
    assert cache.lookup(ha) == 0 and cache.lookup_offloaded(ha, 0) == 2
    events = cache.drain_events()
    assert BlockRemoved(block_hashes=(ha[1], ha[0])) in events
    again = _admit(cache, a)
    assert (again.hit_blocks, again.loaded_blocks, again.cached_tokens) == (0, 2, 8)
    assert cache.loaded_tokens == 8 and cache.hit_tokens == 0
    cache.release(again)
    c = list(range(300, 309))
    cache.release(_admit(cache, c))  # the CPU tier evicts its least recently used: b
    assert cache.lookup_offloaded(hb, 0) == 0 and cache.lookup_offloaded(ha, 0) == 2
    assert BlockRemoved(block_hashes=(hb[0], hb[1]), medium="CPU") in cache.drain_events()


# --- scheduler (no HTTP) ------------------------------------------------------------------------------------------
async def test_engine_waits_for_kv_space_then_admits() -> None:
    engine = SimEngine(SimConfig(instant=True, block_size=4, num_blocks=4, max_num_seqs=8))
    gate = asyncio.Event()
    outputs: list[list[str]] = []

    async def held(words: Sequence[str], cached: int) -> None:
        outputs.append(list(words))
        await gate.wait()

    a, b = list(range(8)), list(range(100, 108))  # each needs ceil((8 + 4) / 4) = 3 of the 4 blocks
    task_a = asyncio.create_task(engine.generate(a, engine.cache.block_hashes(a), 4, held))
    await engine.wait_until(lambda e: e.running == 1)
    task_b = asyncio.create_task(engine.generate(b, engine.cache.block_hashes(b), 4, held))
    await engine.wait_until(lambda e: e.waiting == 1)
    assert engine.running == 1 and engine.cache.usage == pytest.approx(0.75)
    gate.set()
    ra, rb = await asyncio.gather(task_a, task_b)
    assert (ra.completion_tokens, rb.completion_tokens) == (4, 4)
    assert engine.stats.completed == 2 and engine.running == 0 and engine.waiting == 0
    assert [len(o) for o in outputs] == [4, 4]  # instant mode: one emit with every token


async def test_engine_seq_slots_and_deterministic_output() -> None:
    engine = SimEngine(SimConfig(instant=True, max_num_seqs=1))
    gate = asyncio.Event()
    seen: list[str] = []

    async def emit(words: Sequence[str], cached: int) -> None:
        seen.append("".join(words))
        await gate.wait()

    p = tokenize_text("same prompt " * 20)  # 240 bytes = 60 tokens
    tasks = [asyncio.create_task(engine.generate(p, engine.cache.block_hashes(p), 6, emit)) for _ in range(3)]
    await engine.wait_until(lambda e: e.waiting == 2)
    gate.set()
    await asyncio.gather(*tasks)
    assert len(set(seen)) == 1 and seen[0].count(" w") == 6
    assert engine.stats.cached_tokens_total == 2 * 48  # 60 tokens: 3 full blocks of 16 cached on repeats


# --- HTTP ---------------------------------------------------------------------------------------------------------
async def test_info_endpoints_and_errors() -> None:
    cfg = SimConfig(instant=True, model="tiny", max_model_len=256)
    async with run_sim_engine(cfg) as sim, aiohttp.ClientSession() as http:
        async with http.get(f"{sim.url}/v1/models") as r:
            card = (await r.json())["data"][0]
            assert (card["id"], card["max_model_len"]) == ("tiny", 256)
        async with http.get(f"{sim.url}/health", headers={"X-Request-Id": "rid-1"}) as r:
            assert r.status == 200 and r.headers["X-Request-Id"] == "rid-1"
        async with http.get(f"{sim.url}/version") as r:
            assert "version" in await r.json()
        async with http.get(f"{sim.url}/load") as r:
            assert await r.json() == {"server_load": 0}
        body = {"model": "tiny", "messages": CHAT, "add_generation_prompt": False}
        async with http.post(f"{sim.url}/tokenize", json=body) as r:
            tok = await r.json()
            assert tok == {"count": len(tok["tokens"]), "max_model_len": 256, "tokens": tokenize_chat(CHAT, False)}
        async with http.post(f"{sim.url}/tokenize", json={"model": "tiny", "prompt": "hi there"}) as r:
            assert (await r.json())["tokens"] == tokenize_text("hi there")
        async with http.post(f"{sim.url}/detokenize", json={"tokens": tokenize_text("hi there")}) as r:
            assert await r.json() == {"prompt": "hi there"}
        bad: list[tuple[str, object, int, str | None]] = [
            ("/v1/chat/completions", {"model": "nope", "messages": CHAT}, 404, "model"),
            ("/v1/chat/completions", {"messages": []}, 400, "messages"),
            ("/v1/chat/completions", {"messages": CHAT, "n": 2}, 400, "n"),
            ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "x"}, 400, "max_tokens"),
            ("/v1/completions", {"prompt": [-1]}, 400, "prompt"),
            ("/v1/completions", {"prompt": "x" * 2000}, 400, "prompt"),
            ("/v1/completions", [1, 2], 400, None),
        ]
        for path, payload, status, param in bad:
            async with http.post(f"{sim.url}{path}", json=payload) as r:
                err = (await r.json())["error"]
                assert r.status == status and err["code"] == status and err["param"] == param, (path, err)
                assert set(err) == {"message", "type", "param", "code"}
        async with http.post(f"{sim.url}/v1/completions", data=b"{not json") as r:
            assert r.status == 400 and (await r.json())["error"]["type"] == "BadRequestError"
        async with http.get(f"{sim.url}/no/such/path") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == 404
        async with http.post(f"{sim.url}/reset_prefix_cache") as r:
            assert r.status == 200
        async with http.get(f"{sim.url}/sim/stats") as r:
            stats = await r.json()
        assert stats["rejected"] == len(bad) + 1
        for key in (
            "started",
            "completed",
            "cancelled",
            "failed",
            "running",
            "waiting",
            "generated_tokens",
            "cached_tokens_total",
            "prompt_tokens_total",
        ):
            assert stats[key] == 0, key


async def test_full_waiting_queue_answers_503() -> None:
    cfg = SimConfig(decode_ms=10, max_num_seqs=1, max_waiting=0)
    async with run_sim_engine(cfg) as sim, aiohttp.ClientSession() as http:
        body = {"messages": CHAT, "max_tokens": 3000, "stream": True}
        holder = await http.post(f"{sim.url}/v1/chat/completions", json=body)
        await holder.content.readline()
        async with http.post(f"{sim.url}/v1/chat/completions", json={"messages": CHAT}) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == 503
        holder.close()
        await sim.engine.wait_until(lambda e: e.running == 0)
        assert sim.engine.stats.failed == 1 and sim.engine.stats.cancelled == 1


async def test_completions_json_and_sse_through_aiohttp() -> None:
    async with run_sim_engine(SimConfig(instant=True, max_model_len=64)) as sim, aiohttp.ClientSession() as http:
        body = {"prompt": "p" * 200, "max_tokens": 10, "unknown_field": {"x": 1}, "temperature": 0.3}
        async with http.post(f"{sim.url}/v1/completions", json=body, headers={"X-Request-Id": "r7"}) as r:
            out = await r.json()
        assert r.headers["X-Request-Id"] == "r7" and out["id"].startswith("cmpl-")
        assert out["object"] == "text_completion" and out["choices"][0]["finish_reason"] == "length"
        assert out["usage"] == {
            "prompt_tokens": 50,
            "completion_tokens": 10,
            "total_tokens": 60,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        capped = {"prompt": list(range(1, 61)), "max_tokens": 100, "stream": True}
        async with http.post(f"{sim.url}/v1/completions", json=capped) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = [line for line in (await r.text()).split("\n\n") if line]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert len(chunks) == 4  # max_tokens capped at max_model_len - prompt = 4; no usage chunk unrequested
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]


@pytest.mark.parametrize("role_first", [False, True])
async def test_a_forced_tool_choice_is_answered_with_a_tool_call_the_openai_client_reads(role_first: bool) -> None:
    """tool_choice "required" (or a named function) makes the answer a call, as vLLM's guided tool choice does:
    finish_reason tool_calls, the call's arguments JSON, whole and streamed in pieces; "auto" stays text."""
    tools: Any = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}},
                  {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]  # fmt: skip
    async with run_sim_engine(SimConfig(instant=True, model="sim", role_in_first_token=role_first)) as sim:
        client = openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="x", max_retries=0)
        try:
            whole = await client.chat.completions.create(
                model="sim", messages=OAI_CHAT, max_tokens=6, tools=tools, tool_choice="required"
            )
            choice = whole.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            call = (choice.message.tool_calls or [])[0]
            assert call.type == "function" and call.function.name == "run"
            assert json.loads(call.function.arguments)["input"].count(" w") == 6
            named: Any = {"type": "function", "function": {"name": "read"}}
            stream = await client.chat.completions.create(
                model="sim", messages=OAI_CHAT, max_tokens=6, tools=tools, tool_choice=named, stream=True
            )
            chunks = [c async for c in stream]
            calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
            assert calls[0].function is not None and calls[0].function.name == "read"
            arguments = "".join(t.function.arguments or "" for t in calls if t.function is not None)
            assert json.loads(arguments) == json.loads(call.function.arguments)  # the same tokens, in pieces
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            text = await client.chat.completions.create(
                model="sim", messages=OAI_CHAT, max_tokens=6, tools=tools, tool_choice="auto"
            )
            assert text.choices[0].finish_reason == "length" and text.choices[0].message.content
        finally:
            await client.close()


async def test_openai_client_chat_stream_usage_and_cached_tokens() -> None:
    cfg = SimConfig(decode_ms=0.5, overhead_ms=0.5, prefill_us_per_token=1.0, model="sim")
    async with run_sim_engine(cfg) as sim:
        client = openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="x", max_retries=0)
        try:
            first = await client.chat.completions.create(model="sim", messages=OAI_CHAT, max_tokens=7)
            second = await client.chat.completions.create(model="sim", messages=OAI_CHAT, max_tokens=7)
            n_prompt = len(tokenize_chat(CHAT))
            assert first.id.startswith("chatcmpl-") and first.choices[0].finish_reason == "length"
            assert first.usage is not None and second.usage is not None
            assert first.usage.prompt_tokens == n_prompt and first.usage.completion_tokens == 7
            assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            assert second.usage.prompt_tokens_details.cached_tokens == (n_prompt - 1) // 16 * 16
            assert first.choices[0].message.content == second.choices[0].message.content
            stream = await client.chat.completions.create(
                model="sim",
                messages=OAI_CHAT,
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == "".join(second.choices[0].message.content.split()[:5]).replace("w", " w")  # type: ignore[union-attr]
            assert chunks[0].choices[0].delta.role == "assistant"
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            assert chunks[-1].usage.completion_tokens == 5
            comp = await client.completions.create(model="sim", prompt="hello world", max_tokens=3)
            assert comp.choices[0].text.count(" w") == 3
        finally:
            await client.close()
        async with aiohttp.ClientSession() as http, http.get(f"{sim.url}/metrics") as r:
            families = {f.name: f for f in text_string_to_metric_families(await r.text())}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:cache_config_info",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_success",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
    ):
        assert name in families, name

    def value(family: str, sample: str) -> float:
        return next(s.value for s in families[family].samples if s.name == sample)

    assert value("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == (n_prompt - 1) // 16 * 16 * 2
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") == 7 + 7 + 5 + 3
    assert value("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 4
    info = next(s for s in families["vllm:cache_config_info"].samples)
    assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == str(cfg.num_blocks)
    assert info.value == 1


# --- cancellation -------------------------------------------------------------------------------------------------
async def test_stream_disconnect_cancels_and_frees_slot() -> None:
    async with run_sim_engine(SimConfig(decode_ms=10)) as sim, aiohttp.ClientSession() as http:
        body = {"messages": CHAT, "max_tokens": 3000, "stream": True}
        resp = await http.post(f"{sim.url}/v1/chat/completions", json=body)
        assert (await resp.content.readline()).startswith(b"data: ")
        resp.close()  # drop the connection mid-stream
        await sim.engine.wait_until(lambda e: e.stats.cancelled + e.stats.completed == 1)
        stats = sim.engine.stats
        assert stats.cancelled == 1 and stats.completed == 0 and stats.generated_tokens < 3000
        assert sim.engine.running == 0 and sim.engine.cache.used_blocks == 0


async def test_nonstream_disconnect_and_waiting_cancel() -> None:
    async with run_sim_engine(SimConfig(decode_ms=10, max_num_seqs=1)) as sim, aiohttp.ClientSession() as http:
        body = {"messages": CHAT, "max_tokens": 3000}
        running = asyncio.create_task(http.post(f"{sim.url}/v1/chat/completions", json=body))
        await sim.engine.wait_until(lambda e: e.stats.generated_tokens >= 1)
        queued = asyncio.create_task(http.post(f"{sim.url}/v1/chat/completions", json=body))
        await sim.engine.wait_until(lambda e: e.waiting == 1)
        queued.cancel()
        await sim.engine.wait_until(lambda e: e.stats.cancelled >= 1)
        assert sim.engine.waiting == 0 and sim.engine.running == 1
        running.cancel()
        await sim.engine.wait_until(lambda e: e.stats.cancelled + e.stats.completed >= 2)
        assert sim.engine.stats.cancelled == 2 and sim.engine.running == 0
        for task in (running, queued):
            with pytest.raises(asyncio.CancelledError):
                await task


# --- faults -------------------------------------------------------------------------------------------------------
async def test_faults_error_health_stall_and_crash() -> None:
    exits: list[int] = []
    cfg = SimConfig(instant=True, seed=3, faults=Faults(error_rate=1.0, fail_health=True))
    async with run_sim_engine(cfg, exit_fn=exits.append) as sim, aiohttp.ClientSession() as http:
        chat = f"{sim.url}/v1/chat/completions"
        async with http.get(f"{sim.url}/health") as r:
            assert r.status == 503
        async with http.post(chat, json={"messages": CHAT, "stream": True}) as r:
            assert r.status == 500 and (await r.json())["error"]["code"] == 500
        async with http.post(f"{sim.url}/sim/faults", json={"error_rate": 2}) as r:
            assert r.status == 400
        async with http.post(f"{sim.url}/sim/faults", json={"error_rate": 0, "fail_health": False}) as r:
            assert (await r.json())["error_rate"] == 0
        async with http.get(f"{sim.url}/health") as r:
            assert r.status == 200
        async with http.post(f"{sim.url}/sim/faults", json={"stall_s": 3600, "stall_rate": 1.0}) as r:
            assert r.status == 200
        stalled = asyncio.create_task(http.post(chat, json={"messages": CHAT}))
        await sim.engine.wait_until(lambda e: e.stats.started == 2)
        assert sim.engine.running == 0 and sim.engine.waiting == 0  # hanging before admission, no byte sent
        stalled.cancel()
        await sim.engine.wait_until(lambda e: e.stats.cancelled == 1)
        async with http.post(f"{sim.url}/sim/faults", json={"stall_rate": 0, "crash_after": 3}) as r:
            assert (await r.json())["crash_after"] == 3
        async with http.post(chat, json={"messages": CHAT}) as r:
            assert r.status == 200 and exits == []
        async with http.post(chat, json={"messages": CHAT}) as r:
            assert r.status == 500 and exits == [1]  # the 4th request: exit_fn(1) (os._exit outside tests)
        async with http.get(f"{sim.url}/sim/stats") as r:
            stats = await r.json()
        assert {k: stats[k] for k in ("started", "completed", "failed", "cancelled")} == {
            "started": 4,
            "completed": 1,
            "failed": 2,
            "cancelled": 1,
        }
    with pytest.raises(asyncio.CancelledError):
        await stalled


# --- KV events ----------------------------------------------------------------------------------------------------
def test_kv_event_codec_round_trip_and_legacy_forms() -> None:
    batch = KVEventBatch(
        ts=12.5,
        events=(
            BlockStored(block_hashes=(2**64 - 1, 5), parent_block_hash=None, token_ids=(1, 2, 3, 4), block_size=2),
            BlockRemoved(block_hashes=(7,)),
            AllBlocksCleared(),
        ),
        data_parallel_rank=0,
    )
    payload = encode_kv_event_batch(batch)
    assert decode_kv_event_batch(payload) == batch
    raw = msgpack.unpackb(payload)
    assert raw[0] == 12.5 and raw[2] == 0 and raw[1][2] == {"type": "AllBlocksCleared"}
    assert list(raw[1][0]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "group_idx",
    ]
    legacy = msgpack.packb([1.0, [["BlockStored", [b"\x01" * 32], None, [9], 1, None], ["BlockRemoved", [3]]]])
    decoded = decode_kv_event_batch(legacy)
    assert decoded.events[0] == BlockStored(
        (int.from_bytes(b"\x01" * 8, "big"),), None, (9,), 1, None, None, group_idx=None
    )
    assert decoded.events[1] == BlockRemoved((3,), medium=None, group_idx=None)
    assert decoded.data_parallel_rank is None
    for bad in (b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([1.0, [{"type": "BlockStored"}]])):
        with pytest.raises(KVEventDecodeError):
            decode_kv_event_batch(bad)
    assert decode_kv_event_batch(msgpack.packb([1.0, [{"type": "FutureEvent"}], 0])).events == ()


def test_kv_event_encoding_matches_vllm_msgspec() -> None:
    pytest.importorskip("msgspec")  # vLLM's encoder; installed with vLLM, not a kvgate dependency
    import msgspec

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class VBlockStored(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[object] | None = None
        group_idx: int | None = None

    class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None

    class VBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[VBlockStored | VBlockRemoved]
        data_parallel_rank: int | None = None

    vllm_bytes = msgspec.msgpack.Encoder().encode(
        VBatch(
            1.25,
            [
                VBlockStored([2**63 + 5], 17, [1, 2], 2, None, "GPU", None, group_idx=0),
                VBlockRemoved([2**63 + 5], "GPU", 0),
            ],
            0,
        )
    )
    ours = KVEventBatch(1.25, (BlockStored((2**63 + 5,), 17, (1, 2), 2), BlockRemoved((2**63 + 5,))), 0)
    assert encode_kv_event_batch(ours) == vllm_bytes


async def test_kv_events_published_over_zmq() -> None:
    cfg = SimConfig(instant=True, kv_events_port=0, block_size=16, num_blocks=8, model="kvm")
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        async with run_sim_engine(cfg) as sim, aiohttp.ClientSession() as http:
            assert sim.kv_events_endpoint is not None and sim.engine.publisher is not None
            sub.connect(sim.kv_events_endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
            await sim.engine.publisher.wait_subscribed()
            prompt_a, prompt_b = "a" * 256, "b" * 256  # 64 tokens = 4 blocks each (+1 private for output)
            for prompt in (prompt_a, prompt_b):
                async with http.post(f"{sim.url}/v1/completions", json={"prompt": prompt, "max_tokens": 4}) as r:
                    assert r.status == 200
            frames = [await sub.recv_multipart() for _ in range(2)]
        assert [f[0] for f in frames] == [b"kv-events", b"kv-events"]
        assert [decode_seq(f[1]) for f in frames] == [0, 1]
        first, second = (decode_kv_event_batch(f[2]) for f in frames)
        hashes_a = chain_block_hashes(tokenize_text(prompt_a), 16, "kvm")
        hashes_b = chain_block_hashes(tokenize_text(prompt_b), 16, "kvm")
        assert first.data_parallel_rank == 0
        assert first.events == (BlockStored(tuple(hashes_a), None, tuple(tokenize_text(prompt_a)), 16),)
        # b needs 5 of 8 blocks while a's 4 prompt blocks sit in the LRU: a's tail is evicted first
        assert second.events[0] == BlockRemoved((hashes_a[3],))
        assert second.events[1] == BlockStored(tuple(hashes_b), None, tuple(tokenize_text(prompt_b)), 16)
    finally:
        sub.close(linger=0)
        ctx.term()


# --- CLI subprocess -----------------------------------------------------------------------------------------------
async def _start_cli(*args: str) -> tuple[asyncio.subprocess.Process, dict[str, int]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "simengine",
        "--port",
        "0",
        *args,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    ports: dict[str, int] = {}
    while "LISTENING" not in ports:
        line = (await proc.stdout.readline()).decode()
        assert line, "sim-engine exited before listening"
        key, _, port = line.strip().partition(" ")
        ports[key] = int(port)
    return proc, ports


async def test_cli_subprocess_serves_and_exits_on_sigterm() -> None:
    proc, ports = await _start_cli("--instant", "--model", "cli-model", "--kv-events-port", "0")
    try:
        assert "KV_EVENTS" in ports
        url = f"http://127.0.0.1:{ports['LISTENING']}"
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/completions", json={"model": "cli-model", "prompt": "hi"}) as r:
                assert (await r.json())["usage"]["completion_tokens"] == 16
        proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_cli_crash_after_exits_process() -> None:
    proc, ports = await _start_cli("--instant", "--crash-after", "1")
    try:
        url = f"http://127.0.0.1:{ports['LISTENING']}/v1/completions"
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json={"prompt": "one"}) as r:
                assert r.status == 200
            with pytest.raises(aiohttp.ClientError):
                async with http.post(url, json={"prompt": "two"}) as r:
                    await r.read()
        assert await proc.wait() == 1
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
