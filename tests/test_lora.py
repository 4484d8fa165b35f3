"""LoRA adapters through the gateway, with simulated engines that serve them as vLLM does (listed by /v1/models
with `parent`, accepted as `model`): discovered per replica, listed once, and routed only to replicas that have
the adapter loaded; vLLM's own flags from the pool spec."""

from __future__ import annotations

import aiohttp
import pytest

from engine_pool.spec import PoolConfig
from engine_pool.vllm_command import EngineLaunchSpec, vllm_argv
from gateway.keys import REPLICAS
from simengine import SimConfig
from tests.conftest import gateway_over_sims

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
