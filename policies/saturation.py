"""Saturation filter: an engine that reports waiting requests while its KV cache is nearly full is past its knee
(more concurrency only adds queueing), so it takes no new request until it recovers. O(n), keeps order."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from policies.base import ReplicaState, RoutingView

DEFAULT_KV_THRESHOLD = 0.95


def saturated(replica: ReplicaState, kv_threshold: float = DEFAULT_KV_THRESHOLD) -> bool:
    return replica.waiting > 0 and replica.kv_usage >= kv_threshold


def not_saturated(replicas: Iterable[ReplicaState], kv_threshold: float = DEFAULT_KV_THRESHOLD) -> list[ReplicaState]:
    return [r for r in replicas if not saturated(r, kv_threshold)]


class SaturationFilter:
    """`policies.base.Filter` stage wrapping `not_saturated`."""

    name = "saturation"

    def __init__(self, kv_threshold: float = DEFAULT_KV_THRESHOLD) -> None:
        self.kv_threshold = kv_threshold

    def filter(self, view: RoutingView, candidates: Sequence[ReplicaState]) -> Sequence[ReplicaState]:
        return not_saturated(candidates, self.kv_threshold)
