"""Per-replica index of the KV blocks each replica is believed to hold, keyed by kvgate's chained block hashes.

Per replica, a `ReplicaBlocks` (cacheindex.replica_blocks, packed arrays: about 21 bytes per block of capacity, 33
with the hot window, about 57 with KV events' expiries and engine-hash map): the LRU of the blocks it is believed to
hold, bounded by its capacity in blocks (vLLM's `num_gpu_blocks`, or the online estimate below), with each block's
insert count (its LRU age) and, on a replica that publishes KV events, the expiry of a block recorded at routing
time (unconfirmed within `speculative_ttl_s`, it stops counting); the blocks routed there within `hot_window_s` (its
hot footprint, which placement weighs against capacity); the blocks its second tier holds (vLLM's KV offloading to
CPU memory: KV events with `medium="CPU"`). Only KV events fill the tier. vLLM looks a prompt up on the GPU first
and asks the tier for the blocks after the GPU's leading run, so `offloaded(...)` counts the blocks after that run
that the tier holds: they are loaded, not recomputed.

Sources:
- approximate: `record_routed(replica, hashes)` when a request is sent there (the engine will cache its prompt);
- precise: KV events. vLLM's block hashes differ from kvgate's, so a `BlockStored` is re-hashed from its
  `token_ids` with kvgate's chain, starting at the kvgate hash of its `parent_block_hash` (looked up in a bounded
  per-replica map engine_hash -> kvgate_hash, either tier's) or at the context seed for a root block.
  `BlockRemoved` carries only engine hashes; the same map translates them. A tier store without token ids (vLLM's
  offloading events unless `self_describing_kv_events`) names blocks the GPU stored first: translated by the maps.
  A stored event whose parent is unknown (evicted from the map, or published before kvgate subscribed) cannot be
  placed in the chain and is skipped (counted by the caller).
- feedback: `observe(...)` with the engine's reported `cached_tokens` of a finished request. Blocks kvgate believed
  cached beyond what the engine reports are dropped (the engine evicted them). When the replica's capacity is not
  known, the LRU age of the first missing block (at routing time) is a sample of that capacity: an LRU of C blocks
  evicts a block once C new blocks came after it. The estimate is an exponential mean of those samples, never
  below the largest age seen still cached; the index's bound follows it.

LRU order: a routed prompt's blocks are inserted tail first, so its head is the most recently used and, under
capacity pressure, a prefix is forgotten from its end, as vLLM evicts (it frees a request's blocks tail first).

First blocks: `roots` maps the first block of every prompt routed or stored (a KV event's root block) to the
replicas it was recorded on, an LRU of `_MAX_ROOTS` hints validated when read: `holders(h)` answers "which replicas
hold this prompt's first block" in O(replicas listed), independent of the pool, so a router over a large pool can
weigh only those (and a sample of the rest) instead of every replica.

Complexity: a prompt's blocks become one array of keys once per request (kept for the calls about the same
prompt); `overlap`, `footprint`, `offloaded`, `record_routed` are a few vectorized passes over the prompt's blocks
per replica (O(prompt blocks) in C, no per-block Python loop); KV events O(their blocks); evictions are batched,
O(64) amortized per new block. Memory: packed arrays bounded by each replica's capacity (see above), the tier's
bound for the tier, and `_MAX_ROOTS` first-block hints for the index.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cacheindex.block_table import SALT, Keys, engine_key
from cacheindex.hashing import chain_hashes
from cacheindex.replica_blocks import EPOCHS, ReplicaBlocks
from policies.base import Footprint

EngineHash = Hashable  # vLLM publishes int (low 64 bits) or bytes hashes


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """A `BlockStored` event, decoded: the engine's hashes of the stored blocks, the engine hash of the block before
    the first one (None for a root block), the token ids of all stored blocks and the block size."""

    block_hashes: Sequence[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: Sequence[int]
    block_size: int


# The weight of each new sample in the capacity estimate, and the fewest blocks an estimate may shrink an index to.
_ESTIMATE_WEIGHT = 0.2
_MIN_CAPACITY = 16
# LRU ages remembered per routed request (its first blocks): enough to place any miss in the first 256 blocks.
_MAX_AGES = 256
_MAX_ROOTS = 262_144  # first blocks remembered (hints of which replicas hold them)
_MASK = (1 << 64) - 1
_FEW = 32  # up to this many blocks, a prompt's keys are computed in Python (fewer numpy calls)


class KvIndex:
    def __init__(
        self,
        *,
        speculative_ttl_s: float | None = None,
        hot_window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._ttl = speculative_ttl_s if speculative_ttl_s and speculative_ttl_s > 0 else None
        self._epoch_s = hot_window_s / EPOCHS
        self._clock = clock
        self._t0 = clock()
        self._replicas: dict[str, ReplicaBlocks] = {}
        self._roots: OrderedDict[int, set[str]] = OrderedDict()
        self._keys: tuple[Sequence[int] | None, Keys] = (None, np.empty(0, np.uint64))
        self.version = 0  # counts changes to what the replicas hold: an overlap computed at one version stays true

    def _query(self, hashes: Sequence[int]) -> Keys:
        """The prompt's blocks as table keys, converted once for the calls about the same prompt."""
        seen, keys = self._keys
        if seen is not hashes or not isinstance(hashes, tuple):  # a list may change in place
            if len(hashes) <= _FEW:
                keys = np.array([((h ^ SALT) & _MASK) or 1 for h in hashes], np.uint64)  # 0: empty slot
            else:
                keys = np.maximum(np.fromiter(hashes, np.uint64, len(hashes)) ^ np.uint64(SALT), 1)
            self._keys = (hashes, keys)
        return keys

    def _epoch(self) -> int:
        return int((self._clock() - self._t0) / self._epoch_s)

    def _centis(self, t: float) -> int:
        """A time of the clock in centiseconds since the index began, at least 1 (0 marks a confirmed block)."""
        return int((t - self._t0) * 100) + 1

    # --- membership -------------------------------------------------------------------------------------------
    def add_replica(
        self, replica_id: str, *, capacity_blocks: int, precise: bool = False, capacity_known: bool = True
    ) -> None:
        """Register (or re-register, emptied) a replica with room for `capacity_blocks` blocks; with
        `capacity_known=False` that is a starting bound the index lowers from feedback (`observe`)."""
        self.version += 1
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self._replicas[replica_id] = ReplicaBlocks(
            capacity=capacity_blocks,
            capacity_known=capacity_known,
            precise=precise,
            bound=capacity_blocks,
            epoch=self._epoch,
        )

    def remove_replica(self, replica_id: str) -> None:
        self.version += 1
        self._replicas.pop(replica_id, None)

    def clear(self, replica_id: str) -> None:
        """Forget everything known about a replica's cache (engine restart, event gap, AllBlocksCleared)."""
        self.version += 1
        r = self._replicas.get(replica_id)
        if r is not None:
            r.clear()

    def _note_root(self, h: int, replica_id: str) -> None:
        roots = self._roots
        found = roots.get(h)
        if found is None:
            found = roots[h] = set()
            if len(roots) > _MAX_ROOTS:
                roots.popitem(last=False)
        else:
            roots.move_to_end(h)
        found.add(replica_id)

    def holders(self, first_block: int) -> list[str]:
        """The replicas that hold `first_block` now (confirmed or speculative), from the hints; stale hints (the
        block was evicted, the replica left) are dropped as they are found."""
        found = self._roots.get(first_block)
        if not found:
            return []
        key = ((first_block ^ SALT) & _MASK) or 1
        live = [rid for rid in found if (r := self._replicas.get(rid)) is not None and r.holds(key)]
        if len(live) < len(found):
            found.intersection_update(live)
        return live

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._replicas

    # --- sizes (metrics) --------------------------------------------------------------------------------------
    def size(self) -> int:
        return sum(r.blocks.count for r in self._replicas.values())

    def sizes(self) -> dict[str, int]:
        return {rid: r.blocks.count for rid, r in self._replicas.items()}

    def offloaded_sizes(self) -> dict[str, int]:
        return {rid: r.tier.size for rid, r in self._replicas.items() if r.tier is not None and r.tier.size}

    def replica_size(self, replica_id: str) -> int:
        r = self._replicas.get(replica_id)
        return r.blocks.count if r is not None else 0

    def capacities(self) -> dict[str, tuple[int, bool]]:
        """Per replica, the index's bound in blocks and whether it came from the engine (False: estimated)."""
        return {rid: (r.capacity, r.capacity_known) for rid, r in self._replicas.items()}

    def nbytes(self) -> int:
        """The bytes of the replicas' packed tables (the first-block hints aside)."""
        return sum(r.nbytes() for r in self._replicas.values())

    # --- lookup -----------------------------------------------------------------------------------------------
    def overlap(self, hashes: Sequence[int], replica_ids: Iterable[str]) -> dict[str, int]:
        """Per replica, the number of leading blocks of `hashes` it is believed to hold (0 for unknown replicas).
        Read-only: a lookup does not refresh LRU order (only routing there does)."""
        q = self._query(hashes)
        now = self._centis(self._clock())
        out: dict[str, int] = {}
        for rid in replica_ids:
            r = self._replicas.get(rid)
            out[rid] = r.held_run(q, now) if r is not None else 0
        return out

    def offloaded(self, hashes: Sequence[int], overlap: Mapping[str, int]) -> dict[str, int]:
        """Per replica of `overlap` (its GPU overlap, from `overlap`) whose second tier holds blocks, the number of
        blocks after its GPU run that the tier holds (absent: none)."""
        out: dict[str, int] = {}
        for rid, n in overlap.items():
            r = self._replicas.get(rid)
            if r is not None and r.tier is not None and r.tier.size:
                k = r.tier.run(self._query(hashes)[n:])
                if k:
                    out[rid] = k
        return out

    def footprint(self, hashes: Sequence[int], replica_ids: Iterable[str]) -> dict[str, Footprint]:
        """Per replica, the distinct blocks routed there within the hot window, its capacity, and the leading blocks
        of `hashes` among them."""
        q, epoch = self._query(hashes), self._epoch()
        out: dict[str, Footprint] = {}
        for rid in replica_ids:
            r = self._replicas.get(rid)
            if r is not None:
                hot, run = r.hot(q, epoch)
                out[rid] = Footprint(hot, r.capacity, run)
        return out

    def room(self, replica_ids: Iterable[str]) -> dict[str, int]:
        """Per replica, its capacity less the distinct blocks routed there within the hot window (0 when full or
        past it); O(1) a replica."""
        epoch = self._epoch()
        out: dict[str, int] = {}
        for rid in replica_ids:
            r = self._replicas.get(rid)
            if r is not None:
                out[rid] = max(0, r.capacity - r.hot_total(epoch))
        return out

    def ages(self, replica_id: str, hashes: Sequence[int], n: int, settled_before: int | None) -> tuple[int, ...]:
        """The LRU ages (new blocks taken since) of the first min(n, 256) of `hashes` on the replica, -1 for a
        block whose last use is not settled: used at insert count `settled_before` or later, by a request that may
        still be in prefill (the engine may not hold it yet, so missing it is no eviction); `settled_before` None:
        every block is settled. Empty on a replica with KV events (they keep its entries exact)."""
        r = self._replicas.get(replica_id)
        if r is None or r.precise or n <= 0:
            return ()
        limit = r.inserts + 1 if settled_before is None else settled_before
        return r.ages(self._query(hashes), min(n, _MAX_AGES), limit)

    def inserts(self, replica_id: str) -> int:
        r = self._replicas.get(replica_id)
        return r.inserts if r is not None else 0

    # --- approximate source -----------------------------------------------------------------------------------
    def record_routed(self, replica_id: str, hashes: Sequence[int]) -> None:
        """A request with these prompt blocks was sent to the replica: it will hold them. Speculative (expiring)
        when the replica publishes KV events and a TTL is configured, confirmed otherwise."""
        self.version += 1
        r = self._replicas.get(replica_id)
        if r is None or not hashes:
            return
        expiry = self._centis(self._clock() + self._ttl) if (r.precise and self._ttl is not None) else None
        r.insert(self._query(hashes), expiry_cs=expiry, routed=True)
        self._note_root(hashes[0], replica_id)

    # --- feedback ---------------------------------------------------------------------------------------------
    def observe(self, replica_id: str, predicted: int, reported: int, ages: Sequence[int], inserts_at: int) -> int:
        """A request routed with `predicted` leading blocks believed cached (their LRU ages at routing time in
        `ages`, from `ages()`, when the replica's insert count was `inserts_at`) finished with `reported` blocks
        cached by the engine. On a replica without KV events, a settled block found missing was evicted, and so
        was everything last used before it in an LRU: those entries are dropped, and where the capacity is not
        known the age is a sample of it (a block seen cached at some age is a floor). Returns the number of
        entries dropped."""
        self.version += 1
        r = self._replicas.get(replica_id)
        if r is None or r.precise:
            return 0
        if 0 < reported <= len(ages) and ages[reported - 1] >= 0:
            r.oldest_hit_age = max(r.oldest_hit_age, ages[reported - 1])
        if not reported < predicted or reported >= len(ages) or ages[reported] < 0:
            return 0
        age = ages[reported]
        if age < r.oldest_hit_age:
            return 0  # an LRU keeps every block younger than one it kept: not an eviction (a race)
        if not r.capacity_known:
            prev = r.age_estimate
            r.age_estimate = age if prev is None else prev + _ESTIMATE_WEIGHT * (age - prev)
            r.capacity = max(int(r.age_estimate), r.oldest_hit_age + 1, _MIN_CAPACITY)
        before = r.blocks.count
        r.drop_older(inserts_at - age)  # the missing block's last use, and everything used before it
        r.shrink_to(min(r.capacity, r.bound))
        return before - r.blocks.count

    # --- precise source (KV events) ---------------------------------------------------------------------------
    def apply_stored(self, replica_id: str, event: StoredBlocks, root_seed: int, *, offloaded: bool = False) -> int:
        """Apply a BlockStored event, of the GPU or (`offloaded`) of the second tier; `root_seed` is the context
        seed for a root block (no parent). Returns the number of blocks inserted, or -1 when the event could not
        be placed in the chain (unknown parent; a tier store without token ids naming blocks never seen)."""
        self.version += 1
        r = self._replicas.get(replica_id)
        if r is None:
            return 0
        pairs = self._translate(r, event, root_seed)
        if pairs is None:
            return -1
        if not pairs:
            return 0
        engine = np.fromiter((e for e, _ in pairs), np.uint64, len(pairs))
        q = np.fromiter((k for _, k in pairs), np.uint64, len(pairs))
        if offloaded:
            return r.offload(engine, q)
        r.map_engine(engine, q)
        r.insert(q, expiry_cs=None, routed=False)
        if event.parent_block_hash is None:
            self._note_root(pairs[0][1] ^ SALT, replica_id)
        return len(pairs)

    @staticmethod
    def _translate(r: ReplicaBlocks, event: StoredBlocks, root_seed: int) -> list[tuple[int, int]] | None:
        """(engine key, kvgate key) of each stored block: re-hashed from the token ids in kvgate's chain, or,
        without them, the keys the maps already hold."""
        engine = [engine_key(e) for e in event.block_hashes]
        if not event.token_ids:
            known = [(e, k) for e in engine if (k := r.kvgate_key(e)) is not None]
            return known if known else None
        if event.parent_block_hash is None:
            parent = root_seed
        else:
            found_parent = r.kvgate_key(engine_key(event.parent_block_hash))
            if found_parent is None:
                return None
            parent = found_parent ^ SALT
        ours = chain_hashes(event.token_ids, event.block_size, parent)
        return [(e, ((h ^ SALT) & _MASK) or 1) for e, h in zip(engine, ours, strict=False)]

    def apply_removed(self, replica_id: str, engine_hashes: Iterable[EngineHash], *, offloaded: bool = False) -> int:
        """Apply a BlockRemoved event of the GPU or (`offloaded`) of the second tier. Returns the number of
        blocks removed from the index."""
        self.version += 1
        r = self._replicas.get(replica_id)
        if r is None:
            return 0
        keys = [engine_key(e) for e in engine_hashes]
        engine = np.fromiter(keys, np.uint64, len(keys))
        if offloaded:
            return r.tier.drop(engine) if r.tier is not None else 0
        return r.drop_engine(engine)
