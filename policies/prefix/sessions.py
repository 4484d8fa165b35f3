"""Session affinity: a bounded map session key -> replica id.

An `OrderedDict` in LRU order holds (replica, expiry); a lookup of a live entry refreshes its TTL and moves it to
the end, an expired entry is dropped on lookup, and a bind past `max_entries` evicts the least recently used entry.
All operations are O(1) except `drop_replica`, O(entries), run only when a replica leaves the pool.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class SessionTable:
    def __init__(self, *, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0 or max_entries <= 0:
            raise ValueError("session ttl_s and max_entries must be positive")
        self._ttl = ttl_s
        self._max = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> str | None:
        """The replica the session is bound to, refreshing its TTL; None when unbound or expired."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        now = self._clock()
        replica, expiry = entry
        if expiry < now:
            del self._entries[key]
            return None
        self._entries[key] = (replica, now + self._ttl)
        self._entries.move_to_end(key)
        return replica

    def bind(self, key: str, replica: str) -> None:
        self._entries[key] = (replica, self._clock() + self._ttl)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def drop_replica(self, replica: str) -> int:
        """Unbind every session bound to `replica`; returns how many."""
        gone = [k for k, (r, _) in self._entries.items() if r == replica]
        for k in gone:
            del self._entries[k]
        return len(gone)
