"""The finalists a large pool's decision weighs in full (`policies.filters.finalists`), on literal snapshots."""

from __future__ import annotations

from policies.base import ReplicaState
from policies.filters import finalists


def rep(rid: str, load: int = 0, **kw: object) -> ReplicaState:
    return ReplicaState(rid, "m", in_flight=load, **kw)  # type: ignore[arg-type]


POOL = [rep(f"r{i:02d}", load=i % 5) for i in range(16)]  # loads 0 1 2 3 4 0 1 2 ...


def test_a_small_pool_is_weighed_whole_less_the_replicas_that_cannot_take_it() -> None:
    pool = [rep("a"), rep("b", ready=False), rep("c", draining=True), rep("d", load=2, max_concurrency=2), rep("e")]
    assert finalists(pool, {}, None, 4) == ["a", "e"]


def test_a_cold_prompt_keeps_the_least_loaded() -> None:
    assert finalists(POOL, {}, None, 4) == ["r00", "r05", "r10", "r15"]


def test_the_deepest_holders_and_the_least_loaded_each_get_half() -> None:
    overlap = {"r03": 9, "r04": 40, "r08": 40, "r13": 2}  # r04 (load 4) and r08 (load 3) hold the most
    # the deepest first, the less loaded of equal depths first; then the idle, those holding more first
    assert finalists(POOL, overlap, None, 4) == ["r08", "r04", "r00", "r05"]
    idle_holder = {**overlap, "r10": 1}  # an idle replica holding a little comes before the idle that hold none
    assert finalists(POOL, idle_holder, None, 4) == ["r08", "r04", "r10", "r00"]


def test_the_session_replica_is_kept_first_even_busy_and_holding_nothing() -> None:
    assert finalists(POOL, {"r04": 40, "r08": 40}, "r09", 4) == ["r09", "r08", "r00", "r05"]
    assert finalists(POOL, {}, "gone", 4) == ["r00", "r05", "r10", "r15"]  # not a candidate: not kept


def test_saturated_replicas_are_left_out_while_others_are_not() -> None:
    pool = [rep(f"s{i}", waiting=3, kv_usage=0.99) for i in range(4)] + POOL[:6]
    chosen = finalists(pool, {"s0": 50}, None, 4)
    assert "s0" not in chosen and chosen == ["r00", "r05", "r01", "r02"]


def test_k_bounds_the_finalists_and_keeps_them_distinct() -> None:
    overlap = {f"r{i:02d}": 16 - i for i in range(16)}
    for k in (2, 3, 4, 7, 16):
        chosen = finalists(POOL, overlap, "r00", k)
        assert len(chosen) == k and len(set(chosen)) == k


def test_equal_replicas_are_drawn_by_the_request_so_an_idle_pool_is_used_whole() -> None:
    idle = [rep(f"r{i:02d}") for i in range(16)]
    drawn = [finalists(idle, {}, None, 4, seed) for seed in range(16)]
    assert drawn[1] == ["r01", "r02", "r03", "r04"] and drawn[15] == ["r15", "r00", "r01", "r02"]
    assert {rid for chosen in drawn for rid in chosen} == {r.id for r in idle}


def test_a_prompt_no_replica_holds_keeps_the_least_loaded_and_those_with_the_most_room_by_turns() -> None:
    room = {f"r{i:02d}": 100 * i for i in range(16)}  # the most room on the busiest ids
    assert finalists(POOL, {}, None, 4, room=room) == ["r00", "r15", "r05", "r14"]
    # cached: half to the holders, then one of each
    assert finalists(POOL, {"r04": 40, "r08": 40}, None, 4, room=room) == ["r08", "r04", "r00", "r15"]
