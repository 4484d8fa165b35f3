"""Session affinity: a bounded map session key -> replica id.

Keys are stored as their 128-bit xxh3 digest, so a client's key of any length (a `user` field can be megabytes)
costs 16 bytes. An `OrderedDict` in LRU order holds (replica, expiry); every lookup of a live entry and every bind
refreshes its TTL and moves it to the end, so the order is also expiry order: each operation first drops the
expired entries at the front (amortized O(1)), and a bind past `max_entries` evicts the least recently used entry.
All operations are O(1) amortized except `drop_replica`, O(entries), run only when a replica leaves the pool.
The `*_digest` forms take the digest itself (`session_digest`): what gateways sharing their sessions exchange.

`AwaitedSessions`: the sessions expected back soon (their last answer ended in a tool call: an agent runs the tool
and sends its next turn within seconds), each with its replica and the blocks its conversation holds there, so that
placement can price evicting them. The same ordered-by-expiry map, plus a running total of blocks per replica:
`mark`, `back` and `blocks` O(1) amortized.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import xxhash


def session_digest(key: str) -> bytes:
    """The 16 bytes a session key is stored (and shared between gateways) as."""
    return xxhash.xxh3_128_digest(key.encode("utf-8", "surrogatepass"))


class SessionTable:
    def __init__(self, *, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0 or max_entries <= 0:
            raise ValueError("session ttl_s and max_entries must be positive")
        self._ttl = ttl_s
        self._max = max_entries
        self._clock = clock
        self._entries: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self, now: float) -> None:
        entries = self._entries
        while entries:
            first = next(iter(entries.values()))
            if first[1] >= now:
                return
            entries.popitem(last=False)

    def get(self, key: str) -> str | None:
        """The replica the session is bound to, refreshing its TTL; None when unbound or expired."""
        return self.get_digest(session_digest(key))

    def get_digest(self, digest: bytes) -> str | None:
        now = self._clock()
        self._expire(now)
        entry = self._entries.get(digest)
        if entry is None:
            return None
        self._entries[digest] = (entry[0], now + self._ttl)
        self._entries.move_to_end(digest)
        return entry[0]

    def bind(self, key: str, replica: str) -> None:
        self.bind_digest(session_digest(key), replica)

    def bind_digest(self, digest: bytes, replica: str) -> None:
        now = self._clock()
        self._expire(now)
        self._entries[digest] = (replica, now + self._ttl)
        self._entries.move_to_end(digest)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def drop_replica(self, replica: str) -> int:
        """Unbind every session bound to `replica`; returns how many."""
        gone = [k for k, (r, _) in self._entries.items() if r == replica]
        for k in gone:
            del self._entries[k]
        return len(gone)


class AwaitedSessions:
    def __init__(self, *, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic):
        """`ttl_s`: how long after its tool call a session is still expected back."""
        if ttl_s <= 0 or max_entries <= 0:
            raise ValueError("awaited ttl_s and max_entries must be positive")
        self._ttl = ttl_s
        self._max = max_entries
        self._clock = clock
        self._entries: OrderedDict[bytes, tuple[str, int, float]] = OrderedDict()
        # replica -> the blocks of the sessions awaited there (empty: none awaited anywhere, expired ones aside;
        # read as an attribute, so that a request with nothing awaited makes no call here)
        self.by_replica: dict[str, int] = {}

    def __len__(self) -> int:
        self._expire(self._clock())
        return len(self._entries)

    def _drop(self, digest: bytes) -> None:
        replica, blocks, _ = self._entries.pop(digest)
        left = self.by_replica.get(replica, 0) - blocks
        if left > 0:
            self.by_replica[replica] = left
        else:
            self.by_replica.pop(replica, None)

    def _expire(self, now: float) -> None:
        entries = self._entries
        while entries:
            digest, (_, _, expiry) = next(iter(entries.items()))
            if expiry >= now:
                return
            self._drop(digest)

    def mark(self, digest: bytes, replica: str, blocks: int) -> None:
        """The session's answer on `replica` ended in a tool call; its conversation holds `blocks` blocks there."""
        now = self._clock()
        self._expire(now)
        if digest in self._entries:
            self._drop(digest)
        if blocks <= 0:  # a prompt shorter than a block holds nothing to spare
            return
        self._entries[digest] = (replica, blocks, now + self._ttl)
        self.by_replica[replica] = self.by_replica.get(replica, 0) + blocks
        while len(self._entries) > self._max:
            self._drop(next(iter(self._entries)))

    def back(self, digest: bytes) -> None:
        """The session sent its next turn: no longer awaited."""
        if digest in self._entries:
            self._drop(digest)

    def blocks(self, replica: str, excluding: bytes | None = None) -> int:
        """The blocks of the sessions awaited on `replica` (less `excluding`'s own, when it is awaited there)."""
        self._expire(self._clock())
        total = self.by_replica.get(replica, 0)
        own = self._entries.get(excluding) if excluding is not None else None
        return total - own[1] if own is not None and own[0] == replica else total

    def drop_replica(self, replica: str) -> None:
        for digest in [d for d, (r, _, _) in self._entries.items() if r == replica]:
            self._drop(digest)
