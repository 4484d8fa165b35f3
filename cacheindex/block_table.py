"""`BlockTable`: a set of 64-bit keys in packed arrays (no Python object per entry), with per-entry columns.

Layout: `buckets` rows of `WAYS` (8) slots, flat. A key lives in one of two buckets (two-choice hashing: b1 from its
low bits, b2 from a multiplicative mix of it; an insert takes the emptier one, and a key whose two buckets are full
moves an entry of theirs to its other bucket: one cuckoo step), which keeps buckets from overflowing up to `LOAD`
(85%) of the slots. Columns: `keys` (uint64; `EMPTY` = 0: a caller stores `hash ^ SALT`, or 1 where that is 0, so
the salt shares a key with the salt ^ 1, a collision as likely as any two 64-bit hashes'), `fill` (uint8 per
bucket) and the owner's columns (one array per name, any dtype, one value per slot; a new entry's values are the
owner's to set).

Cost: `find` of n keys is one gather of both buckets' 16 slots a key and one comparison, in C; `place` of n new keys a
gather and a sort by bucket; `remove` O(n); `find_one` (a single key, from Python) O(16); up to 12 keys go one at a
time (fewer numpy calls). The table grows by doubling (a rehash, O(entries)) up to `max_entries / LOAD` slots (plus
two buckets), its last step exactly to that size, so a full table holds about (8 + the columns' bytes) / 0.85 bytes
per entry. A key that finds both buckets full and no entry to move (rare below LOAD) takes the slot of the entry in
them with the smallest `order` column value (the owner's LRU stamp), or the first slot of its first bucket without
one: that entry is forgotten.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

WAYS = 8
LOAD = 0.85
EMPTY = 0
SALT = 0x9E3779B97F4A7C15
_MIX_INT = 0xBF58476D1CE4E5B9
_MIX = np.uint64(_MIX_INT)
_HALF = np.uint64(32)
_MASK = (1 << 64) - 1
_MIN_ENTRIES = 256
_CHUNK = 2048  # keys per pass of a large `find`
_SMALL = 12  # up to this many keys, `find` and `place` go one key at a time (fewer numpy calls)

Keys = npt.NDArray[np.uint64]
Slots = npt.NDArray[np.int64]


def engine_key(engine_hash: Hashable) -> int:
    """An engine's block hash (vLLM publishes an int, its low 64 bits, or bytes) as a table key."""
    if isinstance(engine_hash, int):
        k = engine_hash & _MASK
    else:
        raw = engine_hash if isinstance(engine_hash, bytes) else repr(engine_hash).encode()
        k = xxhash.xxh3_64_intdigest(raw)
    return ((k ^ SALT) & _MASK) or 1  # 0 marks an empty slot


class BlockTable:
    def __init__(self, max_entries: int, columns: Mapping[str, type[np.generic]], order: str | None = None):
        self.max_entries = max_entries
        self.count = 0
        self._moved = False  # an entry moved to its other bucket during the current `place`
        self._dtypes = dict(columns)
        self._order = order
        self._max_buckets = self._buckets_for(max_entries)
        self._allocate(self._buckets_for(min(max_entries, _MIN_ENTRIES)))

    @staticmethod
    def _buckets_for(entries: int) -> int:
        return -(-int(entries / LOAD) // WAYS) + 2  # two more: a small table's buckets vary the most

    def _allocate(self, buckets: int) -> None:
        self.buckets = buckets
        self._nb = np.uint64(buckets)
        self.keys: Keys = np.zeros(buckets * WAYS, np.uint64)
        self.fill = np.zeros(buckets, np.uint8)
        self.cols: dict[str, npt.NDArray[Any]] = {n: np.zeros(buckets * WAYS, t) for n, t in self._dtypes.items()}

    def nbytes(self) -> int:
        return self.keys.nbytes + self.fill.nbytes + sum(c.nbytes for c in self.cols.values())

    def clear(self) -> None:
        self.count = 0
        self._allocate(self._buckets_for(min(self.max_entries, _MIN_ENTRIES)))

    # --- lookup ---------------------------------------------------------------------------------------------------
    def _pair(self, q: Keys) -> tuple[Slots, Slots]:
        return (q % self._nb).astype(np.int64), (((q * _MIX) >> _HALF) % self._nb).astype(np.int64)

    def _pair_one(self, key: int) -> tuple[int, int]:
        return key % self.buckets, (((key * _MIX_INT) & _MASK) >> 32) % self.buckets

    def find(self, q: Keys) -> Slots:
        """The slot of each key, -1 where absent (a few keys: one at a time, cheaper than building arrays; many: in
        chunks, so the temporaries stay in the CPU's cache)."""
        if not len(q) or not self.count:
            return np.full(len(q), -1, np.int64)
        if len(q) <= _SMALL:
            return np.array([self.find_one(k) for k in q.tolist()], np.int64)
        if len(q) <= _CHUNK:
            return self._find(q)
        return np.concatenate([self._find(q[i : i + _CHUNK]) for i in range(0, len(q), _CHUNK)])

    def _find(self, q: Keys) -> Slots:
        """Both buckets of every key gathered at once, 16 candidates a key: the first equal one is the slot."""
        n = len(q)
        b = np.empty((n, 2), np.uint64)
        np.remainder(q, self._nb, out=b[:, 0])
        np.remainder((q * _MIX) >> _HALF, self._nb, out=b[:, 1])
        buckets = b.view(np.int64)  # (values below 2^63: the same bits)
        eq = (np.take(self.keys.reshape(-1, WAYS), buckets, axis=0) == q[:, None, None]).reshape(n, 2 * WAYS)
        pos = eq.argmax(axis=1)
        slots = np.where(pos < WAYS, buckets[:, 0], buckets[:, 1]) * WAYS + (pos & (WAYS - 1))
        return np.where(eq[np.arange(n), pos], slots, -1)

    def find_one(self, key: int) -> int:
        """The slot of one stored key (a Python int), -1 where absent; no array is built."""
        if not self.count:
            return -1
        keys, nb = self.keys, self.buckets
        b = key % nb * WAYS
        row = keys[b : b + WAYS].tolist()
        if key in row:
            return b + row.index(key)
        b = (((key * _MIX_INT) & _MASK) >> 32) % nb * WAYS
        row = keys[b : b + WAYS].tolist()
        return b + row.index(key) if key in row else -1

    def occupied(self) -> Slots:
        return np.flatnonzero(self.keys != EMPTY)

    # --- change ---------------------------------------------------------------------------------------------------
    def remove_one(self, slot: int) -> None:
        self.keys[slot] = EMPTY
        self.fill[slot // WAYS] -= 1
        self.count -= 1

    def place_one(self, key: int) -> int:
        """Insert one absent key (a Python int); returns its slot. An earlier slot may move (a cuckoo step moves
        an entry with its columns; growth moves them all): look keys up again after placing."""
        if self.count + 1 > self.buckets * WAYS * LOAD and self.buckets < self._max_buckets:
            self._grow(self.count + 1)
        return self._place_one(key)

    def remove(self, slots: Slots) -> None:
        """Empty these (occupied, distinct) slots."""
        if len(slots):
            self.keys[slots] = EMPTY
            np.subtract.at(self.fill, slots // WAYS, 1)
            self.count -= len(slots)

    def place(self, q: Keys) -> Slots:
        """Insert keys that are absent (duplicates among them share a slot); returns their slots, aligned to `q`.
        Many keys: each goes to the emptier of its buckets (a tie by a bit of the key), those that do not fit
        there to the other, the few left one at a time."""
        if self.count + len(q) > self.buckets * WAYS * LOAD and self.buckets < self._max_buckets:
            self._grow(self.count + len(q))
        self._moved = False
        if len(q) <= _SMALL:
            placed: dict[int, int] = {}
            slots = np.array(
                [placed[k] if k in placed else placed.setdefault(k, self._place_one(k)) for k in q.tolist()], np.int64
            )
            return self.find(q) if self._moved else slots
        unique, inverse = np.unique(q, return_inverse=True)
        b1, b2 = self._pair(unique)
        f1, f2 = self.fill[b1], self.fill[b2]
        first = np.where((f2 < f1) | ((f2 == f1) & ((unique & np.uint64(1)) == 1)), b2, b1)
        out = np.full(len(unique), -1, np.int64)
        self._fit(unique, first, out, np.arange(len(unique)))
        left = np.flatnonzero(out < 0)
        if len(left):
            self._fit(unique, np.where(first[left] == b1[left], b2[left], b1[left]), out, left)
        for i in np.flatnonzero(out < 0).tolist():  # both buckets full: rare below LOAD
            out[i] = self._place_one(int(unique[i]))
        return (self.find(unique) if self._moved else out)[inverse]  # a move may have taken an earlier key's slot

    def _fit(self, unique: Keys, bucket: Slots, out: Slots, idx: Slots) -> None:
        """Place `unique[idx]` in `bucket` (aligned to idx) as far as each bucket has room, writing `out[idx]`."""
        order = np.argsort(bucket, kind="stable")
        sorted_b = bucket[order]
        starts = np.flatnonzero(np.concatenate(([True], sorted_b[1:] != sorted_b[:-1])))
        rank = np.arange(len(sorted_b)) - np.repeat(starts, np.diff(np.append(starts, len(sorted_b))))
        fits = rank < WAYS - self.fill[sorted_b].astype(np.int64)
        if not fits.any():
            return
        fb, fr, which = sorted_b[fits], rank[fits], idx[order[fits]]
        empty = self.keys[(fb * WAYS)[:, None] + np.arange(WAYS)] == EMPTY
        way = ((np.cumsum(empty, axis=1) == (fr + 1)[:, None]) & empty).argmax(axis=1)
        slots = fb * WAYS + way
        self.keys[slots] = unique[which]
        np.add.at(self.fill, fb, 1)
        self.count += len(slots)
        out[which] = slots

    def _place_one(self, key: int) -> int:
        """One key: the emptier bucket; both full, an entry of theirs moves to its other bucket where that has
        room (one cuckoo step); failing that, the entry with the smallest `order` value gives its slot."""
        b1, b2 = self._pair_one(key)
        fill = self.fill
        b = b2 if fill[b2] < fill[b1] else b1
        if fill[b] >= WAYS:
            b = self._displace(b1)
            b = b if b >= 0 else self._displace(b2)
        if b >= 0:
            slot = b * WAYS + self.keys[b * WAYS : b * WAYS + WAYS].tolist().index(EMPTY)
            fill[b] += 1
            self.count += 1
        else:  # the victim's place: count and fill unchanged
            cand = np.concatenate((np.arange(b1 * WAYS, b1 * WAYS + WAYS), np.arange(b2 * WAYS, b2 * WAYS + WAYS)))
            slot = int(cand[self.cols[self._order][cand].argmin()]) if self._order else b1 * WAYS
        self.keys[slot] = key
        return slot

    def _displace(self, bucket: int) -> int:
        """Move one entry of a full bucket to its other bucket, if one has room; returns `bucket` or -1."""
        for slot in range(bucket * WAYS, bucket * WAYS + WAYS):
            key = int(self.keys[slot])
            alt = next((b for b in self._pair_one(key) if b != bucket), bucket)
            if self.fill[alt] < WAYS:
                to = alt * WAYS + self.keys[alt * WAYS : alt * WAYS + WAYS].tolist().index(EMPTY)
                self.keys[to], self.keys[slot] = key, EMPTY
                for col in self.cols.values():
                    col[to] = col[slot]
                self.fill[alt] += 1
                self.fill[bucket] -= 1
                self._moved = True
                return bucket
        return -1

    def _grow(self, entries: int) -> None:
        buckets = self.buckets
        while buckets < self._max_buckets and buckets * WAYS * LOAD < entries:
            buckets = min(buckets * 2, self._max_buckets)
        old = self.occupied()
        keys, cols = self.keys[old], {n: c[old] for n, c in self.cols.items()}
        self.count = 0
        self._allocate(buckets)
        if len(old):
            slots = self.place(keys)
            for n, values in cols.items():
                self.cols[n][slots] = values
