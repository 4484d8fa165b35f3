"""cache-aware in predicted seconds: decisions on literal snapshots carrying each replica's learned latency model."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_pool.replica import Replica
from gateway.keys import REPLICAS
from policies.base import Decision, ReplicaState, RequestInfo, RoutingView
from policies.cache_aware import CacheAware
from policies.latency import Held, ReplicaLatency
from simengine import SimConfig
from tests.conftest import gateway_over_sims, wait_for

BS = 16
PROMPT = RequestInfo(model="m", prompt_tokens=64 * BS + 5, block_hashes=tuple(range(64)), block_size=BS)
GPU = {"prefill": 1e-4, "per_seq": 1e-4}  # prefill 10k tokens/s, a running sequence adds 0.1 ms to a decode step
CPU = {"prefill": 1e-3, "per_seq": 5e-3}  # every sequence costs on a CPU


def lat(
    rid: str,
    *,
    prefill: float,
    per_seq: float,
    kv_tokens: int | None = None,
    held: tuple[Held, ...] = (),
    output: float = 128.0,
) -> ReplicaLatency:
    return ReplicaLatency(rid, kv_tokens, held, 0.002, prefill, 0.01, per_seq, mean_output=output)


def rep(rid: str, load: int = 0, **kw: Any) -> ReplicaState:
    return ReplicaState(id=rid, model="m", in_flight=load, **kw)


def decide(
    replicas: list[ReplicaState],
    overlap: dict[str, int],
    latency: dict[str, ReplicaLatency],
    *,
    seq: int = 0,
    request: RequestInfo = PROMPT,
    **params: Any,
) -> Decision:
    view = RoutingView(request, tuple(replicas), overlap, None, seq, latency=latency, now=100.0)
    return CacheAware(params).decide(view)


@pytest.mark.parametrize(
    ("engine", "chosen", "reason"), [(GPU, "a", "cache-hit"), (CPU, "b", "spread-hot-prefix")]
)  # fmt: skip
def test_a_hot_prefix_stays_or_spreads_by_what_the_engines_decode_and_prefill_were_learned_to_cost(
    engine: dict[str, float], chosen: str, reason: str
) -> None:
    # the holder runs 3 requests: on a GPU the slowdown the request's decode adds to them (0.1 ms x 128 tokens x 3 =
    # 38 ms) is less than the 1,024-token prefill the cache saves (102 ms); on a CPU it is 1.9 s against 1 s
    replicas = [rep("a", 3), rep("b", 0)]
    latency = {r: lat(r, **engine) for r in ("a", "b")}
    d = decide(replicas, {"a": 64}, latency)
    assert (d.replica, d.reason) == (chosen, reason)
    # the constant token prices (64 per request against 1,024 tokens saved) keep it on the holder either way
    assert decide(replicas, {"a": 64}, latency, unit="tokens").replica == "a"


def test_a_holder_whose_kv_must_drain_first_loses_the_request_while_the_wait_outweighs_the_prefill() -> None:
    # the holder's KV (4,096 tokens) is taken by a request that ends in 2 s: the prompt's 5 uncached tokens and its
    # 128 output tokens wait for it there; elsewhere the whole prompt is computed at once (0.1 s)
    held = (Held(4000, 102.0),)
    replicas = [rep("a", 1, kv_usage=0.5), rep("b", 0)]
    latency = {"a": lat("a", kv_tokens=4096, held=held, **GPU), "b": lat("b", kv_tokens=4096, **GPU)}
    assert decide(replicas, {"a": 64}, latency).replica == "b"
    # the engine's last scrape (half full) says nothing of it: the token cost keeps it on the holder
    assert decide(replicas, {"a": 64}, latency, unit="tokens").replica == "a"
    # a wait shorter than the prefill it saves is worth it
    soon = {**latency, "a": lat("a", kv_tokens=4096, held=(Held(4000, 100.01),), **GPU)}
    assert (decide(replicas, {"a": 64}, soon).replica, decide(replicas, {"a": 64}, soon).reason) == ("a", "cache-hit")


def test_until_every_candidate_knows_its_prefill_speed_the_cost_is_in_tokens() -> None:
    replicas = [rep("a", 3), rep("b", 0)]
    half_known = {"a": lat("a", **CPU), "b": lat("b", prefill=0.0, per_seq=5e-3)}
    assert decide(replicas, {"a": 64}, half_known).replica == "a"  # CPU rates would spread it (test above)
    assert decide(replicas, {"a": 64}, {"a": lat("a", **CPU)}).replica == "a"
    # nor before any answer says how long outputs are (a guess would price every load)
    unanswered = {r: lat(r, **CPU, output=0.0) for r in ("a", "b")}
    assert not decide(replicas, {"a": 64}, unanswered).seconds
    # the output length is the traffic's: one replica's answers say it for all
    one_answered = {**unanswered, "b": lat("b", **CPU)}
    assert decide(replicas, {"a": 64}, one_answered).seconds


def test_the_pools_mean_speed_prices_every_candidate_so_a_noisy_fit_does_not_pick_a_cold_requests_replica() -> None:
    latency = {"a": lat("a", prefill=1.0e-4, per_seq=1e-4), "b": lat("b", prefill=1.3e-4, per_seq=1e-4)}
    picks = [decide([rep("a"), rep("b")], {}, latency, seq=s).replica for s in range(4)]
    assert picks == ["a", "b", "a", "b"]


def test_scores_are_token_equivalents_one_for_the_cheapest() -> None:
    d = decide([rep("a", 3), rep("b", 0)], {"a": 64}, {r: lat(r, **CPU) for r in ("a", "b")})
    assert d.scores["b"] == 1.0
    # a: 5 ms x 128 x 3 = 1.92 s + 5 tokens' prefill, in tokens of 1 ms; b: 1,029 tokens
    assert d.scores["a"] == pytest.approx((1.0 + 1029) / (1.0 + 1920 + 5))


def test_the_request_being_routed_is_not_counted_in_what_its_replica_holds() -> None:
    replica = Replica("r", "http://127.0.0.1:1", "m")
    own, other = Held(1000, 5.0), Held(2000, 6.0)
    replica.hold(own)
    assert replica.latency_view().held == (own,)
    replica.hold(other)
    assert replica.latency_view(own).held == (other,)
    assert replica.latency_view().held == (own, other)
    replica.release(own)
    assert replica.latency_view(own).held == replica.latency_view().held == (other,)
    assert replica.latency_view().mean_output == 0.0
    replica.latency.observe_decode(1, 0.01, 40)  # an answer: what the view knows moves with it
    assert replica.latency_view().mean_output == 40.0


# --- through the gateway ------------------------------------------------------------------------------------------
# engines where every running sequence slows the decode step a lot and prefill is cheap (a CPU's shape): a request
# joining a busy replica costs the batch far more than the system prompt it finds cached there saves
CPU_SIM = SimConfig(
    model="sim", block_size=16, num_blocks=4096, overhead_ms=1, prefill_us_per_token=20, decode_ms=2,
    decode_ms_per_seq=25,
)  # fmt: skip
SYSTEM = "you are a careful assistant. " * 60  # about 360 of the simulator's tokens


async def _ask(http: aiohttp.ClientSession, url: str, system: str, user: str, tokens: int = 24) -> tuple[str, str]:
    body = {
        "model": "sim", "max_tokens": tokens, "stream": True, "ignore_eos": True,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }  # fmt: skip
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-kvgate-replica"], resp.headers["x-kvgate-route-reason"]


async def _seconds_decisions(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kvgate_routing_seconds_decisions_total"
    )


@pytest.mark.parametrize(("unit", "second_reason"), [("seconds", "spread-hot-prefix"), ("tokens", "cache-hit")])
async def test_a_busy_holder_of_a_prompt_is_left_by_what_its_engine_was_learned_to_cost(
    unit: str, second_reason: str, http: aiohttp.ClientSession
) -> None:
    routing = {"policy": "cache-aware", "params": {"unit": unit}}
    config = {"routing": routing, "cache": {"tokenizers": {"sim": "sim"}}}
    async with gateway_over_sims([CPU_SIM, CPU_SIM], **config) as (gw, _):
        replicas = gw.app[REPLICAS]

        def learned() -> bool:
            views = [r.latency_view() for r in replicas]
            return all(v.prefill_s_per_token > 0 and v.step_per_seq_s > 0 and v.decode_learned for v in views)

        for burst in range(40):  # distinct prompts, 2 to 6 at once over the two replicas: batches of 1 to 3 each
            asks = [_ask(http, gw.url, f"warm {burst} {i} " + "w " * 40 * i, "go") for i in range(2 + 2 * (burst % 3))]
            await asyncio.gather(*asks)
            if learned():
                break
        assert learned(), "the latency model learned each replica's prefill and decode from the answers"
        before = await _seconds_decisions(http, gw.url)

        # one long answer on the holder of a system prompt; a second request with that prompt arrives meanwhile
        first = asyncio.ensure_future(_ask(http, gw.url, SYSTEM, "a long one", tokens=64))
        await wait_for(lambda: sum(r.in_flight for r in replicas) == 1, what="the first request running")
        second = await _ask(http, gw.url, SYSTEM, "a short one")
        holder, _ = await first
        assert second[1] == second_reason
        assert (second[0] != holder) == (unit == "seconds")
        # both decisions priced in seconds when asked for (and counted), in token equivalents otherwise
        assert await _seconds_decisions(http, gw.url) - before == (2 if unit == "seconds" else 0)
