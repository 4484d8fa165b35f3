"""The candidate filter every policy applies first. O(n) over the candidates; keeps their order."""

from __future__ import annotations

from collections.abc import Iterable

from policies.base import ReplicaState
from policies.saturation import not_saturated


def routable(replicas: Iterable[ReplicaState]) -> list[ReplicaState]:
    """Ready, not draining, below its capacity gate (when it has one); saturated replicas only when every candidate
    is saturated (the admission queue in front keeps that case rare)."""
    candidates = [
        r
        for r in replicas
        if r.ready and not r.draining and (r.max_concurrency is None or r.in_flight < r.max_concurrency)
    ]
    return not_saturated(candidates) or candidates
