"""Saturation: an engine that reports waiting requests while its KV cache is nearly full is past its knee (more
concurrency only adds queueing). The admission gate counts no capacity on it and the routing filter avoids it while
another replica is not saturated. O(n), keeps order."""

from __future__ import annotations

from collections.abc import Iterable

from policies.base import ReplicaState

DEFAULT_KV_THRESHOLD = 0.95


def saturated(replica: ReplicaState, kv_threshold: float = DEFAULT_KV_THRESHOLD) -> bool:
    return replica.waiting > 0 and replica.kv_usage >= kv_threshold


def not_saturated(replicas: Iterable[ReplicaState], kv_threshold: float = DEFAULT_KV_THRESHOLD) -> list[ReplicaState]:
    return [r for r in replicas if not saturated(r, kv_threshold)]
