"""least-load: fewest in-flight requests as counted by the gateway, then fewest engine-reported waiting, then
running requests; ties rotate with the decision sequence number so equal replicas share the load.

O(n) for n candidates, plus O(t log t) to order t tied ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.base import Decision, NoCandidate, NoParams, ReplicaState, RoutingView
from policies.filters import routable


def load_key(replica: ReplicaState) -> tuple[int, int, int]:
    return (replica.in_flight, replica.waiting, replica.running)


class LeastLoad:
    name = "least-load"

    Params = NoParams

    def __init__(self, params: Mapping[str, Any] | NoParams | None = None) -> None:
        if not isinstance(params, NoParams):
            NoParams.model_validate(params or {})  # ValidationError (a ValueError) naming any parameter given

    def decide(self, view: RoutingView) -> Decision:
        best: tuple[int, int, int] | None = None
        tied: list[ReplicaState] = []
        for replica in routable(view.replicas):  # one pass: the least loaded, and those tied with it
            key = load_key(replica)
            if best is None or key < best:
                best, tied = key, [replica]
            elif key == best:
                tied.append(replica)
        if not tied:
            raise NoCandidate()
        if len(tied) > 1:
            tied.sort(key=_by_id)  # the rotation among equals must not depend on how the view was assembled
        return Decision(tied[view.seq % len(tied)].id, "least-load")


def _by_id(replica: ReplicaState) -> str:
    return replica.id
