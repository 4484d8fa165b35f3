"""cache-aware policy: every branch on literal snapshots."""

from __future__ import annotations

from typing import Any

import pytest

from policies.base import Decision, Footprint, NoCandidate, ReplicaState, RequestInfo, RoutingView
from policies.cache_aware import CacheAware, expected_waiting
from policies.registry import build_policy

BS = 16


def req(blocks: int = 64, session: str | None = None) -> RequestInfo:
    return RequestInfo(
        model="m", prompt_tokens=blocks * BS + 5, block_hashes=tuple(range(blocks)), block_size=BS,
        session_key=session,
    )  # fmt: skip


def rep(rid: str, load: int = 0, **kw: Any) -> ReplicaState:
    return ReplicaState(id=rid, model="m", in_flight=load, **kw)


def decide(
    replicas: list[ReplicaState],
    overlap: dict[str, int] | None = None,
    *,
    request: RequestInfo | None = None,
    session: str | None = None,
    seq: int = 0,
    **params: Any,
) -> Decision:
    view = RoutingView(request or req(), tuple(replicas), overlap or {}, session, seq)
    return CacheAware(params).decide(view)


def test_registered() -> None:
    assert isinstance(build_policy("cache-aware"), CacheAware)


def test_cold_goes_to_least_loaded() -> None:
    d = decide([rep("a", 3), rep("b", 1), rep("c", 2)])
    assert (d.replica, d.reason) == ("b", "cold-least-load")
    assert d.scores["b"] == 1.0 and d.scores["a"] < d.scores["c"] < 1.0


def test_cold_ties_rotate_with_seq() -> None:
    picks = [decide([rep("a"), rep("b"), rep("c")], seq=s).replica for s in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_cold_tie_broken_by_engine_queue_then_rotation() -> None:
    d = decide([rep("a", 1, waiting=1, running=0), rep("b", 1, waiting=0, running=1)])
    assert d.replica == "b"


def test_hit_goes_to_best_overlap_despite_somewhat_more_load() -> None:
    d = decide([rep("a", 4), rep("b", 0)], {"a": 64, "b": 0})  # 1024 cached tokens vs 4 x 256
    assert (d.replica, d.reason) == ("a", "cache-hit")


def test_hot_prefix_spreads_when_holder_is_overloaded() -> None:
    d = decide([rep("a", 17), rep("b", 0)], {"a": 64, "b": 0})  # 17 x 64 > 1024 saved
    assert (d.replica, d.reason) == ("b", "spread-hot-prefix")


def test_spread_prefers_a_partial_holder() -> None:
    d = decide([rep("a", 10), rep("b", 0), rep("c", 0)], {"a": 64, "b": 0, "c": 32})
    assert (d.replica, d.reason) == ("c", "spread-hot-prefix")


def test_two_holders_share_a_hot_prefix_by_load() -> None:
    d = decide([rep("a", 3), rep("b", 2)], {"a": 64, "b": 64})
    assert (d.replica, d.reason) == ("b", "cache-hit")


def test_kv_pressure_penalises_a_full_replica() -> None:
    d = decide([rep("a", 0, kv_usage=1.0), rep("b", 1, kv_usage=0.2)])
    assert (d.replica, d.reason) == ("b", "cold-least-load")
    # below the threshold KV usage does not matter
    assert decide([rep("a", 0, kv_usage=0.85), rep("b", 1, kv_usage=0.1)]).replica == "a"


def test_engine_queue_counts_as_load() -> None:
    d = decide([rep("a", 0, running=4, waiting=6), rep("b", 1)], {"a": 64})
    assert (d.replica, d.reason) == ("b", "spread-hot-prefix")


def test_session_sticks_to_bound_replica() -> None:
    d = decide([rep("a", 2), rep("b", 0)], {"a": 64, "b": 64}, session="a")
    assert (d.replica, d.reason) == ("a", "session")


def test_a_session_whose_replica_holds_less_of_the_prompt_than_another_goes_by_cost() -> None:
    """An end user's `user` field binds a session; their next question is on a document another replica holds:
    the document's replica, not the user's (the rule used to override the cost, and the pool thrashed)."""
    d = decide([rep("a", 0), rep("b", 1)], {"a": 8, "b": 64}, session="a")
    assert (d.replica, d.reason) == ("b", "cache-hit")


def test_session_leaves_an_overloaded_replica() -> None:
    # gap 20 > 4 and 20 > 1.5 x 0: overloaded, falls back to cost (20 x 64 > 1024 saved)
    d = decide([rep("a", 20), rep("b", 0)], {"a": 64}, session="a")
    assert (d.replica, d.reason) == ("b", "spread-hot-prefix")
    # gap 9 > 4 but 30 <= 1.5 x 21: not overloaded by ratio
    d = decide([rep("a", 30), rep("b", 21)], {}, session="a")
    assert (d.replica, d.reason) == ("a", "session")


def test_session_gap_boundary() -> None:
    # gap 4 is tolerated, gap 5 (> session_max_gap 4, and 5 > 1.5 x 0) is not
    assert decide([rep("a", 4), rep("b", 0)], {}, session="a").reason == "session"
    d = decide([rep("a", 5), rep("b", 0)], {}, session="a")
    assert (d.replica, d.reason) == ("b", "cold-least-load")


def test_engine_waiting_queue_costs_more_than_running() -> None:
    # same load (4), same overlap; a's engine has 2 waiting for a slot: the holder with a free slot wins
    d = decide([rep("a", 0, running=2, waiting=2), rep("b", 4)], {"a": 64, "b": 64})
    assert (d.replica, d.reason) == ("b", "cache-hit")
    # a queue on the only holder spreads the hot prefix (2 x 1024 > 1024 cached tokens)
    d = decide([rep("a", 2, waiting=2), rep("b", 2)], {"a": 64})
    assert (d.replica, d.reason) == ("b", "spread-hot-prefix")
    # without the waiting term the holder keeps it
    assert decide([rep("a", 2, waiting=2), rep("b", 2)], {"a": 64}, waiting_request_cost=0).replica == "a"


def test_known_batch_slots_predict_the_wait_before_the_engine_reports_it() -> None:
    # a holds the prefix and has 4 in flight; the engine has not reported a queue yet (stale scrape).
    # Cost a = 5 uncached + 4 x 256 = 1029 = cost b (1029 uncached): tie -> the holder.
    assert decide([rep("a", 4), rep("b", 0)], {"a": 64}).replica == "a"
    # with 4 batch slots, a fifth request would wait for one (+1024): the prefix spreads to b
    d = decide([rep("a", 4, max_num_seqs=4), rep("b", 0, max_num_seqs=4)], {"a": 64})
    assert (d.replica, d.reason) == ("b", "spread-hot-prefix")
    # a free slot left: no predicted wait, the holder keeps it
    d = decide([rep("a", 4, max_num_seqs=5), rep("b", 0, max_num_seqs=5)], {"a": 64})
    assert (d.replica, d.reason) == ("a", "cache-hit")
    # the engine's own report counts when it is the larger of the two
    assert expected_waiting(rep("a", 1, waiting=3, max_num_seqs=4)) == 3
    assert expected_waiting(rep("a", 6, waiting=0, max_num_seqs=4)) == 3
    assert expected_waiting(rep("a", 6, waiting=2)) == 2  # slots unknown: only the report


def test_session_bound_to_a_gone_or_unroutable_replica() -> None:
    d = decide([rep("a", 1), rep("b", 0)], {}, session="gone")
    assert (d.replica, d.reason) == ("b", "cold-least-load")
    d = decide([rep("a", 0, draining=True), rep("b", 3)], {}, session="a")
    assert (d.replica, d.reason) == ("b", "cold-least-load")


def test_filters_unready_and_full_replicas() -> None:
    d = decide([rep("a", 0, ready=False), rep("b", 2, max_concurrency=2), rep("c", 5)], {"a": 64, "b": 64})
    assert d.replica == "c"
    with pytest.raises(NoCandidate):
        decide([rep("a", ready=False)])


def test_empty_prompt_is_cold() -> None:
    d = decide([rep("a", 1), rep("b", 0)], {}, request=RequestInfo(model="m"))
    assert (d.replica, d.reason) == ("b", "cold-least-load")


def test_order_of_the_snapshot_does_not_matter() -> None:
    reps = [rep("a", 1), rep("b", 1), rep("c", 1)]
    assert decide(reps, seq=4).replica == decide(list(reversed(reps)), seq=4).replica


def test_params_change_the_tradeoff() -> None:
    reps, overlap = [rep("a", 5), rep("b", 0)], {"a": 64}
    assert decide(reps, overlap, queued_request_cost=100).replica == "a"
    assert decide(reps, overlap, queued_request_cost=0.0, prefill_token_cost=2).reason == "cache-hit"


@pytest.mark.parametrize(
    "params",
    [
        {"nope": 1},
        {"prefill_token_cost": 0},
        {"queued_request_cost": -1},
        {"waiting_request_cost": -1},
        {"kv_usage_threshold": 1.0},
        {"session_max_gap": 1.5},
        {"session_max_ratio": 0.5},
        {"kv_pressure_cost": "high"},
        {"session_max_gap": True},
        {"imbalance_gap": 1.5},
        {"imbalance_cost": -1},
    ],
)
def test_bad_params_rejected(params: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(params))):  # the error names the parameter
        CacheAware(params)


# --- placement by cache capacity (view.footprint) ------------------------------------------------------------------
def decide_fp(
    replicas: list[ReplicaState],
    footprint: dict[str, tuple[int, ...]],
    overlap: dict[str, int] | None = None,
    *,
    request: RequestInfo | None = None,
    **params: Any,
) -> Decision:
    fp = {rid: Footprint(*values) for rid, values in footprint.items()}
    view = RoutingView(request or req(20), tuple(replicas), overlap or {}, None, 0, fp)
    return CacheAware(params).decide(view)


def test_cold_prefix_goes_where_it_fits_not_only_where_load_is_lowest() -> None:
    # a holds 150 of 160 blocks of hot prefixes, b 40: a 20-block cold prompt fits on b without evicting anything,
    # on a it would push 10 hot blocks out; one request more in flight on b does not outweigh that
    d = decide_fp([rep("a", 1), rep("b", 2)], {"a": (150, 160), "b": (40, 160)})
    assert (d.replica, d.reason) == ("b", "cold-least-load")
    # without footprints the same snapshot goes to the less loaded replica
    assert decide([rep("a", 1), rep("b", 2)], request=req(20)).replica == "a"


def test_hot_prefix_is_not_copied_onto_a_full_replica() -> None:
    # a holds the prompt's 20 blocks and is 6 requests busier: without footprints the prefix spreads to b;
    # with b's cache full of other hot prefixes, copying it there evicts 20 of them: it stays on a
    spread = decide([rep("a", 6), rep("b", 0)], {"a": 20}, request=req(20))
    assert (spread.replica, spread.reason) == ("b", "spread-hot-prefix")
    d = decide_fp([rep("a", 6), rep("b", 0)], {"a": (100, 160), "b": (160, 160)}, {"a": 20})
    assert (d.replica, d.reason) == ("a", "cache-hit")
    # with room on b, the copy costs no eviction and the spread happens as before
    d = decide_fp([rep("a", 6), rep("b", 0)], {"a": (100, 160), "b": (0, 160)}, {"a": 20})
    assert (d.replica, d.reason) == ("b", "spread-hot-prefix")


def test_a_prefix_evicted_where_it_was_placed_goes_back_there() -> None:
    # both caches full; no replica holds the prompt any more (overlap 0), but its 20 blocks were routed to b
    # recently: on b they are part of the working set already, on a they would push 20 hot blocks out
    d = decide_fp([rep("a", 0), rep("b", 1)], {"a": (160, 160, 0), "b": (160, 160, 20)})
    assert d.replica == "b"


def test_on_full_replicas_only_the_request_own_evictions_count() -> None:
    # both caches are over-subscribed, a's much more than b's; a holds 18 of the prompt's 20 blocks. Sending it to
    # a evicts 2 hot blocks there, to b 20: the hit wins, whatever the overflow that was there before
    d = decide_fp([rep("a", 0), rep("b", 0)], {"a": (400, 160), "b": (200, 160)}, {"a": 18})
    assert (d.replica, d.reason) == ("a", "cache-hit")


def test_a_cold_placement_spares_the_replica_where_agents_are_expected_back() -> None:
    # both caches full; a's evictions would push out the blocks of agents waiting on their tool calls (30 blocks),
    # b's only blocks nobody is waiting for: the cold prompt goes to b although b has one more request in flight
    d = decide_fp([rep("a", 1), rep("b", 2)], {"a": (160, 160, 0, 30), "b": (160, 160, 0, 0)})
    assert (d.replica, d.reason) == ("b", "cold-least-load")
    # the same snapshot with nobody awaited goes by load; awaited_cost 0 turns the term off
    assert decide_fp([rep("a", 1), rep("b", 2)], {"a": (160, 160), "b": (160, 160)}).replica == "a"
    off = decide_fp([rep("a", 1), rep("b", 2)], {"a": (160, 160, 0, 30), "b": (160, 160)}, awaited_cost=0)
    assert off.replica == "a"


def test_awaited_blocks_cost_nothing_while_the_cold_prompt_fits() -> None:
    # a has room for the 20-block prompt: nothing is evicted, the awaited agents lose nothing, load decides
    d = decide_fp([rep("a", 1), rep("b", 2)], {"a": (100, 160, 0, 90), "b": (100, 160, 0, 0)})
    assert d.replica == "a"


def test_the_priced_awaited_blocks_are_at_most_the_request_own_evictions() -> None:
    # a would evict 20 blocks, so at most 20 of the 100 awaited there count: 20 x 16 tokens = 320, against b's 5
    # more requests in flight (5 x 64 = 320) and its imbalance (32): a wins, by 32 (all 100 counted: b would)
    d = decide_fp([rep("a", 0), rep("b", 5)], {"a": (160, 160, 0, 100), "b": (160, 160, 0, 0)})
    assert d.replica == "a"
    assert d.scores["b"] < 1.0


def test_footprint_terms_can_be_turned_off() -> None:
    d = decide_fp([rep("a", 1), rep("b", 2)], {"a": (150, 160), "b": (40, 160)}, eviction_cost=0, placement_cost=0)
    assert d.replica == "a"
    with pytest.raises(ValueError, match="eviction_cost"):
        CacheAware({"eviction_cost": -1})


# --- the offloading tier (view.offloaded) --------------------------------------------------------------------------
def decide_tiers(
    replicas: list[ReplicaState], overlap: dict[str, int], offloaded: dict[str, int], **params: Any
) -> Decision:
    view = RoutingView(req(), tuple(replicas), overlap, None, 0, {}, offloaded)
    return CacheAware(params).decide(view)


def test_a_prefix_in_the_cpu_tier_beats_recomputing_it_elsewhere() -> None:
    # a holds the 64-block prompt in CPU memory only: loading 1024 tokens costs 0.2 x 1024 ~ 205, less than
    # recomputing them on idle b, and more than the 3 requests' queue it has (3 x 64)
    d = decide_tiers([rep("a", 3), rep("b", 0)], {"a": 0, "b": 0}, {"a": 64})
    assert (d.replica, d.reason) == ("a", "offload-hit")
    assert d.scores["b"] < 1.0


def test_a_gpu_hit_beats_the_same_prefix_in_the_cpu_tier() -> None:
    d = decide_tiers([rep("a"), rep("b")], {"a": 0, "b": 64}, {"a": 64})
    assert (d.replica, d.reason) == ("b", "cache-hit")


def test_the_cpu_tier_extends_a_gpu_run() -> None:
    # a: 16 blocks on the GPU and the next 48 in CPU memory; b: 32 on the GPU and nothing more
    d = decide_tiers([rep("a"), rep("b")], {"a": 16, "b": 32}, {"a": 48})
    assert (d.replica, d.reason) == ("a", "offload-hit")


def test_a_cpu_hit_priced_as_a_recompute_is_no_hit() -> None:
    d = decide_tiers([rep("a", 1), rep("b", 0)], {"a": 0, "b": 0}, {"a": 64}, offload_token_cost=1.0)
    assert d.replica == "b"


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_offload_token_cost_is_a_fraction(value: float) -> None:
    with pytest.raises(ValueError, match="offload_token_cost"):
        CacheAware({"offload_token_cost": value})


# --- the learned queue price (ReplicaState.queue_price) ------------------------------------------------------------
def test_a_learned_queue_price_spreads_a_hot_prefix_sooner_when_opted_in() -> None:
    # a holds the 64-block prompt (1024 tokens saved) and has 4 requests; each costs 64 by default, 400 learned
    replicas = [rep("a", 4, queue_price=400.0), rep("b", 0, queue_price=400.0)]
    assert decide(replicas, {"a": 64}).replica == "a"  # default: the constant (4 x 64 < 1024)
    assert decide(replicas, {"a": 64}, learn_queue_price=True).replica == "b"  # 4 x 400 > 1024


def test_a_learned_price_below_the_constant_does_not_make_load_free() -> None:
    replicas = [rep("a", 17, queue_price=0.0), rep("b", 0, queue_price=0.0)]
    assert decide(replicas, {"a": 64}, learn_queue_price=True).replica == "b"  # 17 x 64 > 1024: the floor holds


def test_an_idle_replica_takes_the_request_with_the_least_cache_to_lose() -> None:
    # a, b, c hold a 96-block shared prompt and 11, 11, 10 requests; d is idle. Without the imbalance term a new
    # session (shares only the prompt) stays on a holder: 645 (5 uncached + 10 x 64) < 1541 tokens to copy
    new_session = req(96)
    busy = [rep("a", 11), rep("b", 11), rep("c", 10)]
    held = {"a": 96, "b": 96, "c": 96}
    assert decide([*busy, rep("d", 0)], held, request=new_session, imbalance_cost=0).replica == "c"
    # with it (default 32), c's excess over d (10 - 0 - gap 4 = 6) adds 6 x 6 x 32 = 1152: 1797 > 1541, d gets the copy
    d = decide([*busy, rep("d", 0)], held, request=new_session)
    assert (d.replica, d.reason) == ("d", "spread-hot-prefix")
    # a session whose own 128-block history is cached on c has more to lose (3589 tokens on d): it stays
    deep = req(224)
    d = decide([*busy, rep("d", 0)], {**held, "c": 224}, request=deep)
    assert (d.replica, d.reason) == ("c", "cache-hit")


def test_imbalance_within_the_gap_costs_nothing() -> None:
    # 4 more requests than the least loaded replica is tolerated (the gap), whatever imbalance_cost is
    d = decide([rep("a", 4), rep("b", 0)], {"a": 64}, imbalance_cost=10_000)
    assert (d.replica, d.reason) == ("a", "cache-hit")
    assert decide([rep("a", 5), rep("b", 0)], {"a": 64}, imbalance_cost=0).replica == "a"
    d = decide([rep("a", 5), rep("b", 0)], {"a": 64}, imbalance_cost=10_000)
    assert (d.replica, d.reason) == ("b", "spread-hot-prefix")
