"""The prefix index's packed tables: the same answers as a plain LRU of Python objects, in a bounded number of bytes."""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest

from cacheindex import replica_blocks
from cacheindex.block_table import SALT, BlockTable
from cacheindex.kv_index import KvIndex, StoredBlocks

# a replica walks a short prompt one block at a time and a long one in arrays: every model test runs both ways
both_paths = pytest.mark.parametrize("scalar", [replica_blocks._SCALAR, 0], ids=["short-prompts", "arrays"])


def test_a_table_finds_what_it_holds_through_growth_and_removal() -> None:
    rng = np.random.default_rng(3)
    keys = rng.integers(1, 2**64 - 1, 20_000, dtype=np.uint64)
    table = BlockTable(20_000, {"v": np.uint32})
    for chunk in np.array_split(keys, 50):  # grows from 256 entries to its largest, rehashing on the way
        slots = table.place(chunk)  # (before taking the column: placing may grow the table)
        table.cols["v"][slots] = chunk % np.uint64(1000)
    slots = table.find(keys)
    assert table.count == 20_000 and (slots >= 0).all() and len(set(slots.tolist())) == 20_000
    assert (table.cols["v"][slots] == keys % np.uint64(1000)).all()  # columns moved with their keys
    table.remove(slots[:5_000])
    assert (table.find(keys[:5_000]) == -1).all() and (table.find(keys[5_000:]) >= 0).all()
    assert [table.find_one(int(k)) >= 0 for k in keys[4_998:5_002]] == [False, False, True, True]
    absent = rng.integers(1, 2**64 - 1, 1_000, dtype=np.uint64)
    assert (table.find(absent) == -1).all()
    # a table at its largest: 1.3 x as many slots as entries, 9 bytes each here (key + column + bucket fill)
    assert table.nbytes() <= 20_000 / 0.85 * 13 + 8 * 13


def _model_overlap(lru: OrderedDict[int, None], prompt: list[int]) -> int:
    n = 0
    for h in prompt:
        if h not in lru:
            break
        n += 1
    return n


@both_paths
def test_the_index_answers_as_an_exact_lru_of_the_routed_prompts(scalar: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random prompts sharing prefixes, routed to a replica of 48 blocks (below 64 the eviction is exact): after
    every routing the overlap of every prompt equals an OrderedDict LRU's, fed the prompts tail first."""
    monkeypatch.setattr(replica_blocks, "_SCALAR", scalar)
    rnd = random.Random(11)
    prefixes = [[rnd.getrandbits(64) for _ in range(rnd.randint(2, 12))] for _ in range(8)]
    prompts = [p + [rnd.getrandbits(64) for _ in range(rnd.randint(0, 10))] for p in prefixes for _ in range(3)]
    idx = KvIndex()
    idx.add_replica("r", capacity_blocks=48)
    lru: OrderedDict[int, None] = OrderedDict()
    for _ in range(400):
        prompt = rnd.choice(prompts)
        idx.record_routed("r", prompt)
        for h in reversed(prompt):
            lru[h] = None
            lru.move_to_end(h)
            if len(lru) > 48:
                lru.popitem(last=False)
        assert idx.replica_size("r") == len(lru)
        assert [idx.overlap(p, ["r"])["r"] for p in prompts] == [_model_overlap(lru, p) for p in prompts]


@both_paths
def test_the_hot_footprint_counts_distinct_blocks_routed_within_the_window(
    scalar: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against a model (block -> last routed second), while the blocks routed within the window stay under twice
    the capacity: the footprint's count and each prompt's hot run match, held or evicted."""
    monkeypatch.setattr(replica_blocks, "_SCALAR", scalar)
    rnd = random.Random(5)
    now = [0.0]
    idx = KvIndex(hot_window_s=64, clock=lambda: now[0])  # epochs of 1 s
    idx.add_replica("r", capacity_blocks=40)
    prompts = [[rnd.getrandbits(64) for _ in range(rnd.randint(3, 9))] for _ in range(12)]
    routed: dict[int, float] = {}
    for step in range(300):
        now[0] = float(step // 3)
        prompt = rnd.choice(prompts[: 4 + (step // 60) * 2])  # the working set widens over time
        idx.record_routed("r", prompt)
        routed.update(dict.fromkeys(prompt, now[0]))
        hot = {h for h, t in routed.items() if now[0] - t < 64}
        assert len(hot) <= 80
        (fp,) = idx.footprint(prompt, ["r"]).values()
        assert fp.hot_blocks == len(hot)
        for p in prompts:
            (fp,) = idx.footprint(p, ["r"]).values()
            run = next((i for i, h in enumerate(p) if h not in hot), len(p))
            assert fp.hot_overlap == run


def test_a_full_replica_with_kv_events_costs_at_most_64_bytes_per_block_of_capacity() -> None:
    """The issue's budget, counted in the index's own arrays: 4,096 blocks held by KV events (so the engine-hash
    map is full too), then routed twice over, so the hot window also remembers a capacity's worth it evicted."""
    cap = 4096
    idx = KvIndex(speculative_ttl_s=2.0)
    idx.add_replica("r", capacity_blocks=cap, precise=True)
    tokens = list(range(cap * 4))
    idx.apply_stored("r", StoredBlocks(list(range(1, cap + 1)), None, tokens, 4), root_seed=1)
    assert idx.replica_size("r") == cap
    rnd = random.Random(1)
    for _ in range(2 * cap // 64):
        idx.record_routed("r", [rnd.getrandbits(64) for _ in range(64)])
    assert idx.nbytes() / cap <= 64


def test_every_hash_is_a_block_even_the_table_marks() -> None:
    """Tables mark an empty slot with 0 and store hashes salted: hashes 0 and 1 are blocks like any other, and so is
    the salt itself (it shares a key with the salt ^ 1: a 1 in 2^64 chance for a real hash)."""
    idx = KvIndex()
    idx.add_replica("r", capacity_blocks=8)
    idx.record_routed("r", [0, 1, 2])
    assert idx.overlap([0, 1, 2], ["r"]) == {"r": 3}
    assert idx.overlap([SALT, 5], ["r"]) == {"r": 0}  # not an empty slot
    idx.record_routed("r", [SALT, 5])
    assert idx.overlap([SALT, 5], ["r"]) == {"r": 2} and idx.replica_size("r") == 5
