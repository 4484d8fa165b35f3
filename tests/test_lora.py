"""LoRA adapters through the gateway, with simulated engines that serve them as vLLM does (listed by /v1/models
with `parent`, accepted as `model`): discovered per replica, listed once, and routed only to replicas that have
the adapter loaded; vLLM's own flags from the pool spec; adapters loaded on demand through vLLM's runtime LoRA API
(one load for concurrent requests, least recently requested out first, clear errors, a hot adapter spread)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_pool.spec import PoolConfig
from engine_pool.vllm_command import EngineLaunchSpec, vllm_argv, vllm_env
from gateway.keys import ADMISSION, REPLICAS
from policies.base import ReplicaState
from policies.lora import AdapterPlacement, place_adapter
from simengine import SimConfig
from tests.conftest import gateway_over_sims, wait_for

BASE = SimConfig(model="base", instant=True)
WITH_SQL = BASE.model_copy(update={"lora_modules": {"sql": "/adapters/sql", "chat": "/adapters/chat"}})


@pytest.mark.parametrize("policy", ["least-load", "cache-aware"])
async def test_an_adapter_is_served_only_by_replicas_that_have_it(policy: str, http: aiohttp.ClientSession) -> None:
    cache = {"tokenizers": {"base": "sim"}}  # an adapter is tokenized as its base model
    async with gateway_over_sims([BASE, WITH_SQL, BASE], routing={"policy": policy}, cache=cache) as (gw, sims):
        async with http.get(gw.url + "/v1/models") as resp:
            models = {m["id"]: m for m in (await resp.json())["data"]}
        assert set(models) == {"base", "sql", "chat"}  # listed once each, across replicas
        assert models["sql"]["parent"] == "base" and models["sql"]["root"] == "/adapters/sql"
        assert "parent" not in models["base"]
        holder = next(r.id for r in gw.app[REPLICAS] if r.port == sims[1].port)
        routed = set()
        for i in range(9):
            body = {"model": "sql", "prompt": f"select {i}", "max_tokens": 2}
            async with http.post(gw.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                routed.add(resp.headers["x-kvgate-replica"])
        assert routed == {holder}
        spread = set()
        for i in range(9):
            async with http.post(gw.url + "/v1/completions", json={"model": "base", "prompt": f"{i}"}) as resp:
                spread.add(resp.headers["x-kvgate-replica"])
        if policy == "least-load":
            assert len(spread) == 3  # the base model is on every replica
        async with http.post(gw.url + "/v1/completions", json={"model": "nope", "prompt": "x"}) as resp:
            assert resp.status == 404


def test_pool_spec_passes_lora_flags_to_vllm() -> None:
    cfg = PoolConfig.model_validate(
        {
            "models": [
                {
                    "name": "m",
                    "model": "/models/m",
                    "lora_modules": {"sql": "/adapters/sql"},
                    "max_loras": 2,
                    "max_lora_rank": 16,
                }
            ]
        }
    )
    m = cfg.models[0]
    argv = vllm_argv(
        EngineLaunchSpec(model="/models/m", port=1, lora_modules=m.lora_modules, max_loras=2, max_lora_rank=16)
    )
    i = argv.index("--enable-lora")
    assert argv[i + 1 : i + 3] == ["--lora-modules", "sql=/adapters/sql"]
    assert argv[argv.index("--max-loras") + 1] == "2" and argv[argv.index("--max-lora-rank") + 1] == "16"
    assert "--enable-lora" not in vllm_argv(EngineLaunchSpec(model="/models/m", port=1))


# --- adapters loaded on demand (models.dynamic_lora, vLLM's runtime LoRA API) -------------------------------------
RUNTIME = BASE.model_copy(update={"runtime_lora": True, "lora_load_ms": 200.0})


def lora_counts(text: str) -> dict[tuple[str, str, str], float]:
    """(metric, adapter, outcome) -> value of kvgate's LoRA counters and gauges in a /metrics page."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("kvgate_lora_"):
                out[(s.name, s.labels["adapter"], s.labels.get("outcome", ""))] = s.value
    return out


async def sim_totals(http: aiohttp.ClientSession, sims: list[Any], key: str) -> list[int]:
    found = []
    for sim in sims:
        async with http.get(f"{sim.url}/sim/stats") as resp:
            found.append((await resp.json())[key])
    return found


def adapters_config(tmp_path: Path, names: list[str], **extra: Any) -> dict[str, Any]:
    for name in names:
        (tmp_path / name).mkdir(exist_ok=True)  # the simulated engine loads a folder that exists, as vLLM does
    catalog = {name: {"base": "base", "path": str(tmp_path / name)} for name in names}
    return {"dynamic_lora": True, "adapters": catalog, "lora_slots": 1, **extra}


async def complete(http: aiohttp.ClientSession, url: str, model: str, i: int = 0) -> tuple[int, str, dict[str, Any]]:
    body = {"model": model, "prompt": f"adapter request {i}", "max_tokens": 2}
    async with http.post(url + "/v1/completions", json=body) as resp:
        return resp.status, resp.headers.get("x-kvgate-replica", ""), await resp.json()


async def test_an_adapter_is_loaded_once_on_demand_and_the_least_recent_one_leaves(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    models = adapters_config(tmp_path, ["sql", "chat", "fin", "ops"])
    async with gateway_over_sims([RUNTIME] * 3, models=models) as (gw, sims):
        results = await asyncio.gather(*(complete(http, gw.url, "sql", i) for i in range(6)))
        assert [status for status, _, _ in results] == [200] * 6
        assert len({replica for _, replica, _ in results}) == 1  # all on the replica that loaded it
        assert sum(await sim_totals(http, sims, "lora_loads")) == 1  # six concurrent requests, one load
        async with http.get(gw.url + "/v1/models") as resp:
            listed = {m["id"]: m for m in (await resp.json())["data"]}
        assert listed["sql"]["parent"] == "base" and listed["sql"]["root"] == str(tmp_path / "sql")
        holders = {results[0][1]}
        for name in ("chat", "fin"):  # a free slot elsewhere first: one adapter per replica
            status, replica, _ = await complete(http, gw.url, name)
            assert status == 200 and replica not in holders
            holders.add(replica)
        status, replica, _ = await complete(http, gw.url, "ops")  # every slot taken: sql, asked least recently, goes
        assert status == 200 and replica == results[0][1]
        evicted_port = next(r.port for r in gw.app[REPLICAS] if r.id == replica)
        assert await sim_totals(http, sims, "lora_unloads") == [int(s.port == evicted_port) for s in sims]
        status, replica, _ = await complete(http, gw.url, "sql")  # loaded again, in place of chat
        assert status == 200
        async with http.get(gw.url + "/metrics") as resp:
            counts = lora_counts(await resp.text())
        assert counts[("kvgate_lora_loads_total", "sql", "loaded")] == 2
        assert counts[("kvgate_lora_loads_total", "ops", "loaded")] == 1
        assert counts[("kvgate_lora_unloads_total", "sql", "unloaded")] == 1
        assert counts[("kvgate_lora_unloads_total", "chat", "unloaded")] == 1
        assert counts[("kvgate_lora_adapter_replicas", "sql", "")] == 1
        assert ("kvgate_lora_adapter_replicas", "chat", "") not in counts
        assert sum(await sim_totals(http, sims, "lora_loads")) == 5


async def test_an_adapter_that_cannot_load_is_a_clear_error_not_a_hang(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    models = adapters_config(tmp_path, ["sql"], lora_load_timeout_s=0.5)
    models["adapters"]["gone"] = {"base": "base", "path": str(tmp_path / "no-such-folder")}
    models["adapters"]["slow"] = {"base": "base", "path": str(tmp_path / "sql")}
    slow = RUNTIME.model_copy(update={"lora_load_ms": 5000.0})
    async with gateway_over_sims([slow], models=models) as (gw, _):
        results = await asyncio.gather(*(complete(http, gw.url, "gone", i) for i in range(3)))
        for status, _, body in results:  # every waiter gets the engine's reason
            assert status == 502 and body["error"]["code"] == "adapter_load_failed"
            assert "No adapter found" in body["error"]["message"]
        status, _, body = await complete(http, gw.url, "slow")
        assert status == 504 and "took longer than 0.5 s" in body["error"]["message"]
    async with gateway_over_sims([BASE], models=adapters_config(tmp_path, ["sql"])) as (gw, _):
        status, _, body = await complete(http, gw.url, "sql")  # an engine without the runtime API: its 404, said
        assert status == 502 and "HTTP 404" in body["error"]["message"]


def test_adapter_placement_prefers_a_free_slot_then_evicts_the_least_recent() -> None:
    a, b, c = ReplicaState("a", "m", in_flight=3), ReplicaState("b", "m", in_flight=1), ReplicaState("c", "m")
    used = {"x": 10.0, "y": 5.0, "z": 7.0}
    free = place_adapter([a, b], {"a": [], "b": ["x"]}, slots=1, last_used=used, loadable=used)
    assert free == AdapterPlacement("a", None, "free-slot")  # a free slot beats lower load
    full = place_adapter([a, b], {"a": ["y"], "b": ["x"]}, slots=1, last_used=used, loadable=used)
    assert full == AdapterPlacement("b", "x", "evict-lru")  # the least loaded, its least recent adapter out
    busy_c = ReplicaState("c", "m", in_flight=1)
    tie = place_adapter([b, busy_c], {"b": ["x"], "c": ["y"]}, slots=1, last_used=used, loadable=used)
    assert tie == AdapterPlacement("c", "y", "evict-lru")  # equal load: the replica whose adapter is older
    pinned = place_adapter([c], {"c": ["static"]}, slots=1, last_used=used, loadable=used)
    assert pinned == AdapterPlacement("c", None, "over-slots")  # not in the catalog: never unloaded
    down = ReplicaState("d", "m", ready=False)
    assert place_adapter([down], {}, slots=1, last_used=used, loadable=used) is None


def test_pool_spec_turns_on_the_runtime_lora_api_and_pooling_runner() -> None:
    spec = EngineLaunchSpec(model="/models/m", port=1, dynamic_lora=True, runner="pooling", convert="embed")
    argv = vllm_argv(spec)
    assert "--enable-lora" in argv and "--lora-modules" not in argv
    assert argv[argv.index("--runner") + 1] == "pooling" and argv[argv.index("--convert") + 1] == "embed"
    assert vllm_env(spec, {})["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in vllm_env(EngineLaunchSpec(model="/m", port=1), {})


@pytest.mark.parametrize("replicate_load", [2, None])
async def test_a_hot_adapter_is_loaded_on_one_more_replica(
    replicate_load: int | None, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Requests for one adapter pile up on its replica while the other idles: past `lora_replicate_load` requests
    outstanding on every holder, the adapter is loaded on the idle replica too and requests spread over both."""
    slow = RUNTIME.model_copy(update={"instant": False, "decode_ms": 20.0, "lora_load_ms": 50.0})
    models = adapters_config(tmp_path, ["sql"], lora_replicate_load=replicate_load)
    async with gateway_over_sims([slow, slow], models=models) as (gw, sims):

        async def wave(n: int) -> set[str]:
            async def one(i: int) -> str:
                body = {"model": "sql", "prompt": f"hot {i}", "max_tokens": 30, "ignore_eos": True}
                async with http.post(gw.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return resp.headers["x-kvgate-replica"]

            return set(await asyncio.gather(*(one(i) for i in range(n))))

        assert len(await wave(4)) == 1  # loaded once, on one replica
        first = asyncio.create_task(wave(4))  # keeps the holder busy while the next wave arrives
        await wait_for(lambda: sum(r.in_flight for r in gw.app[REPLICAS]) >= 4, what="first wave in flight")
        await wave(2)
        await first
        if replicate_load is not None:  # the second load runs in the background
            await wait_for(lambda: len(gw.app[REPLICAS].for_model("sql")) == 2, what="the adapter on both replicas")
        loads = sum(await sim_totals(http, sims, "lora_loads"))
        spread = await wave(8)
        if replicate_load is None:
            assert loads == 1 and len(spread) == 1
        else:
            assert loads == 2 and len(spread) == 2


async def test_an_adapter_that_cannot_load_evicts_nothing_and_is_not_retried_at_once(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Two slots holding two good adapters: a broken one is tried once (evicting the least recent for it), then
    refused at once by the gateway, so it evicts nothing more (it evicted one adapter for every request)."""
    models = adapters_config(tmp_path, ["sql", "chat"], lora_slots=2)
    models["adapters"]["gone"] = {"base": "base", "path": str(tmp_path / "no-such-folder")}
    async with gateway_over_sims([RUNTIME], models=models) as (gw, sims):
        for name in ("sql", "chat"):
            assert (await complete(http, gw.url, name))[0] == 200
        messages = []
        for i in range(3):
            status, _, body = await complete(http, gw.url, "gone", i)
            assert status == 502 and "No adapter found" in body["error"]["message"]
            messages.append(body["error"]["message"])
        assert ["not tried again" in m for m in messages] == [False, True, True]
        assert await sim_totals(http, sims, "lora_unloads") == [1]  # sql, for the one try
        assert (await complete(http, gw.url, "chat"))[0] == 200
        assert await sim_totals(http, sims, "lora_loads") == [2]  # chat stayed loaded


async def test_two_adapters_loaded_at_once_keep_to_the_slots(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    """One replica with one slot, taken: concurrent first requests for two more adapters take turns, so the
    replica ends with one adapter, not two (the second load saw the slot the first had just freed)."""
    models = adapters_config(tmp_path, ["ops", "sql", "chat"])
    slow = RUNTIME.model_copy(update={"lora_load_ms": 200.0})
    async with gateway_over_sims([slow], models=models) as (gw, _):
        assert (await complete(http, gw.url, "ops"))[0] == 200
        await asyncio.gather(complete(http, gw.url, "sql"), complete(http, gw.url, "chat"))
        async with http.get(gw.url + "/metrics") as resp:
            counts = lora_counts(await resp.text())
        held = {name for (metric, name, _), n in counts.items() if metric == "kvgate_lora_adapter_replicas" and n}
        assert len(held) == 1, counts


async def test_an_adapter_no_replica_can_load_goes_to_its_fallback(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    """The adapter's base model has no ready replica: its configured fallback answers, as for any 503; with no
    fallback the 503 is counted under the adapter's name."""
    small = SimConfig(model="small", instant=True)
    models = {**adapters_config(tmp_path, ["sql", "chat"]), "fallbacks": {"sql": ["small"]}}
    async with gateway_over_sims([RUNTIME, small], models=models) as (gw, sims):
        async with http.post(f"{sims[0].url}/sim/faults", json={"fail_health": True}) as resp:
            assert resp.status == 200
        base = next(r for r in gw.app[REPLICAS] if r.model == "base")
        await wait_for(lambda: not base.healthy, what="the base replica down")
        async with http.post(gw.url + "/v1/completions", json={"model": "sql", "prompt": "x"}) as resp:
            assert resp.status == 200 and resp.headers["x-kvgate-fallback"] == "sql -> small"
        assert (await complete(http, gw.url, "chat"))[0] == 503
        async with http.get(gw.url + "/metrics") as resp:
            text = await resp.text()
        assert 'model="chat",replica="-",status="503"' in text


async def test_a_base_model_and_its_adapter_share_one_queue_in_arrival_order(http: aiohttp.ClientSession) -> None:
    """One replica of gate 1 serving the base model and an adapter: a base request queued behind a running adapter
    request goes before the adapter requests that arrive after it (they share the replica's slots, so they share
    one fair queue), not left waiting while each finishing adapter request lets the next one in."""
    sim = WITH_SQL.model_copy(update={"instant": False, "decode_ms": 40, "overhead_ms": 0})
    admission = {"replica_max_concurrency": 1, "targets": {"enabled": False}, "queue": {"max_wait_s": 10}}
    async with gateway_over_sims([sim], admission=admission) as (gw, _):
        done: list[str] = []

        async def ask(model: str) -> None:
            body = {"model": model, "prompt": "x", "max_tokens": 5}
            async with http.post(gw.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
            done.append(model)

        (replica,) = list(gw.app[REPLICAS])
        gate = gw.app[ADMISSION].capacity_gate
        running = asyncio.create_task(ask("sql"))
        await wait_for(lambda: replica.in_flight == 1, what="the adapter request running")
        base = asyncio.create_task(ask("base"))
        await wait_for(lambda: gate.queued() == 1, what="the base request queued")
        later = asyncio.create_task(ask("sql"))
        await wait_for(lambda: gate.queued() == 2, what="the later adapter request queued behind it")
        await asyncio.gather(running, base, later)
        assert done == ["sql", "base", "sql"]
