"""round-robin and least-load on literal snapshots; the registry's refusal of unknown names."""

import pytest

from policies.base import NoCandidate, ReplicaState, RequestInfo, RoutingView
from policies.registry import UnknownPolicy, build_policy, policy_names


def view(*replicas: ReplicaState, seq: int = 0) -> RoutingView:
    return RoutingView(RequestInfo(model="m"), tuple(replicas), seq=seq)


def r(rid: str, **kw: object) -> ReplicaState:
    return ReplicaState(id=rid, model="m", **kw)  # type: ignore[arg-type]


def test_round_robin_cycles_in_id_order_and_skips_unready() -> None:
    policy = build_policy("round-robin")
    replicas = (r("b"), r("a"), r("c", ready=False))
    picks = [policy.decide(view(*replicas, seq=s)).replica for s in range(4)]
    assert picks == ["a", "b", "a", "b"]


def test_least_load_orders_by_inflight_then_waiting_then_running() -> None:
    policy = build_policy("least-load")
    assert policy.decide(view(r("a", in_flight=2), r("b", in_flight=1))).replica == "b"
    assert policy.decide(view(r("a", in_flight=1, waiting=3), r("b", in_flight=1, waiting=1))).replica == "b"
    assert policy.decide(view(r("a", running=5), r("b", running=4))).replica == "b"
    d = policy.decide(view(r("a"), r("b"), seq=1))
    assert d.reason == "least-load"


def test_least_load_rotates_between_equals() -> None:
    policy = build_policy("least-load")
    picks = {policy.decide(view(r("a"), r("b"), seq=s)).replica for s in range(2)}
    assert picks == {"a", "b"}


@pytest.mark.parametrize("name", ["round-robin", "least-load"])
def test_capacity_gate_draining_and_empty(name: str) -> None:
    policy = build_policy(name)
    full = r("a", in_flight=2, max_concurrency=2)
    assert policy.decide(view(full, r("b", in_flight=5))).replica == "b"
    with pytest.raises(NoCandidate):
        policy.decide(view(full, r("c", draining=True)))
    with pytest.raises(NoCandidate):
        policy.decide(view())


def test_registry_rejects_unknown_names_and_params() -> None:
    assert {"round-robin", "least-load"} <= set(policy_names())
    with pytest.raises(UnknownPolicy, match="known: "):
        build_policy("fastest")
    with pytest.raises(ValueError, match=r"(?s)\bxyz\b.*not permitted"):  # names the parameter it does not take
        build_policy("round-robin", {"xyz": 1})


@pytest.mark.parametrize("name", ["round-robin", "least-load", "cache-aware"])
def test_saturated_replicas_are_avoided_while_another_is_not(name: str) -> None:
    policy = build_policy(name)
    hot = r("a", waiting=3, kv_usage=0.99)
    assert {policy.decide(view(hot, r("b", in_flight=9), seq=s)).replica for s in range(4)} == {"b"}
    both = (hot, r("b", waiting=1, kv_usage=0.97))
    assert policy.decide(view(*both)).replica in {"a", "b"}  # all saturated: still routed (admission queues first)
