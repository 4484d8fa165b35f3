"""kvgate with the cache-aware policy in front of simulated engines: shared prefixes stick to the replica that
holds them, sessions stay put, and the gateway's prediction of cached tokens matches what the engines report."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cacheindex.tokenizers import HfPromptTokenizer
from gateway.embedded import running_gateway
from gateway.keys import CACHE, REPLICAS
from simengine import SimConfig
from simengine.server import run_sim_engine
from simengine.tokenize import tokenize_text
from tests.conftest import gateway_config, gateway_over_sims, wait_for

SIM = SimConfig(model="sim", block_size=16, overhead_ms=0, prefill_us_per_token=0, decode_ms=0, decode_ms_per_seq=0)
CACHE_AWARE = {"routing": {"policy": "cache-aware"}, "cache": {"tokenizers": {"sim": "sim"}}}


async def chat(http: aiohttp.ClientSession, url: str, system: str, user: str, **headers: str) -> tuple[str, str, int]:
    body = {
        "model": "sim",
        "max_tokens": 2,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        data = await resp.json()
        assert resp.status == 200, data
        return (
            resp.headers["x-kvgate-replica"],
            resp.headers["x-kvgate-route-reason"],
            data["usage"]["prompt_tokens_details"]["cached_tokens"],
        )


async def test_shared_prefixes_route_to_their_holder(http: aiohttp.ClientSession) -> None:
    async with gateway_over_sims([SIM, SIM, SIM], **CACHE_AWARE) as (gw, sims):
        systems = [f"group {g}: " + "you are a helpful assistant. " * 40 for g in range(3)]
        homes: dict[int, str] = {}
        for g, system in enumerate(systems):
            homes[g], reason, _ = await chat(http, gw.url, system, "first")
            assert reason == "cold-least-load"
        assert len(set(homes.values())) == 3  # cold requests spread over the least-loaded replicas
        for round_ in range(3):
            for g, system in enumerate(systems):
                replica, reason, cached = await chat(http, gw.url, system, f"question {round_}")
                assert (replica, reason) == (homes[g], "cache-hit")
                assert cached >= 16 * 18  # the whole shared system prompt (~290 tokens) came from the cache
        hits = sum(s.engine.stats.cached_tokens_total for s in sims)
        prompts = sum(s.engine.stats.prompt_tokens_total for s in sims)
        assert hits / prompts > 0.6
        metrics = await (await http.get(gw.url + "/metrics")).text()
        assert "kvgate_prefix_predicted_cached_tokens_total" in metrics


async def test_session_header_keeps_a_conversation_in_place(http: aiohttp.ClientSession) -> None:
    async with gateway_over_sims([SIM, SIM], **CACHE_AWARE) as (gw, _):
        first, _, _ = await chat(http, gw.url, "short", "turn 0", **{"x-session-id": "agent-7"})
        for turn in range(1, 4):
            replica, reason, _ = await chat(
                http, gw.url, "totally different " * turn, f"turn {turn}", **{"x-session-id": "agent-7"}
            )
            assert replica == first and reason == "session"


async def test_a_prefix_the_gpu_evicted_but_cpu_memory_holds_is_routed_back_and_loaded(
    http: aiohttp.ClientSession,
) -> None:
    """Two engines with a 48-block GPU cache and a CPU tier (vLLM's KV offloading), KV events on. A prompt is
    stored on engine 0, then pushed out of its GPU by three others sent straight to it (kvgate sees all of it only
    through the events). Sent through kvgate, the prompt goes back to engine 0, which loads it from CPU memory."""
    tiered = SIM.model_copy(update={"num_blocks": 48, "cpu_blocks": 1024, "kv_events_port": 0})
    async with gateway_over_sims([tiered, tiered], **CACHE_AWARE) as (gw, sims):
        holder = sims[0]
        prompts = [f"document {d}: " + "lorem ipsum dolor sit amet " * 70 for d in range(4)]  # ~30 blocks each

        async def straight(prompt: str) -> None:
            body = {"model": "sim", "prompt": prompt, "max_tokens": 1}
            async with http.post(holder.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200

        for p in prompts:
            await straight(p)
        cache = holder.engine.cache
        assert cache.lookup(cache.block_hashes(tokenize_text(prompts[0]))) == 0  # gone from its GPU
        assert cache.offloaded_blocks >= 4 * 28
        index = gw.app[CACHE].index
        await wait_for(lambda: sum(index.offloaded_sizes().values()) >= 4 * 28, what="the CPU tier's events")
        body = {"model": "sim", "prompt": prompts[0], "max_tokens": 1}
        async with http.post(gw.url + "/v1/completions", json=body) as resp:
            data = await resp.json()
            assert resp.status == 200, data
            assert resp.headers["x-kvgate-route-reason"] == "offload-hit"
        assert holder.engine.stats.started == 5 and sims[1].engine.stats.started == 0
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] >= 28 * 16
        assert cache.loaded_tokens >= 28 * 16
        metrics = await (await http.get(gw.url + "/metrics")).text()
        assert "kvgate_prefix_index_offloaded_blocks{" in metrics


TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]


async def _agent_between_cold_prompts(http: aiohttp.ClientSession, **overrides: object) -> tuple[int, int, str]:
    """Two engines of 64 blocks, both filled past capacity by cold prompts of 20 blocks; an agent's turn whose
    answer is a tool call (streamed, as agents stream); six more cold prompts while its tool runs; the agent's next
    turn. Returns how many of the six went to the agent's replica, the cached tokens of its next turn, and what
    `kvgate_sessions_awaited` read after its tool call."""
    small = SIM.model_copy(update={"num_blocks": 64})
    async with gateway_over_sims([small, small], **{**CACHE_AWARE, **overrides}) as (gw, _):
        await wait_for(
            lambda: gw.app[CACHE] is not None and all(c[1] for c in gw.app[CACHE].index.capacities().values()),
            what="engine capacities known",
        )
        cold = iter(f"document {d}: " + "lorem ipsum dolor sit amet " * 40 for d in range(16))  # ~20 blocks each
        for _ in range(8):
            await chat(http, gw.url, next(cold), "summarise")
        system, task = "you are a coding agent. " + "follow the rules. " * 60, "fix the failing test"
        turn: dict[str, object] = {
            "model": "sim", "max_tokens": 8, "stream": True, "tools": TOOLS, "tool_choice": "required",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": task}],
        }  # fmt: skip
        headers = {"x-session-id": "agent-1"}
        async with http.post(gw.url + "/v1/chat/completions", json=turn, headers=headers) as resp:
            home, events = resp.headers["x-kvgate-replica"], (await resp.read()).decode()
        assert '"finish_reason":"tool_calls"' in events
        await wait_for(lambda: gw.app[CACHE].awaited is None or len(gw.app[CACHE].awaited) == 1, what="awaited")
        awaited = [ln for ln in (await (await http.get(gw.url + "/metrics")).text()).splitlines()]
        gauge = next(ln for ln in awaited if ln.startswith("kvgate_sessions_awaited "))
        placed = [(await chat(http, gw.url, next(cold), "summarise"))[0] for _ in range(6)]
        replica, reason, cached = await chat(http, gw.url, system, task, **headers)
        assert (replica, reason) == (home, "session")
        return placed.count(home), cached, gauge


async def test_cold_placements_spare_an_agent_waiting_on_its_tool(http: aiohttp.ClientSession) -> None:
    on_home, cached, gauge = await _agent_between_cold_prompts(http)
    assert gauge == "kvgate_sessions_awaited 1.0"
    assert on_home == 0  # every cold prompt went where no agent is expected back
    assert cached >= 16 * 18  # the agent's whole conversation (18 full blocks) was still cached when it came back
    # the same without it (awaited_ttl_s: 0): cold prompts are placed by load alone, half of them on the agent's
    # replica, and its blocks, the least recently used there, are evicted before it returns
    on_home, cached_off, gauge = await _agent_between_cold_prompts(http, cache={"tokenizers": {"sim": "sim"},
                                                                                "awaited_ttl_s": 0})  # fmt: skip
    assert gauge == "kvgate_sessions_awaited 0.0"
    assert on_home == 3
    assert cached_off < cached


async def _metric(http: aiohttp.ClientSession, url: str, sample: str) -> float:
    text = await (await http.get(url + "/metrics")).text()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(sample + " "))


async def test_an_agents_long_new_turns_are_hashed_after_routing_and_still_recorded(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Each turn of a tool-using agent appends the answer (a tool call) and a long tool result: routed on the
    conversation before them, on its replica, and the whole prompt, hashed beside the request, recorded there."""
    pytest.importorskip("transformers", reason="the tokenizer extra is not installed")
    from engine_pool.tiny_model import _build_tokenizer

    _build_tokenizer(tmp_path, 1 << 20)
    tok = HfPromptTokenizer(str(tmp_path))
    cache = {"tokenizers": {"sim": str(tmp_path)}, "deferred_turn_min_chars": 1000}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent; use the tools. " * 50},
        {"role": "user", "content": "Find the failing test and fix it."},
    ]
    async with gateway_over_sims([SIM, SIM], routing={"policy": "cache-aware"}, cache=cache) as (gw, _):
        routes = []
        for turn in range(4):
            body = {"model": "sim", "max_tokens": 2, "messages": messages}
            async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                routes.append((resp.headers["x-kvgate-replica"], resp.headers["x-kvgate-route-reason"]))
            # the prompt's every full block (its new turn's included) is recorded on its replica (an agent's next
            # turn comes after its tool ran; an instant engine answers before the new turn is hashed)
            blocks = len(tok.tokenize_chat(messages, True, {})) // 16
            held = f'kvgate_prefix_index_blocks{{replica="{routes[0][0]}"}}'
            deadline = time.monotonic() + 10
            while await _metric(http, gw.url, held) < blocks:
                assert time.monotonic() < deadline, f"turn {turn}'s blocks were not recorded"
                await asyncio.sleep(0.02)
            call = {"id": f"call_{turn}", "type": "function",
                    "function": {"name": "read_file", "arguments": f'{{"path": "src/m{turn}.py"}}'}}  # fmt: skip
            result = "".join(f"line {i} of module {turn}: x = compute({i})\n" for i in range(80))  # ~3,000 chars
            messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": f"call_{turn}", "content": result}]  # fmt: skip
        assert routes[1:] == [(routes[0][0], "cache-hit")] * 3
        assert await _metric(http, gw.url, "kvgate_prefix_new_turns_after_routing_total") == 3


async def test_an_engine_restarted_between_health_probes_is_known_empty(http: aiohttp.ClientSession) -> None:
    """An engine restarted faster than the health probe's interval (a container restarted in place) fails no probe;
    its scrape's counters start over, and the gateway routes it as the empty cache it now is: a prompt it held
    before the restart is cold again, not a predicted hit on an engine that recomputes it."""
    async with AsyncExitStack() as stack:
        engines = [AsyncExitStack() for _ in range(2)]
        for engine in engines:
            stack.push_async_callback(engine.aclose)
        first = [await e.enter_async_context(run_sim_engine(SIM)) for e in engines]
        config = gateway_config([s.url for s in first], health={"interval_s": 3600}, **CACHE_AWARE)
        gw = await stack.enter_async_context(running_gateway(config))
        replicas = {r.id: r for r in gw.app[REPLICAS]}
        await wait_for(lambda: all(r.routable(time.monotonic()) for r in replicas.values()), what="replicas ready")
        system = "you are a helpful assistant. " * 40
        home, reason, _ = await chat(http, gw.url, system, "first")
        assert reason == "cold-least-load"
        assert (await chat(http, gw.url, system, "second"))[:2] == (home, "cache-hit")
        await wait_for(lambda: replicas[home].metrics.prefix_queries > 0, what="the engine's counters scraped")
        k = next(i for i, s in enumerate(first) if home.endswith(f":{s.port}"))
        await engines[k].aclose()  # the engine stops; a fresh one takes its port before any health probe
        await engines[k].enter_async_context(run_sim_engine(SIM.model_copy(update={"port": first[k].port})))
        await wait_for(lambda: replicas[home].metrics.prefix_queries == 0, what="the restarted engine scraped")
        _, reason, cached = await chat(http, gw.url, system, "third")
        assert (reason, cached) == ("cold-least-load", 0)
