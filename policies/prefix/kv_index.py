"""Per-replica index of the KV blocks each replica is believed to hold, keyed by kvgate's chained block hashes.

Structure: per replica an `OrderedDict[kvgate_hash, expiry]` in LRU order, bounded by the replica's capacity in
blocks (vLLM's `num_gpu_blocks`); inserting past capacity evicts the least recently used entry. `expiry` is
`inf` for confirmed entries (from KV events, or from routing when the replica publishes no events) and
`now + speculative_ttl_s` for speculative entries recorded at routing time on a replica that publishes events: if
its events do not confirm the blocks within the TTL, the entries stop counting (they are dropped lazily).

Two sources:
- approximate: `record_routed(replica, hashes)` when a request is sent there (the engine will cache its prompt);
- precise: KV events. vLLM's block hashes differ from kvgate's, so a `BlockStored` is re-hashed from its
  `token_ids` with kvgate's chain, starting at the kvgate hash of its `parent_block_hash` (looked up in a bounded
  per-replica map engine_hash -> kvgate_hash) or at the context seed for a root block. `BlockRemoved` carries only
  engine hashes; the same map translates them. A stored event whose parent is unknown (evicted from the map, or
  published before kvgate subscribed) cannot be placed in the chain and is skipped (counted by the caller).

LRU order: a routed prompt's blocks are inserted tail first, so its head is the most recently used and, under
capacity pressure, a prefix is forgotten from its end, as vLLM evicts (it frees a request's blocks tail first).

Complexity: `overlap` is O(blocks of the prompt) per replica and stops at the first miss (C-level iteration; the
per-block Python loop only runs when a speculative entry in the run may have expired); inserts, removals and
evictions are O(1) per block. Memory: at most `capacity` entries per replica in the index plus at most
`2 * capacity` entries in the engine-hash map.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import takewhile

from policies.prefix.hashing import chain_hashes

EngineHash = Hashable  # vLLM publishes int (low 64 bits) or bytes hashes

_CONFIRMED = math.inf


@dataclass(slots=True)
class _ReplicaBlocks:
    capacity: int
    precise: bool  # the replica publishes KV events: routed inserts are speculative and expire
    blocks: OrderedDict[int, float] = field(default_factory=OrderedDict)
    engine_to_kvgate: OrderedDict[EngineHash, int] = field(default_factory=OrderedDict)

    def insert_all(self, hashes: Iterable[int], expiry: float) -> None:
        """Insert or refresh each block in turn (the last one ends up most recent), evicting past capacity.
        The hot loop of routing: every block of every routed request passes here, hence the local names."""
        blocks, move_to_end, capacity = self.blocks, self.blocks.move_to_end, self.capacity
        for h in hashes:
            old = blocks.get(h)
            if old is not None:
                move_to_end(h)
                if expiry > old:
                    blocks[h] = expiry
            else:
                blocks[h] = expiry
                if len(blocks) > capacity:
                    blocks.popitem(last=False)

    def map_engine(self, engine_hash: EngineHash, h: int) -> None:
        m = self.engine_to_kvgate
        m[engine_hash] = h
        m.move_to_end(engine_hash)
        if len(m) > 2 * self.capacity:
            m.popitem(last=False)


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """A `BlockStored` event, decoded: the engine's hashes of the stored blocks, the engine hash of the block before
    the first one (None for a root block), the token ids of all stored blocks and the block size."""

    block_hashes: Sequence[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: Sequence[int]
    block_size: int


class KvIndex:
    def __init__(self, *, speculative_ttl_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        self._ttl = speculative_ttl_s if speculative_ttl_s and speculative_ttl_s > 0 else None
        self._clock = clock
        self._replicas: dict[str, _ReplicaBlocks] = {}

    # --- membership -------------------------------------------------------------------------------------------
    def add_replica(self, replica_id: str, *, capacity_blocks: int, precise: bool = False) -> None:
        """Register (or re-register, emptied) a replica with room for `capacity_blocks` blocks."""
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self._replicas[replica_id] = _ReplicaBlocks(capacity=capacity_blocks, precise=precise)

    def remove_replica(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    def clear(self, replica_id: str) -> None:
        """Forget everything known about a replica's cache (engine restart, event gap, AllBlocksCleared)."""
        r = self._replicas.get(replica_id)
        if r is not None:
            r.blocks.clear()
            r.engine_to_kvgate.clear()

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._replicas

    # --- sizes (metrics) --------------------------------------------------------------------------------------
    def size(self) -> int:
        return sum(len(r.blocks) for r in self._replicas.values())

    def sizes(self) -> dict[str, int]:
        return {rid: len(r.blocks) for rid, r in self._replicas.items()}

    def replica_size(self, replica_id: str) -> int:
        r = self._replicas.get(replica_id)
        return len(r.blocks) if r is not None else 0

    # --- lookup -----------------------------------------------------------------------------------------------
    def overlap(self, hashes: Sequence[int], replica_ids: Iterable[str]) -> dict[str, int]:
        """Per replica, the number of leading blocks of `hashes` it is believed to hold (0 for unknown replicas).
        Read-only: a lookup does not refresh LRU order (only routing there does)."""
        now = self._clock()
        out: dict[str, int] = {}
        for rid in replica_ids:
            r = self._replicas.get(rid)
            if r is None:
                out[rid] = 0
                continue
            blocks = r.blocks
            # the leading run of present blocks, counted in C (takewhile), then the expiry check in C (min) only
            # when that run holds a speculative entry that may have lapsed; the Python loop is the rare fallback.
            # A replica without KV events only ever holds confirmed entries: no expiry check at all.
            n = len(list(takewhile(blocks.__contains__, hashes)))
            if n and r.precise and min(map(blocks.__getitem__, hashes[:n])) < now:
                n = 0
                for h in hashes:
                    expiry = blocks.get(h)
                    if expiry is None or expiry < now:
                        break
                    n += 1
            out[rid] = n
        return out

    # --- approximate source -----------------------------------------------------------------------------------
    def record_routed(self, replica_id: str, hashes: Sequence[int]) -> None:
        """A request with these prompt blocks was sent to the replica: it will hold them. Speculative (expiring)
        when the replica publishes KV events and a TTL is configured, confirmed otherwise."""
        r = self._replicas.get(replica_id)
        if r is None:
            return
        expiry = self._clock() + self._ttl if (r.precise and self._ttl is not None) else _CONFIRMED
        r.insert_all(reversed(hashes), expiry)  # the head ends up most recent: a prefix loses its tail first

    # --- precise source (KV events) ---------------------------------------------------------------------------
    def apply_stored(self, replica_id: str, event: StoredBlocks, root_seed: int) -> int:
        """Apply a BlockStored event; `root_seed` is the context seed for a root block (no parent). Returns the
        number of blocks inserted, or -1 when the parent is unknown and the event was skipped."""
        r = self._replicas.get(replica_id)
        if r is None:
            return 0
        if event.parent_block_hash is None:
            parent = root_seed
        else:
            found = r.engine_to_kvgate.get(event.parent_block_hash)
            if found is None:
                return -1
            parent = found
        ours = chain_hashes(event.token_ids, event.block_size, parent)
        n = min(len(event.block_hashes), len(ours))
        for engine_hash, h in zip(event.block_hashes, ours[:n], strict=False):
            r.map_engine(engine_hash, h)
        r.insert_all(ours[:n], _CONFIRMED)
        return n

    def apply_removed(self, replica_id: str, engine_hashes: Iterable[EngineHash]) -> int:
        """Apply a BlockRemoved event. Returns the number of blocks removed from the index."""
        r = self._replicas.get(replica_id)
        if r is None:
            return 0
        n = 0
        for engine_hash in engine_hashes:
            h = r.engine_to_kvgate.pop(engine_hash, None)
            if h is not None and r.blocks.pop(h, None) is not None:
                n += 1
        return n
