"""Requests between routing and their end, per replica: what was predicted for them.

Each routed request is registered (`add`) with its replica, the leading blocks kvgate believed cached there, those
blocks' LRU ages (for the index's capacity estimate) and the index's insert count at that moment. It leaves (`pop`)
when it ends, however it ended; a request retried on another replica is re-registered there and leaves the first.
`settled_before(replica)`: the index's insert count when the oldest unfinished request there was routed: blocks
last used before it were used by finished requests, so the engine held them (see `KvIndex.ages`).

Bounds: at most `max_entries` requests (the oldest forgotten first, e.g. after lost `pop` calls). Cost: O(1) per
add, pop and `settled_before`.

`ParityWindows`: when they end, per model, the gap between predicted and reported cached tokens over windows of
`size` requests; a window whose gaps exceed `warn_fraction` of its prompt tokens is logged (a tokenizer or chat
template that differs from the engine's). O(1) per request, amortized; one window per model.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from typing import NamedTuple

log = logging.getLogger(__name__)


class Routed(NamedTuple):
    replica: str
    predicted_blocks: int
    ages: tuple[int, ...]
    inserts_at: int


class RoutedRequests:
    def __init__(self, max_entries: int = 65_536) -> None:
        self.max_entries = max_entries
        self._requests: OrderedDict[int, Routed] = OrderedDict()
        self._by_replica: dict[str, dict[int, Routed]] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request_id: int, routed: Routed) -> None:
        self.pop(request_id)  # a retry: it left the replica of its previous attempt
        self._requests[request_id] = routed
        self._by_replica.setdefault(routed.replica, {})[request_id] = routed
        while len(self._requests) > self.max_entries:
            self.pop(next(iter(self._requests)))

    def pop(self, request_id: int) -> Routed | None:
        routed = self._requests.pop(request_id, None)
        if routed is not None:
            self._by_replica.get(routed.replica, {}).pop(request_id, None)
        return routed

    def drop_replica(self, replica: str) -> None:
        for request_id in list(self._by_replica.pop(replica, {})):
            self._requests.pop(request_id, None)

    def settled_before(self, replica: str) -> int | None:
        requests = self._by_replica.get(replica)
        # a replica's requests are kept in routing order and its insert count only grows: the first is the oldest
        return next(iter(requests.values())).inserts_at if requests else None


class ParityWindows:
    def __init__(self, size: int, warn_fraction: float) -> None:
        self.size, self.warn_fraction = size, warn_fraction
        self._windows: dict[str, deque[tuple[int, int]]] = {}

    def add(self, model: str, gap: int, prompt_tokens: int) -> None:
        window = self._windows.setdefault(model, deque(maxlen=self.size))
        window.append((gap, prompt_tokens))
        if len(window) < self.size:
            return
        gaps = sum(g for g, _ in window)
        prompts = sum(p for _, p in window) or 1
        if gaps / prompts > self.warn_fraction:
            log.warning(
                "prefix prediction for %s is off by %.0f%% of prompt tokens over the last %d requests "
                "(tokenizer or chat template mismatch with the engine?)",
                model, 100 * gaps / prompts, len(window),
            )  # fmt: skip
        window.clear()
