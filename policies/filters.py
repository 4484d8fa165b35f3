"""Candidate filters shared by policies. Each is O(n) over the candidates and keeps their order."""

from __future__ import annotations

from collections.abc import Iterable

from policies.base import ReplicaState


def routable(replicas: Iterable[ReplicaState]) -> list[ReplicaState]:
    """Ready, not draining, and below its capacity gate (when it has one)."""
    return [
        r
        for r in replicas
        if r.ready and not r.draining and (r.max_concurrency is None or r.in_flight < r.max_concurrency)
    ]
