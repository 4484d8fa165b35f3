"""KV index: longest-prefix lookup, LRU bound, speculative TTL, event re-hashing."""

from __future__ import annotations

import pytest

from cacheindex.hashing import chain_hashes, context_seed, prompt_block_hashes
from cacheindex.kv_index import KvIndex, StoredBlocks
from policies.base import Footprint

BS = 4
SEED = context_seed("m")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def hashes(tokens: list[int]) -> list[int]:
    return prompt_block_hashes(tokens, BS, model="m")


def test_overlap_counts_leading_blocks_and_stops_at_first_miss() -> None:
    idx = KvIndex()
    idx.add_replica("a", capacity_blocks=100)
    idx.add_replica("b", capacity_blocks=100)
    h = hashes(list(range(16)))  # 4 blocks
    idx.record_routed("a", h[:3])
    idx.record_routed("b", [h[0], h[2], h[3]])  # hole at block 1
    assert idx.overlap(h, ["a", "b", "unknown"]) == {"a": 3, "b": 1, "unknown": 0}
    assert idx.size() == 6 and idx.sizes() == {"a": 3, "b": 3}


def test_lru_bound_evicts_oldest() -> None:
    idx = KvIndex()
    idx.add_replica("a", capacity_blocks=3)
    h1 = hashes(list(range(8)))
    h2 = hashes(list(range(100, 108)))
    idx.record_routed("a", h1)
    idx.record_routed("a", h1[:1])  # refresh block 0
    idx.record_routed("a", h2)  # LRU order was h1[1], h1[0]; adding 2 evicts h1[1]
    assert idx.replica_size("a") == 3
    assert idx.overlap(h1, ["a"]) == {"a": 1}
    assert idx.overlap(h2, ["a"]) == {"a": 2}


def test_capacity_pressure_forgets_a_prefix_from_its_end() -> None:
    """Like vLLM (which frees a request's blocks tail first), the index keeps the head of a prefix longest: a
    4-block prompt squeezed by 2 new blocks still matches its first 2 blocks (evicting the head would lose all)."""
    idx = KvIndex()
    idx.add_replica("a", capacity_blocks=4)
    h1 = hashes(list(range(16)))
    idx.record_routed("a", h1)
    idx.record_routed("a", hashes(list(range(100, 108))))
    assert idx.overlap(h1, ["a"]) == {"a": 2}


def test_a_lapsed_speculative_block_ends_the_run() -> None:
    clock = Clock()
    idx = KvIndex(speculative_ttl_s=2.0, clock=clock)
    idx.add_replica("a", capacity_blocks=10, precise=True)
    h = hashes(list(range(12)))  # 3 blocks
    idx.record_routed("a", h)  # expire at 2
    clock.now = 1.0
    idx.record_routed("a", h[:1])  # block 0 refreshed: expires at 3
    clock.now = 2.5
    assert idx.overlap(h, ["a"]) == {"a": 1}


def test_speculative_entries_expire_only_on_replicas_with_events() -> None:
    clock = Clock()
    idx = KvIndex(speculative_ttl_s=2.0, clock=clock)
    idx.add_replica("precise", capacity_blocks=10, precise=True)
    idx.add_replica("approx", capacity_blocks=10, precise=False)
    h = hashes(list(range(8)))
    idx.record_routed("precise", h)
    idx.record_routed("approx", h)
    clock.now = 1.0
    assert idx.overlap(h, ["precise", "approx"]) == {"precise": 2, "approx": 2}
    clock.now = 3.0
    assert idx.overlap(h, ["precise", "approx"]) == {"precise": 0, "approx": 2}


def test_event_confirms_speculative_entry() -> None:
    clock = Clock()
    idx = KvIndex(speculative_ttl_s=2.0, clock=clock)
    idx.add_replica("a", capacity_blocks=10, precise=True)
    tokens = list(range(8))
    h = hashes(tokens)
    idx.record_routed("a", h)
    assert idx.apply_stored("a", StoredBlocks([101, 102], None, tokens, BS), SEED) == 2
    idx.record_routed("a", h)  # a later routed insert does not downgrade confirmed entries
    clock.now = 100.0
    assert idx.overlap(h, ["a"]) == {"a": 2}


def test_stored_events_are_rehashed_and_chained_through_engine_hashes() -> None:
    idx = KvIndex()
    idx.add_replica("a", capacity_blocks=100, precise=True)
    tokens = list(range(20))  # 5 blocks
    h = hashes(tokens)
    # the engine stores blocks 0-1, then 2-4 in a second event whose parent is engine hash 0xB
    assert idx.apply_stored("a", StoredBlocks([0xA, 0xB], None, tokens[:8], BS), SEED) == 2
    assert idx.apply_stored("a", StoredBlocks([0xC, 0xD, 0xE], 0xB, tokens[8:20], BS), SEED) == 3
    assert idx.overlap(h, ["a"]) == {"a": 5}
    # BlockRemoved carries engine hashes only: the middle block goes, the prefix now stops there
    assert idx.apply_removed("a", [0xC, 0x999]) == 1
    assert idx.overlap(h, ["a"]) == {"a": 2}


def test_stored_event_with_unknown_parent_is_skipped() -> None:
    idx = KvIndex()
    idx.add_replica("a", capacity_blocks=100, precise=True)
    assert idx.apply_stored("a", StoredBlocks([1], 0xDEAD, list(range(4)), BS), SEED) == -1
    assert idx.size() == 0


def test_stored_event_partial_trailing_tokens_ignored() -> None:
    idx = KvIndex()
    idx.add_replica("a", capacity_blocks=100, precise=True)
    tokens = list(range(10))
    assert idx.apply_stored("a", StoredBlocks([1, 2, 3], None, tokens, BS), SEED) == 2
    assert chain_hashes(tokens, BS, SEED) == hashes(tokens)


def test_clear_and_remove_replica() -> None:
    idx = KvIndex()
    idx.add_replica("a", capacity_blocks=10, precise=True)
    tokens = list(range(8))
    idx.apply_stored("a", StoredBlocks([1, 2], None, tokens, BS), SEED)
    idx.clear("a")
    assert idx.overlap(hashes(tokens), ["a"]) == {"a": 0}
    # engine-hash map cleared too: a child of a forgotten parent cannot be placed
    assert idx.apply_stored("a", StoredBlocks([3], 2, list(range(8, 12)), BS), SEED) == -1
    idx.remove_replica("a")
    assert "a" not in idx and idx.sizes() == {}
    idx.record_routed("a", hashes(tokens))  # unknown replica: ignored
    assert idx.size() == 0


def test_rejects_bad_capacity() -> None:
    with pytest.raises(ValueError):
        KvIndex().add_replica("a", capacity_blocks=0)


# --- learning from reported cached tokens (replicas without KV events) ---------------------------------------------
def test_a_reported_miss_drops_what_an_lru_engine_evicted_and_estimates_its_capacity() -> None:
    """The engine holds 40 blocks (LRU); kvgate assumed 1000. Ten 8-block prompts go to the replica; the first
    is asked for again: the engine reports nothing cached. kvgate drops what is as old as that and older, and
    its capacity estimate comes down from 1000 to the age at which blocks went missing."""
    idx = KvIndex()
    idx.add_replica("r", capacity_blocks=1000, capacity_known=False)
    prompts = [[1000 * p + b for b in range(8)] for p in range(10)]
    for hashes in prompts:
        idx.record_routed("r", hashes)
    first = prompts[0]
    predicted = idx.overlap(first, ["r"])["r"]
    assert predicted == 8  # kvgate believes it is still there
    inserts_at, ages = idx.inserts("r"), idx.ages("r", first, predicted, None)
    assert ages[0] == 72  # 72 new blocks came after it
    dropped = idx.observe("r", predicted, 0, ages, inserts_at)
    assert dropped >= 8 and idx.overlap(first, ["r"])["r"] == 0
    assert idx.overlap(prompts[-1], ["r"])["r"] == 8  # recent prompts are kept
    assert idx.capacities()["r"] == (72, False)


def test_a_miss_on_blocks_still_in_prefill_is_no_eviction() -> None:
    idx = KvIndex()
    idx.add_replica("r", capacity_blocks=1000, capacity_known=False)
    idx.record_routed("r", [1, 2, 3])  # request A, still in flight (its blocks are not yet in the engine)
    settled_before = idx.inserts("r") - 3  # A was routed when the index had taken 0 blocks
    ages = idx.ages("r", [1, 2, 3], 3, settled_before)
    assert ages == (-1, -1, -1)
    assert idx.observe("r", 3, 0, ages, idx.inserts("r")) == 0
    assert idx.capacities()["r"] == (1000, False) and idx.overlap([1, 2, 3], ["r"])["r"] == 3


def test_a_known_capacity_is_not_re_estimated_and_event_replicas_are_left_to_events() -> None:
    idx = KvIndex()
    idx.add_replica("known", capacity_blocks=100)
    idx.add_replica("events", capacity_blocks=100, precise=True)
    for rid in ("known", "events"):
        idx.record_routed(rid, list(range(50)))
        idx.record_routed(rid, list(range(100, 130)))
    ages = idx.ages("known", list(range(50)), 50, None)
    assert idx.observe("known", 50, 0, ages, idx.inserts("known")) > 0  # stale entries dropped
    assert idx.capacities()["known"] == (100, True)
    assert idx.ages("events", list(range(50)), 50, None) == ()
    assert idx.observe("events", 50, 0, (), 0) == 0


def test_footprint_counts_distinct_blocks_routed_within_the_window() -> None:
    now = [0.0]
    idx = KvIndex(hot_window_s=10, clock=lambda: now[0])
    idx.add_replica("r", capacity_blocks=100)
    idx.record_routed("r", [1, 2, 3])
    idx.record_routed("r", [1, 2, 4])
    assert idx.footprint([1, 2, 9], ["r", "unknown"]) == {"r": Footprint(4, 100, 2)}
    now[0] = 5.0
    idx.record_routed("r", [1, 5])
    now[0] = 12.0  # blocks 2, 3, 4 were last routed at 0 s
    assert idx.footprint([1, 2, 9], ["r"]) == {"r": Footprint(2, 100, 1)}


def test_a_routed_prompt_stays_hot_for_the_window_whether_or_not_the_cache_keeps_it() -> None:
    """Routing stamps the whole prompt (a growing session's prefix stays hot), a block routed again is counted once,
    and a block the LRU pushed out still counts in the footprint and in a request's hot run until its stamp leaves
    the window."""
    now = [0.0]
    idx = KvIndex(hot_window_s=16, clock=lambda: now[0])
    idx.add_replica("r", capacity_blocks=4)
    idx.record_routed("r", [1, 2, 3])
    now[0] = 8.0
    idx.record_routed("r", [1, 2, 3, 4])  # 1-3 again: 4 distinct blocks
    assert idx.footprint([1, 2, 3, 4], ["r"]) == {"r": Footprint(4, 4, 4)}
    idx.record_routed("r", [5, 6])  # the LRU (4 blocks) pushes out 4 and 3, the tail of the older prompt
    assert idx.overlap([1, 2, 3, 4], ["r"]) == {"r": 2}
    assert idx.footprint([1, 2, 3, 4], ["r"]) == {"r": Footprint(6, 4, 4)}
    now[0] = 20.0
    idx.record_routed("r", [3, 7])  # 3 comes back from the evicted: still one block of the footprint
    assert idx.footprint([1, 2, 3, 4], ["r"]) == {"r": Footprint(7, 4, 4)}
    now[0] = 24.5  # the stamps of 8 s have left the window; those of 20 s have not
    assert idx.footprint([1, 2, 3, 4], ["r"]) == {"r": Footprint(2, 4, 0)}
    assert idx.footprint([3, 7], ["r"]) == {"r": Footprint(2, 4, 2)}


def test_a_miss_drops_only_what_is_older_than_the_missing_block() -> None:
    """Blocks used after the missing block (before or after the request was routed) stay: an LRU keeps them.
    (A known capacity, so that only the drop is at work, not the capacity estimate.)"""
    idx = KvIndex()
    idx.add_replica("r", capacity_blocks=1000)
    prompts = [[1000 * p + b for b in range(8)] for p in range(10)]
    for hashes in prompts:
        idx.record_routed("r", hashes)
    first = prompts[0]
    inserts_at, ages = idx.inserts("r"), idx.ages("r", first, 8, None)
    idx.record_routed("r", first)  # the request itself, routed there
    for p in range(10, 15):  # other requests routed while it ran
        idx.record_routed("r", [1000 * p + b for b in range(8)])
    assert idx.observe("r", 8, 0, ages, inserts_at) == 0  # first was just re-inserted; nothing older is left
    assert all(idx.overlap(h, ["r"])["r"] == 8 for h in prompts[1:])


def test_the_cpu_tier_holds_what_the_gpu_evicted_and_continues_its_run() -> None:
    idx = KvIndex()
    idx.add_replica("a", capacity_blocks=100, precise=True)
    tokens = list(range(20))  # 5 blocks
    h = hashes(tokens)
    engine = [0xA, 0xB, 0xC, 0xD, 0xE]
    assert idx.apply_stored("a", StoredBlocks(engine, None, tokens, BS), SEED) == 5
    # vLLM's offloading events without token ids name blocks the GPU stored: translated through its map
    assert idx.apply_stored("a", StoredBlocks(engine, None, [], BS), SEED, offloaded=True) == 5
    assert idx.apply_removed("a", engine[2:]) == 3  # the GPU evicts blocks 2-4
    assert idx.overlap(h, ["a"]) == {"a": 2}
    assert idx.offloaded(h, {"a": 2}) == {"a": 3}
    assert idx.offloaded_sizes() == {"a": 5}
    # the CPU tier evicts block 3: its run after the GPU's stops there
    assert idx.apply_removed("a", [0xD], offloaded=True) == 1
    assert idx.offloaded(h, {"a": 2}) == {"a": 1}
    # a GPU store whose parent only the CPU tier still maps is placed in the chain
    assert idx.apply_stored("a", StoredBlocks([0xF], 0xC, tokens[12:16], BS), SEED) == 1
    assert idx.overlap(h, ["a"]) == {"a": 2}  # block 2 is still missing on the GPU
    idx.clear("a")
    assert idx.offloaded(h, {"a": 0}) == {} and idx.offloaded_sizes() == {}


def test_a_self_describing_cpu_store_is_rehashed_and_unknown_hashes_are_skipped() -> None:
    idx = KvIndex()
    idx.add_replica("a", capacity_blocks=100, precise=True)
    tokens = list(range(8))
    assert idx.apply_stored("a", StoredBlocks([0x1, 0x2], None, tokens, BS), SEED, offloaded=True) == 2
    assert idx.offloaded(hashes(tokens), {"a": 0}) == {"a": 2}
    assert idx.apply_stored("a", StoredBlocks([0x77], None, [], BS), SEED, offloaded=True) == -1


def test_holders_of_a_first_block_follow_routing_events_and_eviction() -> None:
    idx = KvIndex()
    idx.add_replica("a", capacity_blocks=4)
    idx.add_replica("b", capacity_blocks=100)
    idx.add_replica("c", capacity_blocks=100)
    idx.record_routed("a", [1, 2, 3])
    idx.record_routed("b", [1, 2])
    assert sorted(idx.holders(1)) == ["a", "b"] and idx.holders(2) == []  # only first blocks are hinted
    idx.record_routed("a", [7, 8, 9, 10])  # a holds 4 blocks: these push 1, 2 and 3 out
    assert idx.holders(1) == ["b"]
    tokens = list(range(32))
    idx.apply_stored("c", StoredBlocks(["e0", "e1"], None, tokens, 16), root_seed=5)  # a root block, by event
    assert idx.holders(chain_hashes(tokens, 16, 5)[0]) == ["c"]
    idx.remove_replica("b")
    assert idx.holders(1) == []
