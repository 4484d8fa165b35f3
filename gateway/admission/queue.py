"""Weighted fair queue across tenants with strict priority classes, least attained service first within a tenant,
and the measured drain rate.

Ordering across tenants (self-clocked fair queueing, SCFQ): each push takes a slot with a virtual finish tag
    F = max(V[class], F_last[tenant, class]) + 1 / weight[tenant]
where V[class] is the tag of the class's slot dispatched last and F_last the tag of the tenant's previous slot in
the class. Slots leave in (priority rank, F, arrival seq) order: a higher priority class always goes first; within a
class a tenant with weight w gets w / sum(w) of the dispatches while it has requests queued, however many it queued,
so a flooding tenant cannot starve a light one (the light tenant's next slot is tagged just after V, ahead of the
flood's backlog). Each class keeps its own clock and tags: a tenant's batch backlog does not push its interactive
requests back, nor do interactive dispatches push a new batch tenant behind another's backlog. A tenant that empties
its queue in a class forgets its tag there (no credit for idle time).

Within a tenant and class, a slot dispatches the queued request whose program has had the least service so far
(`attained`: the seconds of the session's earlier requests, Autellix's least-attained-service rule for agent
programs), then the earliest: a short program is not stuck behind the tenth turn of a long one, and requests
without a session count as programs just begun. With every `attained` equal this is arrival order.

Bounds: a global bound and a per-tenant bound (checked by `can_push`, before anything is allocated).
`ahead`: how many queued requests a new one would wait behind (its place in that order), O(queued).
Complexity: push O(log n), pop O(log n) amortised, remove O(1) (lazy: the request is marked and skipped, and a slot
left over by a removed request dispatches the tenant's next one; the heaps are rebuilt in O(n) when they hold more
than twice the live requests).

Drain rate: the times of the last `window` dispatches (a bounded deque); rate = dispatches / elapsed over at most
`horizon_s`. Retry-After for a refused request = queued / rate, clamped to [1, 60] s.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(order=True, slots=True)
class QueueEntry:
    """A queued request, ordered among its tenant's of its class by its program's service so far, then arrival."""

    attained: float
    seq: int
    tenant: str = field(compare=False)
    priority: int = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)
    dead: bool = field(default=False, compare=False)
    model: str = field(default="", compare=False)  # what it asked for (an adapter shares its base model's queue)


@dataclass(order=True, slots=True)
class _Slot:
    priority: int
    finish: float
    seq: int
    key: tuple[str, int] = field(compare=False)  # (tenant, priority)
    generation: int = field(compare=False)  # the key's while it had requests queued; a later one voids the slot


class FairQueue:
    def __init__(self) -> None:
        self._slots: list[_Slot] = []
        self._waiting: dict[tuple[str, int], list[QueueEntry]] = {}  # per (tenant, priority): a heap of requests
        self._live_by_key: dict[tuple[str, int], int] = {}
        self._generation: dict[tuple[str, int], int] = {}
        self._generations = itertools.count(1)
        self._per_tenant: dict[str, int] = {}
        self._last_finish: dict[tuple[str, int], float] = {}  # per (tenant, priority)
        self._virtual: dict[int, float] = {}  # per priority: the tag of its slot dispatched last
        self._seq = 0
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def tenant_len(self, tenant: str) -> int:
        return self._per_tenant.get(tenant, 0)

    def push(self, tenant: str, weight: float, priority: int, attained: float = 0.0, model: str = "") -> QueueEntry:
        key = (tenant, priority)
        finish = self._finish(key, weight)
        self._last_finish[key] = finish
        self._seq += 1
        future = asyncio.get_running_loop().create_future()
        entry = QueueEntry(attained, self._seq, tenant, priority, future, model=model)
        if key not in self._generation:
            self._generation[key] = next(self._generations)
        heapq.heappush(self._waiting.setdefault(key, []), entry)
        heapq.heappush(self._slots, _Slot(priority, finish, self._seq, key, self._generation[key]))
        self._live_by_key[key] = self._live_by_key.get(key, 0) + 1
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        self._live += 1
        return entry

    def class_len(self, tenant: str, priority: int) -> int:
        """The tenant's requests queued in the class: a new one of the same would wait behind all of them."""
        return self._live_by_key.get((tenant, priority), 0)

    def ahead(self, tenant: str, weight: float, priority: int) -> int:
        """How many queued requests a request of `tenant` pushed now would dispatch after: the live slots tagged no
        later than its own would be (a key's slots beyond its live requests are void). O(queued)."""
        finish = self._finish((tenant, priority), weight)
        below: dict[tuple[str, int], int] = {}
        for slot in self._slots:
            if (slot.priority, slot.finish) <= (priority, finish) and self._generation.get(slot.key) == slot.generation:
                below[slot.key] = below.get(slot.key, 0) + 1
        return sum(min(n, self._live_by_key.get(key, 0)) for key, n in below.items())

    def _finish(self, key: tuple[str, int], weight: float) -> float:
        """The finish tag a slot of `key` (tenant, priority) pushed now takes."""
        return max(self._virtual.get(key[1], 0.0), self._last_finish.get(key, 0.0)) + 1.0 / weight

    def _head(self) -> tuple[_Slot, QueueEntry] | None:
        """The next slot and the request it dispatches; void slots and dead requests dropped on the way."""
        slots = self._slots
        while slots:
            slot = slots[0]
            waiting = self._waiting.get(slot.key) if self._generation.get(slot.key) == slot.generation else None
            while waiting and waiting[0].dead:
                heapq.heappop(waiting)
            if waiting:
                return slot, waiting[0]
            heapq.heappop(slots)
        return None

    def peek(self) -> QueueEntry | None:
        head = self._head()
        return head[1] if head is not None else None

    def pop(self) -> QueueEntry | None:
        head = self._head()
        if head is None:
            return None
        slot, entry = head
        heapq.heappop(self._slots)
        heapq.heappop(self._waiting[slot.key])
        self._virtual[slot.priority] = max(self._virtual.get(slot.priority, 0.0), slot.finish)
        self._forget(entry)
        return entry

    def remove(self, entry: QueueEntry) -> None:
        """Take a waiting request out (timed out, client left); O(1), its heap places reclaimed lazily."""
        if entry.dead:
            return
        self._forget(entry)
        if len(self._slots) > 64 and len(self._slots) > 2 * self._live:
            self._compact()

    def _compact(self) -> None:
        """Drop dead requests and void slots, and per key the slots beyond its live requests (the latest)."""
        for key, waiting in self._waiting.items():
            self._waiting[key] = [e for e in waiting if not e.dead]
            heapq.heapify(self._waiting[key])
        kept: dict[tuple[str, int], int] = {}
        slots = []
        for slot in sorted(self._slots):
            if self._generation.get(slot.key) == slot.generation and kept.get(slot.key, 0) < self._live_by_key.get(
                slot.key, 0
            ):
                kept[slot.key] = kept.get(slot.key, 0) + 1
                slots.append(slot)
        self._slots = slots  # sorted: a heap

    def _forget(self, entry: QueueEntry) -> None:
        entry.dead = True
        self._live -= 1
        key = (entry.tenant, entry.priority)
        if left_key := self._live_by_key[key] - 1:
            self._live_by_key[key] = left_key
        else:  # the key's leftover slots are void from now on; its tag is forgotten
            del self._live_by_key[key], self._generation[key]
            self._waiting.pop(key, None)
            self._last_finish.pop(key, None)
        left = self._per_tenant[entry.tenant] - 1
        if left:
            self._per_tenant[entry.tenant] = left
        else:
            del self._per_tenant[entry.tenant]


class AttainedService:
    """Seconds of service each program (session) has had: its finished requests' time from admission to end. A
    bounded LRU (`max_programs`) keyed by the session's 16-byte digest (a `user` field can be megabytes); a program
    not seen has had none. O(1) per request."""

    def __init__(self, max_programs: int = 65_536) -> None:
        self._seconds: OrderedDict[bytes, float] = OrderedDict()
        self.max_programs = max_programs

    def of(self, session: bytes | None) -> float:
        return self._seconds.get(session, 0.0) if session is not None else 0.0

    def add(self, session: bytes, seconds: float) -> None:
        self._seconds[session] = self._seconds.pop(session, 0.0) + max(0.0, seconds)
        if len(self._seconds) > self.max_programs:
            self._seconds.popitem(last=False)


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
