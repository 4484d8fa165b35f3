"""least-load: fewest in-flight requests as counted by the gateway, then fewest engine-reported waiting, then
running requests; ties rotate with the decision sequence number so equal replicas share the load.

O(n log n) for n candidates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.base import Decision, NoCandidate, ReplicaState, RoutingView
from policies.filters import routable


def load_key(replica: ReplicaState) -> tuple[int, int, int]:
    return (replica.in_flight, replica.waiting, replica.running)


class LeastLoad:
    name = "least-load"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        if params:
            raise ValueError(f"least-load takes no parameters, got {sorted(params)}")

    def decide(self, view: RoutingView) -> Decision:
        candidates = routable(view.replicas)
        if len(candidates) <= 1:
            if not candidates:
                raise NoCandidate()
            return Decision(candidates[0].id, "least-load")
        candidates.sort(key=_by_id)
        keys = [load_key(r) for r in candidates]
        best = min(keys)
        tied = [r for r, key in zip(candidates, keys, strict=True) if key == best]
        return Decision(tied[view.seq % len(tied)].id, "least-load")


def _by_id(replica: ReplicaState) -> str:
    return replica.id
