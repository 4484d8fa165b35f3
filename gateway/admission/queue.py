"""Weighted fair queue across tenants with strict priority classes, and the measured drain rate.

Ordering (self-clocked fair queueing, SCFQ): each entry gets a virtual finish tag
    F = max(V, F_last[tenant]) + 1 / weight[tenant]
where V is the tag of the entry dispatched last and F_last the tag of the tenant's previous queued entry. Entries
leave in (priority rank, F, arrival seq) order: a higher priority class always goes first; within a class a tenant
with weight w gets w / sum(w) of the dispatches while it has entries queued, however many it queued, so a flooding
tenant cannot starve a light one (the light tenant's next entry is tagged just after V, ahead of the flood's
backlog). A tenant that empties its queue forgets its tag (no credit for idle time).

Bounds: a global bound and a per-tenant bound (checked by `can_push`, before anything is allocated).
Complexity: push O(log n), pop O(log n) amortised, cancel O(1) (lazy: the entry is marked and skipped; the heap is
rebuilt in O(n) when dead entries outnumber live ones, so it never holds more than 2x the bound).

Drain rate: the times of the last `window` dispatches (a bounded deque); rate = dispatches / elapsed over at most
`horizon_s`. Retry-After for a refused request = queued / rate, clamped to [1, 60] s.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(order=True, slots=True)
class QueueEntry:
    priority: int
    finish: float
    seq: int
    tenant: str = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)
    dead: bool = field(default=False, compare=False)


class FairQueue:
    def __init__(self) -> None:
        self._heap: list[QueueEntry] = []
        self._per_tenant: dict[str, int] = {}
        self._last_finish: dict[str, float] = {}
        self._virtual = 0.0
        self._seq = 0
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def tenant_len(self, tenant: str) -> int:
        return self._per_tenant.get(tenant, 0)

    def push(self, tenant: str, weight: float, priority: int) -> QueueEntry:
        start = max(self._virtual, self._last_finish.get(tenant, 0.0))
        finish = start + 1.0 / weight
        self._last_finish[tenant] = finish
        self._seq += 1
        entry = QueueEntry(priority, finish, self._seq, tenant, asyncio.get_running_loop().create_future())
        heapq.heappush(self._heap, entry)
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        self._live += 1
        return entry

    def peek(self) -> QueueEntry | None:
        while self._heap and self._heap[0].dead:
            heapq.heappop(self._heap)
        return self._heap[0] if self._heap else None

    def pop(self) -> QueueEntry | None:
        entry = self.peek()
        if entry is None:
            return None
        heapq.heappop(self._heap)
        self._virtual = max(self._virtual, entry.finish)
        self._forget(entry)
        return entry

    def remove(self, entry: QueueEntry) -> None:
        """Take a waiting entry out (timed out, client left); O(1), the heap slot is reclaimed lazily."""
        if entry.dead:
            return
        self._forget(entry)
        if len(self._heap) > 64 and len(self._heap) > 2 * self._live:
            self._heap = [e for e in self._heap if not e.dead]
            heapq.heapify(self._heap)

    def _forget(self, entry: QueueEntry) -> None:
        entry.dead = True
        self._live -= 1
        left = self._per_tenant[entry.tenant] - 1
        if left:
            self._per_tenant[entry.tenant] = left
        else:
            del self._per_tenant[entry.tenant]
            self._last_finish.pop(entry.tenant, None)


class DrainRate:
    """Dispatches per second over the recent past (bounded memory)."""

    def __init__(self, window: int = 256, horizon_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self._times: deque[float] = deque(maxlen=window)
        self.horizon_s = horizon_s
        self.clock = clock

    def record(self) -> None:
        self._times.append(self.clock())

    def rate(self) -> float:
        now = self.clock()
        while self._times and now - self._times[0] > self.horizon_s:
            self._times.popleft()
        if len(self._times) < 2:
            return 0.0
        return len(self._times) / max(now - self._times[0], 1e-3)

    def retry_after(self, queued: int) -> float:
        rate = self.rate()
        if rate <= 0.0:
            return 1.0
        return min(60.0, max(1.0, (queued + 1) / rate))
