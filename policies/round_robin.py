"""round-robin: candidate number `seq mod n` among the ready, non-draining replicas, in id order.

O(n log n) for n candidates (the sort keeps the order independent of how the snapshot was assembled).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.base import Decision, NoCandidate, NoParams, RoutingView
from policies.filters import routable


class RoundRobin:
    name = "round-robin"

    Params = NoParams

    def __init__(self, params: Mapping[str, Any] | NoParams | None = None) -> None:
        if not isinstance(params, NoParams):
            NoParams.model_validate(params or {})  # ValidationError (a ValueError) naming any parameter given

    def decide(self, view: RoutingView) -> Decision:
        candidates = sorted(routable(view.replicas), key=lambda r: r.id)
        if not candidates:
            raise NoCandidate()
        return Decision(candidates[view.seq % len(candidates)].id, "round-robin")
