"""What a replica's KV events name by the engine's block hashes: the map from them to kvgate's keys, and the second
tier (vLLM's KV offloading to CPU memory: KV events with `medium="CPU"`), for `cacheindex.replica_blocks`.

- `EngineMap`: engine key -> kvgate key in a `BlockTable`, bounded (the engine holds no more blocks than its
  capacity); past the bound, entries whose block the holder table no longer holds go, then the rest as their keys
  fall (not by slot position: buckets stay even).
- `OffloadTier`: the blocks the second tier holds (an LRU by a use counter, bounded by `max(8 x capacity, 65,536)`)
  and its own `EngineMap`.

Cost: O(n) vectorized passes for n blocks; the bound's trim is O(table) when it is passed.
"""

from __future__ import annotations

import numpy as np

from cacheindex.block_table import BlockTable, Keys

_OFFLOAD_FACTOR = 8
_OFFLOAD_MIN = 65_536


class EngineMap:
    def __init__(self, bound: int) -> None:
        self.table = BlockTable(bound, {"value": np.uint64})

    def nbytes(self) -> int:
        return self.table.nbytes()

    def put(self, engine_keys: Keys, q: Keys, holder: BlockTable) -> None:
        """Map engine keys to kvgate keys `q`; past the bound, entries whose block `holder` no longer holds go."""
        m = self.table
        slots = m.find(engine_keys)
        new = slots < 0
        if new.any():
            slots[new] = m.place(engine_keys[new])
        m.cols["value"][slots] = q
        if m.count > m.max_entries:
            occ = m.occupied()
            stale = occ[holder.find(m.cols["value"][occ]) < 0]
            excess = m.count - m.max_entries
            if len(stale) > excess:  # as the keys fall, not by position (buckets stay even)
                stale = stale[np.argpartition(m.keys[stale], excess - 1)[:excess]]
            m.remove(stale)

    def get(self, engine_key: int) -> int | None:
        slot = self.table.find_one(engine_key)
        return int(self.table.cols["value"][slot]) if slot >= 0 else None

    def pop(self, engine_keys: Keys) -> Keys:
        """Remove engine keys; returns the kvgate keys they named."""
        m = self.table
        slots = np.unique(m.find(engine_keys))
        slots = slots[slots >= 0]
        values = m.cols["value"][slots].copy()
        m.remove(slots)
        return values


class OffloadTier:
    def __init__(self, capacity: int) -> None:
        bound = max(_OFFLOAD_FACTOR * capacity, _OFFLOAD_MIN)
        self.blocks = BlockTable(bound, {"stamp": np.uint64}, order="stamp")
        self.engine_map = EngineMap(bound)
        self.touches = 0

    def nbytes(self) -> int:
        return self.blocks.nbytes() + self.engine_map.nbytes()

    @property
    def size(self) -> int:
        return self.blocks.count

    def store(self, engine_keys: Keys, q: Keys) -> int:
        """Store blocks (refreshing those it holds), evicting its LRU past its bound."""
        tier = self.blocks
        slots = tier.find(q)
        new = slots < 0
        if new.any():
            slots[new] = tier.place(q[new])
        tier.cols["stamp"][slots] = self.touches + np.arange(1, len(q) + 1, dtype=np.uint64)
        self.touches += len(q)
        over = tier.count - tier.max_entries
        if over > 0:
            occ = tier.occupied()
            tier.remove(occ[np.argpartition(tier.cols["stamp"][occ], over - 1)[:over]])
        self.engine_map.put(engine_keys, q, tier)
        return len(q)

    def run(self, q: Keys) -> int:
        """The leading blocks of `q` it holds."""
        if not self.blocks.count:
            return 0
        missing = np.flatnonzero(self.blocks.find(q) < 0)
        return int(missing[0]) if len(missing) else len(q)

    def drop(self, engine_keys: Keys) -> int:
        """Forget the blocks these engine keys name (a removal event); returns how many it held."""
        slots = np.unique(self.blocks.find(self.engine_map.pop(engine_keys)))
        slots = slots[slots >= 0]
        self.blocks.remove(slots)
        return len(slots)
