"""`ReplicaBlocks`: what the prefix index (cacheindex.kv_index) believes one replica's KV cache holds.

Structure:
- `blocks`: `OrderedDict[kvgate_hash, insert_seq]` in LRU order, bounded by the replica's capacity in blocks
  (vLLM's `num_gpu_blocks`, or the index's online estimate); inserting past capacity evicts the least recently used
  entry. `insert_seq` is the replica's count of new blocks at the block's last use, so `inserts - insert_seq` is
  how many new blocks the replica has taken since: the block's LRU age, which is what pushes it out.
- `speculative`: `kvgate_hash -> expiry` for blocks recorded at routing time on a replica that publishes KV events;
  if its events do not confirm them within the index's `speculative_ttl_s` they stop counting (dropped lazily).
- `recent`: `OrderedDict[kvgate_hash, last_routed_time]`, the blocks requests routed there used within the hot
  window: the replica's hot footprint (its working set), which placement weighs against capacity.
- `engine_to_kvgate`: the engine's block hashes -> kvgate's (KV events name blocks by the engine's hashes), an LRU
  bounded by `2 x capacity`.
- `offloaded`: the blocks the replica's second tier holds (vLLM's KV offloading to CPU memory: KV events with
  `medium="CPU"`), an LRU bounded by `max(8 x capacity, 65,536)`, with its own engine-hash map (`offload_map`).
- the capacity estimate's state (`age_estimate`, `oldest_hit_age`), which the index's `observe` updates.

Cost: `insert_all`, `drop` and `offload` are O(1) per block (evictions included); `shrink_to` O(blocks evicted);
`kvgate_hash` O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

EngineHash = Hashable  # vLLM publishes int (low 64 bits) or bytes hashes

# The second tier's bound: a multiple of the GPU capacity (hosts usually give offloading several times the GPU's KV).
_OFFLOAD_FACTOR = 8
_OFFLOAD_MIN = 65_536


@dataclass(slots=True)
class ReplicaBlocks:
    capacity: int
    capacity_known: bool  # from the engine (num_gpu_blocks); else estimated online from feedback
    precise: bool  # the replica publishes KV events: routed inserts are speculative and expire
    bound: int = 0  # the configured or default capacity: an estimate never exceeds it
    blocks: OrderedDict[int, int] = field(default_factory=OrderedDict)
    speculative: dict[int, float] = field(default_factory=dict)
    recent: OrderedDict[int, float] = field(default_factory=OrderedDict)
    engine_to_kvgate: OrderedDict[EngineHash, int] = field(default_factory=OrderedDict)
    offloaded: OrderedDict[int, None] = field(default_factory=OrderedDict)  # the second tier (CPU), LRU
    offload_map: OrderedDict[EngineHash, int] = field(default_factory=OrderedDict)  # its engine-hash map
    inserts: int = 0  # new blocks taken so far (the LRU age clock)
    age_estimate: float | None = None  # exponential mean of the LRU ages of blocks found evicted
    oldest_hit_age: int = 0  # the largest LRU age seen still cached (a floor under the estimate)

    def insert_all(self, hashes: Iterable[int], expiry: float | None) -> None:
        """Insert or refresh each block in turn (the last one ends up most recent), evicting past capacity.
        `expiry` None: confirmed; else speculative until then (a confirmed block stays confirmed).
        The hot loop of routing: every block of every routed request passes here, hence the local names."""
        blocks, move_to_end, capacity, spec = self.blocks, self.blocks.move_to_end, self.capacity, self.speculative
        inserts = self.inserts
        for h in hashes:
            if h in blocks:
                move_to_end(h)
                if expiry is None:
                    spec.pop(h, None)
                elif h in spec and expiry > spec[h]:
                    spec[h] = expiry
            else:
                inserts += 1
                if expiry is not None:
                    spec[h] = expiry
                if len(blocks) >= capacity:
                    spec.pop(blocks.popitem(last=False)[0], None)
            blocks[h] = inserts
        self.inserts = inserts

    def drop(self, hashes: Iterable[int]) -> int:
        n = 0
        for h in hashes:
            if self.blocks.pop(h, None) is not None:
                self.speculative.pop(h, None)
                n += 1
        return n

    def shrink_to(self, capacity: int) -> None:
        self.capacity = capacity
        while len(self.blocks) > capacity:
            self.speculative.pop(self.blocks.popitem(last=False)[0], None)

    def map_engine(self, engine_hash: EngineHash, h: int) -> None:
        m = self.engine_to_kvgate
        m[engine_hash] = h
        m.move_to_end(engine_hash)
        if len(m) > 2 * self.capacity:
            m.popitem(last=False)

    def kvgate_hash(self, engine_hash: EngineHash) -> int | None:
        h = self.engine_to_kvgate.get(engine_hash)
        return self.offload_map.get(engine_hash) if h is None else h

    def offload(self, pairs: Iterable[tuple[EngineHash, int]]) -> int:
        """Store blocks in the second tier (refreshing those it holds), evicting its LRU past its bound."""
        tier, m, n = self.offloaded, self.offload_map, 0
        bound = max(_OFFLOAD_FACTOR * self.capacity, _OFFLOAD_MIN)
        for engine_hash, h in pairs:
            tier[h] = None
            tier.move_to_end(h)
            m[engine_hash] = h
            m.move_to_end(engine_hash)
            n += 1
        while len(tier) > bound:
            tier.popitem(last=False)
        while len(m) > bound:
            m.popitem(last=False)
        return n
