"""`ReplicaBlocks`: what the prefix index (cacheindex.kv_index) believes one replica's KV cache holds, in packed
arrays (cacheindex.block_table): no Python object per block, about 21 bytes per block of capacity, plus 12 for the
hot window's evicted blocks; a replica with KV events about 26 + 12 + 19 for its engine-hash map.

Tables (keys are kvgate's block hashes, salted; `q` below is an array of them, in use order):
- `blocks`: the blocks it is believed to hold, bounded by its capacity in blocks (vLLM's `num_gpu_blocks`, or the
  index's online estimate). Per block: `stamp`, the replica's count of new blocks at the block's last use (high
  44 bits) and a use counter (low 20): LRU order, and the LRU age (`inserts - stamp >> 20`: the new blocks taken
  since, which is what pushes a block out); `routed`, the hot-window epoch it was last routed in (16 bits, wrapping;
  an epoch is 1/64 of the window); `expiry` on a replica with KV events, centiseconds of the index's clock until
  which a block recorded at routing time counts without an event confirming it (0: confirmed). Past capacity the
  oldest go, in batches of capacity/64 (so it holds 98.4-100% of its capacity).
- `ghosts`: blocks routed within the window that have left `blocks` (evicted by the LRU, removed by an event): the
  rest of the hot footprint. Bounded by the capacity; the oldest epochs go first.
- `engine_map` (cacheindex.engine_maps): the engine's block hashes -> kvgate's (KV events name blocks by the
  engine's), bounded by the capacity (the engine holds no more); past it, entries whose block `blocks` no longer
  holds go.
- `tier` (cacheindex.engine_maps): the second tier's blocks and map (vLLM's KV offloading to CPU memory: KV
  events with `medium="CPU"`), bounded by `max(8 x capacity, 65,536)`; created on first use, like `engine_map`.
- the hot footprint's count: distinct blocks routed per epoch over the last 64 (a ring), moved between epochs as
  blocks are routed again, so `hot()` reads it in O(64).

Cost: an operation on n blocks is a few vectorized passes over n (O(n) in C); numpy's cost per call (about 1 us
here) makes that about 15 us for any n, so a prompt of at most `_SCALAR` blocks (and up to `_SCALAR_NEW` new
blocks of a longer one) goes one block at a time in Python instead (about 1 us a block), and a lookup stops at the
first block not held. Lookups of the same prompt are remembered until `blocks` changes (overlap, footprint, ages
and the insert of one request walk it once). The batched eviction is O(table) every capacity/64 new blocks, O(64)
amortized per new block.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from cacheindex.block_table import BlockTable, Keys, Slots
from cacheindex.engine_maps import EngineMap, OffloadTier

EPOCHS = 64  # the hot window in epochs
_WRAP = 0xFFFF
_USE_BITS = np.uint64(20)
_USE_MASK = (1 << 20) - 1
_SCALAR = 16  # up to this many blocks, lookups and inserts go one block at a time in Python (fewer numpy calls)
_SCALAR_NEW = 64  # and up to this many new blocks are placed one at a time


class ReplicaBlocks:
    def __init__(
        self, *, capacity: int, capacity_known: bool, precise: bool, bound: int, epoch: Callable[[], int]
    ) -> None:
        self._epoch = epoch  # the index's clock, in epochs of 1/64 of the hot window
        self.capacity = capacity
        self.capacity_known = capacity_known  # from the engine (num_gpu_blocks); else estimated from feedback
        self.precise = precise  # the replica publishes KV events: routed inserts are speculative and expire
        self.bound = bound  # the configured or default capacity: an estimate never exceeds it
        columns: dict[str, type[np.generic]] = {"stamp": np.uint64, "routed": np.uint16}
        if precise:
            columns["expiry"] = np.uint32
        self.blocks = BlockTable(bound, columns, order="stamp")
        self.ghosts = BlockTable(bound, {"routed": np.uint16}, order="routed")
        self.engine_map: EngineMap | None = None
        self.tier: OffloadTier | None = None
        self.inserts = 0  # new blocks taken so far (the LRU age clock)
        self.touches = 0
        self.age_estimate: float | None = None  # exponential mean of the LRU ages of blocks found evicted
        self.oldest_hit_age = 0  # the largest LRU age seen still cached (a floor under the estimate)
        self._hist = [0] * EPOCHS  # blocks counted in the footprint, per epoch (ring)
        self._hist_epoch = [-EPOCHS] * EPOCHS
        self._total_epoch = -1  # the epoch at which `_total` (the ring's sum over the window) is kept; -1: stale
        self._total = 0
        self._found: tuple[object, int, Slots, int] = (None, -1, np.empty(0, np.int64), 0)
        self._changes = 0  # changes to `blocks`
        self._first: tuple[object, int, bool] = (None, -1, False)
        self._found_scalar: tuple[object, int, list[int]] = (None, -1, [])

    def nbytes(self) -> int:
        tables = (self.blocks, self.ghosts, self.engine_map, self.tier)
        return sum(t.nbytes() for t in tables if t is not None)

    # --- lookup -----------------------------------------------------------------------------------------------
    def find(self, q: Keys) -> Slots:
        """`blocks`' slots of `q` (-1: absent), remembered for the same array until `blocks` changes."""
        return self._find(q)[0]

    def _find(self, q: Keys) -> tuple[Slots, int]:
        """(`find(q)`, the leading blocks held)."""
        memo_q, changes, slots, held = self._found
        if memo_q is not q or changes != self._changes:
            slots = self.blocks.find(q)
            missing = np.flatnonzero(slots < 0)
            held = int(missing[0]) if len(missing) else len(q)
            self._found = (q, self._changes, slots, held)
        return slots, held

    def _find_scalar(self, q: Keys, *, lead: bool = False) -> list[int]:
        """`find` for a few blocks, as a list, memoized alike; `lead`: only up to the first absent block (the
        list may be longer)."""
        memo_q, changes, slots = self._found_scalar
        if memo_q is not q or changes != self._changes:
            slots = []
            self._found_scalar = (q, self._changes, slots)
        if len(slots) < len(q) and not (lead and slots and slots[-1] < 0):
            find_one = self.blocks.find_one
            for k in q[len(slots) :].tolist():
                slots.append(find_one(k))
                if lead and slots[-1] < 0:
                    break
        return slots

    def _holds_first(self, q: Keys) -> bool:
        """Whether it holds `q`'s first block: most candidates of a request do not, told without arrays."""
        memo_q, changes, held = self._first
        if memo_q is not q or changes != self._changes:
            held = bool(len(q)) and self.blocks.find_one(int(q[0])) >= 0
            self._first = (q, self._changes, held)
        return held

    def held_run(self, q: Keys, now_cs: int) -> int:
        """The leading blocks of `q` it holds; a speculative block past its expiry ends the run."""
        if not self._holds_first(q):
            return 0
        if len(q) <= _SCALAR:
            expiry = self.blocks.cols.get("expiry")
            n = 0
            for slot in self._find_scalar(q, lead=True):
                if slot < 0 or (expiry is not None and 0 < int(expiry[slot]) < now_cs):
                    break
                n += 1
            return n
        slots, n = self._find(q)
        if n and "expiry" in self.blocks.cols:
            exp = self.blocks.cols["expiry"][slots[:n]]
            lapsed = np.flatnonzero((exp != 0) & (exp < now_cs))
            if len(lapsed):
                n = int(lapsed[0])
        return n

    def holds(self, key: int) -> bool:
        return self.blocks.find_one(key) >= 0

    def ages(self, q: Keys, n: int, limit: int) -> tuple[int, ...]:
        """LRU ages of `q`'s first n blocks; -1 for one absent or last used at insert count `limit` or later."""
        if len(q) <= _SCALAR:
            stamps = self.blocks.cols["stamp"]
            out = []
            for slot in self._find_scalar(q)[:n]:
                used = int(stamps[slot]) >> 20 if slot >= 0 else limit
                out.append(self.inserts - used if used < limit else -1)
            return tuple(out)
        slots = self.find(q)[:n]
        seq = (self.blocks.cols["stamp"][slots] >> _USE_BITS).astype(np.int64)
        ok = (slots >= 0) & (seq < limit)
        return tuple(np.where(ok, self.inserts - seq, -1).tolist())

    def hot_total(self, epoch: int) -> int:
        """Distinct blocks routed here within the window, capped at 2 x capacity, at `epoch` (now); O(1) within an
        epoch."""
        if self._total_epoch != epoch:
            self._total = sum(n for n, e in zip(self._hist, self._hist_epoch, strict=True) if epoch - e < EPOCHS)
            self._total_epoch = epoch
        return min(self._total, 2 * self.capacity)

    def hot(self, q: Keys, epoch: int) -> tuple[int, int]:
        """(`hot_total`; the leading blocks of `q` among them, held or not), at `epoch` (now)."""
        total = self.hot_total(epoch)
        if not len(q) or (not self._holds_first(q) and self.ghosts.find_one(int(q[0])) < 0):
            return total, 0
        if len(q) <= _SCALAR:
            return total, self._hot_run_scalar(q, epoch)
        slots, n = self._find(q)
        cold = np.flatnonzero((np.uint16(epoch & _WRAP) - self.blocks.cols["routed"][slots[:n]]) >= EPOCHS)
        if len(cold) or n == len(q) or not self.ghosts.count or self.ghosts.find_one(int(q[n])) < 0:
            return total, int(cold[0]) if len(cold) else n
        # the run goes on among the ghosts (the window's blocks the cache evicted) and what is held after them
        rest = slots[n:]
        routed = np.where(rest >= 0, self.blocks.cols["routed"][rest].astype(np.int64), -1)
        ghosts = self.ghosts.find(q[n:])
        routed = np.where(routed >= 0, routed, np.where(ghosts >= 0, self.ghosts.cols["routed"][ghosts], -1))
        cold = np.flatnonzero((routed < 0) | (((epoch - routed) & _WRAP) >= EPOCHS))
        return total, n + (int(cold[0]) if len(cold) else len(rest))

    def _hot_run_scalar(self, q: Keys, epoch: int) -> int:
        blocks, ghosts = self.blocks, self.ghosts
        run = 0
        lead = self._find_scalar(q, lead=True)
        for i, k in enumerate(q.tolist()):
            slot = lead[i] if i < len(lead) else blocks.find_one(k)
            if slot >= 0:
                routed = int(blocks.cols["routed"][slot])
            else:
                slot = ghosts.find_one(k)
                if slot < 0:
                    break
                routed = int(ghosts.cols["routed"][slot])
            if (epoch - routed) & _WRAP >= EPOCHS:
                break
            run += 1
        return run

    @staticmethod
    def _routed_of(table: BlockTable, slots: Slots) -> np.ndarray:
        return np.where(slots >= 0, table.cols["routed"][slots].astype(np.int64), -1)

    # --- change -----------------------------------------------------------------------------------------------
    def insert(self, q: Keys, *, expiry_cs: int | None, routed: bool) -> None:
        """Insert or refresh `q`'s blocks, evicting the oldest past capacity. `routed`: a prompt routed here now
        (it enters the hot window; its blocks are used tail first, so its head ends up most recent and a prefix
        loses its tail first, as vLLM frees a request's blocks); False: a KV event's blocks, in the order stored.
        `expiry_cs` None: confirmed; else speculative until then (a confirmed block stays confirmed)."""
        epoch = self._epoch() if routed else None
        if len(q) <= _SCALAR:
            keys, found = q.tolist(), self._find_scalar(q)
            if routed:
                keys, found = keys[::-1], found[::-1]
            self._changes += 1
            self._insert_scalar(keys[-self.capacity :], found[-self.capacity :], expiry_cs, epoch)
            return
        slots = self.find(q)
        if routed:
            q, slots = q[::-1], slots[::-1]
        if len(q) > self.capacity:  # the earlier ones would leave again within this insert
            q, slots = q[-self.capacity :], slots[-self.capacity :]
        self._changes += 1
        blocks = self.blocks
        new = slots < 0
        stamp = ((np.cumsum(new) + self.inserts) << 20) | (
            np.arange(self.touches + 1, self.touches + len(q) + 1) & _USE_MASK
        )
        self.touches += len(q)
        old = ~new
        hits = slots[old]
        blocks.cols["stamp"][hits] = stamp[old]
        if epoch is not None:
            self._count_routed(blocks.cols["routed"][hits], epoch)
            blocks.cols["routed"][hits] = epoch & _WRAP
        if "expiry" in blocks.cols:
            exp = blocks.cols["expiry"]
            exp[hits] = 0 if expiry_cs is None else np.where(exp[hits] == 0, 0, np.maximum(exp[hits], expiry_cs))
        n_new = len(q) - len(hits)
        if 0 < n_new <= _SCALAR_NEW:
            self._add_scalar(list(zip(q[new].tolist(), stamp[new].tolist(), strict=True)), len(hits), expiry_cs, epoch)
        elif n_new:
            self._add(q[new], stamp[new], len(hits), expiry_cs, epoch)

    def _add(self, q: Keys, stamp: np.ndarray, n_hits: int, expiry_cs: int | None, epoch: int | None) -> None:
        """Place new blocks (just used: `stamp`), evicting the oldest past capacity; the `n_hits` blocks refreshed
        with them are the newest and stay."""
        back = np.full(len(q), -1, np.int64)  # the routed epochs of new blocks coming back from the ghosts
        if self.ghosts.count:  # (out of the ghosts before the evicted go in: one entry per block)
            gslots = self.ghosts.find(q)
            back = self._routed_of(self.ghosts, gslots)
            self.ghosts.remove(np.unique(gslots[gslots >= 0]))
        self._make_room(len(q), n_hits)
        slots = self.blocks.place(q)
        cols = self.blocks.cols
        cols["stamp"][slots] = stamp
        if epoch is not None:
            self._count_routed(back, epoch)
            cols["routed"][slots] = epoch & _WRAP
        else:
            cols["routed"][slots] = np.where(back >= 0, back, (self._epoch() - EPOCHS) & _WRAP)
        if "expiry" in cols:
            cols["expiry"][slots] = 0 if expiry_cs is None else expiry_cs

    def _make_room(self, n_new: int, n_hits: int) -> None:
        self.inserts += n_new
        blocks = self.blocks
        if blocks.count + n_new > self.capacity:  # down to 1/64 under it, not the blocks just used (the newest)
            self._evict(min(blocks.count - n_hits, blocks.count + n_new - (self.capacity - self.capacity // 64)))

    def _insert_scalar(self, keys: list[int], slots: list[int], expiry_cs: int | None, epoch: int | None) -> None:
        """`insert` for a few blocks, one at a time in Python (cheaper than a dozen numpy calls)."""
        blocks = self.blocks
        stamps, routed, expiry = blocks.cols["stamp"], blocks.cols["routed"], blocks.cols.get("expiry")
        new: list[tuple[int, int]] = []  # (key, stamp)
        for k, slot in zip(keys, slots, strict=True):
            self.touches += 1
            stamp = ((self.inserts + len(new) + (slot < 0)) << 20) | (self.touches & _USE_MASK)
            if slot < 0:
                new.append((k, stamp))
                continue
            stamps[slot] = stamp
            if epoch is not None:
                self._route_one(int(routed[slot]), epoch)
                routed[slot] = epoch & _WRAP
            if expiry is not None:
                held = int(expiry[slot])
                expiry[slot] = 0 if expiry_cs is None or held == 0 else max(held, expiry_cs)
        if new:
            self._add_scalar(new, len(keys) - len(new), expiry_cs, epoch)

    def _add_scalar(self, new: list[tuple[int, int]], n_hits: int, expiry_cs: int | None, epoch: int | None) -> None:
        """`_add` for a few blocks, (key, stamp) each."""
        ghosts, blocks = self.ghosts, self.blocks
        back = []  # the routed epochs of new blocks coming back from the ghosts (-1: none)
        for k, _ in new:
            g = ghosts.find_one(k) if ghosts.count else -1
            back.append(int(ghosts.cols["routed"][g]) if g >= 0 else -1)
            if g >= 0:
                ghosts.remove_one(g)
        self._make_room(len(new), n_hits)
        cold = (self._epoch() - EPOCHS) & _WRAP
        for (k, stamp), previous in zip(new, back, strict=True):
            slot = blocks.place_one(k)
            cols = blocks.cols  # (placing may have grown the table: new arrays)
            cols["stamp"][slot] = stamp
            if epoch is not None:
                self._route_one(previous, epoch)
                cols["routed"][slot] = epoch & _WRAP
            else:
                cols["routed"][slot] = previous if previous >= 0 else cold
            if "expiry" in cols:
                cols["expiry"][slot] = 0 if expiry_cs is None else expiry_cs

    def _route_one(self, previous: int, epoch: int) -> None:
        """`_count_routed` for one block."""
        age = (epoch - previous) & _WRAP
        if previous < 0 or age >= EPOCHS:
            self._count(epoch, 1)
        elif age:
            self._uncount(epoch - age, 1, epoch)
            self._count(epoch, 1)

    def _count_routed(self, previous: np.ndarray, epoch: int) -> None:
        """Blocks routed in `epoch` whose previous routed epochs (-1: never) are `previous`: those counted in an
        earlier epoch of the window move to this one; the rest are counted anew."""
        ages = (epoch - previous.astype(np.int64)) & _WRAP
        counted_before = (previous >= 0) & (ages < EPOCHS)
        moving = counted_before & (ages > 0)
        if moving.any():
            moved = np.bincount(ages[moving], minlength=EPOCHS)
            for age in np.flatnonzero(moved).tolist():
                self._uncount(epoch - age, int(moved[age]), epoch)
        self._count(epoch, int((~counted_before | (ages > 0)).sum()))

    def _count(self, epoch: int, n: int) -> None:
        """n blocks join the footprint's count in `epoch` (now)."""
        i = epoch % EPOCHS
        if self._hist_epoch[i] != epoch:
            self._hist[i], self._hist_epoch[i] = 0, epoch
            self._total_epoch = -1
        self._hist[i] += n
        if self._total_epoch == epoch:
            self._total += n
        else:
            self._total_epoch = -1

    def _uncount(self, epoch: int, n: int, now: int) -> None:
        """n blocks leave the footprint's count of `epoch` (within the window at `now`)."""
        i = epoch % EPOCHS
        if self._hist_epoch[i] == epoch:
            n = min(n, self._hist[i])
            self._hist[i] -= n
            if self._total_epoch == now:
                self._total -= n
            else:
                self._total_epoch = -1

    def _evict(self, k: int) -> None:
        """Evict the `k` least recently used blocks."""
        if k > 0:
            occ = self.blocks.occupied()
            stamps = self.blocks.cols["stamp"][occ]
            self._leave(occ if k >= len(occ) else occ[np.argpartition(stamps, k - 1)[:k]])

    def _leave(self, slots: Slots) -> None:
        """`blocks` gives up these slots; those routed within the window become ghosts."""
        if not len(slots):
            return
        self._changes += 1
        routed = self.blocks.cols["routed"][slots]
        epoch = self._epoch()
        hot = ((epoch - routed.astype(np.int64)) & _WRAP) < EPOCHS
        keys = self.blocks.keys[slots]
        self.blocks.remove(slots)
        if hot.any():
            ghosts = self.ghosts
            gslots = ghosts.place(keys[hot])
            ghosts.cols["routed"][gslots] = routed[hot]
            over = ghosts.count - self.capacity
            if over > 0:  # the oldest go; among equals, as the keys fall (not by position: buckets stay even)
                occ = ghosts.occupied()
                ages = (epoch - ghosts.cols["routed"][occ].astype(np.int64)) & _WRAP
                order = (ages << 16) | (ghosts.keys[occ] & np.uint64(0xFFFF)).astype(np.int64)
                pick = np.argpartition(-order, over - 1)[:over]
                for age, n in zip(*np.unique(ages[pick], return_counts=True), strict=True):
                    if age < EPOCHS:
                        self._uncount(epoch - int(age), int(n), epoch)
                ghosts.remove(occ[pick])

    def drop(self, q: Keys) -> int:
        """Forget these blocks (an engine's removal event); returns how many were held."""
        slots = self.blocks.find(q)
        held = np.unique(slots[slots >= 0])
        self._leave(held)
        return len(held)

    def drop_older(self, cutoff: int) -> int:
        """Forget every block last used at insert count `cutoff` or before (an LRU evicted them)."""
        occ = self.blocks.occupied()
        old = occ[(self.blocks.cols["stamp"][occ] >> _USE_BITS) <= cutoff]
        self._leave(old)
        return len(old)

    def shrink_to(self, capacity: int) -> None:
        self.capacity = capacity
        self._evict(self.blocks.count - capacity)

    def clear(self) -> None:
        """The engine's cache is gone (restart, event gap): hold nothing; what was routed recently stays hot."""
        self._leave(self.blocks.occupied())
        self.blocks.clear()
        self.engine_map, self.tier = None, None

    # --- engine hashes (KV events) -----------------------------------------------------------------------------
    def map_engine(self, engine_keys: Keys, q: Keys) -> None:
        if self.engine_map is None:
            self.engine_map = EngineMap(self.bound)
        self.engine_map.put(engine_keys, q, self.blocks)

    def kvgate_key(self, engine_key: int) -> int | None:
        """The kvgate key of a block named by the engine, from the GPU's map or else the tier's."""
        for m in (self.engine_map, self.tier.engine_map if self.tier is not None else None):
            if m is not None and (key := m.get(engine_key)) is not None:
                return key
        return None

    def drop_engine(self, engine_keys: Keys) -> int:
        """Forget the GPU blocks these engine keys name (a removal event); returns how many were held."""
        return self.drop(self.engine_map.pop(engine_keys)) if self.engine_map is not None else 0

    def offload(self, engine_keys: Keys, q: Keys) -> int:
        """Store blocks in the second tier, created on first use."""
        if self.tier is None:
            self.tier = OffloadTier(self.capacity)
        return self.tier.store(engine_keys, q)
