"""Model aliases and ordered fallbacks, as the official openai client sees them: an alias is served by its model
(and listed), a model without capacity sends its requests to its fallback (header, metric), and a chain whose every
model has no capacity ends in 503 with Retry-After."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest

from gateway.config_load import load_config
from gateway.embedded import RunningGateway, running_gateway
from gateway.keys import REGISTRY, REPLICAS
from simengine import SimConfig, run_sim_engine
from tests.conftest import gateway_config, gateway_over_sims, wait_for

BIG, SMALL, TINY = SimConfig(model="big"), SimConfig(model="small"), SimConfig(model="tiny")
MODELS = {"aliases": {"gpt-4o-mini": "small"}, "fallbacks": {"big": ["small", "tiny"]}}


async def set_health(http: aiohttp.ClientSession, sim_url: str, healthy: bool) -> None:
    async with http.post(f"{sim_url}/sim/faults", json={"fail_health": not healthy}) as resp:
        assert resp.status == 200


async def test_an_alias_is_served_by_its_model_and_listed(http: aiohttp.ClientSession) -> None:
    async with gateway_over_sims([BIG, SMALL, TINY], models=MODELS) as (gw, sims):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
            answer = await client.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert answer.model == "small"  # what the engine served
            assert sims[1].engine.stats.completed == 1
            listed = {m.id: m for m in (await client.models.list()).data}
            assert {"big", "small", "tiny", "gpt-4o-mini"} <= listed.keys()
            assert listed["gpt-4o-mini"].model_dump()["root"] == "small"


async def test_a_model_without_capacity_falls_back_in_order_then_answers_503(http: aiohttp.ClientSession) -> None:
    async with gateway_over_sims([BIG, SMALL, TINY], models=MODELS) as (gw, sims):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:

            async def ask() -> openai.types.chat.ChatCompletion:
                raw = await client.chat.completions.with_raw_response.create(
                    model="big", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                ask.fallback = raw.headers.get("x-kvgate-fallback")  # type: ignore[attr-defined]
                return raw.parse()

            assert (await ask()).model == "big" and ask.fallback is None  # type: ignore[attr-defined]
            await set_health(http, sims[0].url, False)
            await wait_for(lambda: not _ready(gw, "big"), what="big not ready")
            assert (await ask()).model == "small" and ask.fallback == "big -> small"  # type: ignore[attr-defined]
            await set_health(http, sims[1].url, False)
            await wait_for(lambda: not _ready(gw, "small"), what="small not ready")
            assert (await ask()).model == "tiny" and ask.fallback == "big -> tiny"  # type: ignore[attr-defined]
            await set_health(http, sims[2].url, False)
            await wait_for(lambda: not _ready(gw, "tiny"), what="tiny not ready")
            with pytest.raises(openai.APIStatusError) as refused:
                await ask()
            assert refused.value.status_code == 503
            assert int(refused.value.response.headers["retry-after"]) >= 1
            assert refused.value.body["code"] == "no_ready_replica"  # type: ignore[index]
        registry = gw.app[REGISTRY]
        assert registry.get_sample_value("kvgate_model_fallbacks_total", {"model": "big", "fallback": "small"}) == 3
        assert registry.get_sample_value("kvgate_model_fallbacks_total", {"model": "big", "fallback": "tiny"}) == 2


async def test_a_request_refused_for_its_predicted_queue_wait_falls_back(http: aiohttp.ClientSession) -> None:
    """big has one slot held ~1 s a request; once the gateway has learned that, a request that would queue for it
    past max_wait_s is refused at once (queue_wait) and, as for any 503 of capacity, served by the fallback."""
    slow = SimConfig(model="big", decode_ms=100.0)
    async with run_sim_engine(slow) as big, run_sim_engine(SMALL) as small:
        engines = [{"url": big.url, "model": "big", "max_concurrency": 1}, {"url": small.url, "model": "small"}]
        admission = {"targets": {"enabled": False}, "queue": {"max_wait_s": 0.2}}
        config = gateway_config([], engines=engines, admission=admission, models={"fallbacks": {"big": ["small"]}})
        async with running_gateway(config) as gw:
            await wait_for(lambda: _ready(gw, "big") and _ready(gw, "small"), what="both ready")
            body = {"model": "big", "prompt": "hi", "max_tokens": 10, "ignore_eos": True}

            async def ask() -> tuple[int, str | None]:
                async with http.post(f"{gw.url}/v1/completions", json=body) as resp:
                    await resp.read()
                    return resp.status, resp.headers.get("x-kvgate-fallback")

            assert await ask() == (200, None)  # the slot's holding time learned
            got = sorted(await asyncio.gather(ask(), ask()), key=lambda answer: answer[1] or "")
            assert got == [(200, None), (200, "big -> small")]
            rejected = gw.app[REGISTRY].get_sample_value(
                "kvgate_admission_rejections_total", {"tenant": "anonymous", "reason": "queue_wait"}
            )
            assert rejected == 1  # refused for its wait, not after waiting it out


def _ready(gw: RunningGateway, model: str) -> bool:
    return any(r.routable(time.monotonic()) for r in gw.app[REPLICAS].for_model(model))


def test_aliases_and_fallbacks_are_checked_at_load_time() -> None:
    with pytest.raises(ValueError, match="aliases resolve once"):
        load_config(overrides={"models": {"aliases": {"a": "b", "b": "c"}}}, environ={})
    with pytest.raises(ValueError, match="appears twice"):
        load_config(overrides={"models": {"fallbacks": {"big": ["small", "big"]}}}, environ={})
