"""Routing policies: contracts in `base`, one module per policy, one explicit registry in `registry`."""

from policies.base import Decision, NoCandidate, Policy, ReplicaState, RequestInfo, RoutingView

__all__ = ["Decision", "NoCandidate", "Policy", "ReplicaState", "RequestInfo", "RoutingView"]
