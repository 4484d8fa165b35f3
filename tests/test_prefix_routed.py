"""Routed requests: the settled mark per replica, across retries, ends and bounds."""

from __future__ import annotations

from cacheindex.routed import Routed, RoutedRequests


def routed(replica: str, inserts_at: int) -> Routed:
    return Routed(replica, predicted_blocks=0, ages=(), inserts_at=inserts_at)


def test_settled_mark_follows_unfinished_requests_and_a_retry_moves_it() -> None:
    r = RoutedRequests()
    r.add(1, routed("a", 10))
    r.add(2, routed("a", 30))
    r.add(3, routed("b", 5))
    assert (r.settled_before("a"), r.settled_before("b"), r.settled_before("c")) == (10, 5, None)
    r.add(3, routed("a", 50))  # request 3 retried on a
    assert (r.settled_before("a"), r.settled_before("b")) == (10, None)
    assert r.pop(1) is not None and r.pop(1) is None
    assert r.settled_before("a") == 30
    r.drop_replica("a")
    assert len(r) == 0 and r.settled_before("a") is None


def test_the_oldest_requests_are_forgotten_past_the_bound() -> None:
    r = RoutedRequests(max_entries=3)
    for i in range(5):
        r.add(i, routed("a", i))
    assert len(r) == 3 and r.settled_before("a") == 2
    assert r.pop(0) is None and r.pop(4) is not None
