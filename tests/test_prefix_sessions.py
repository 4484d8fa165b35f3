"""Session table: TTL refreshed on use, LRU bound, replica removal."""

from __future__ import annotations

import tracemalloc

import pytest

from cacheindex.sessions import AwaitedSessions, SessionTable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_ttl_refreshed_on_use_and_expires() -> None:
    clock = Clock()
    t = SessionTable(ttl_s=10, max_entries=10, clock=clock)
    t.bind("s", "r1")
    clock.now = 8
    assert t.get("s") == "r1"  # refreshed: expires at 18
    clock.now = 17
    assert t.get("s") == "r1"
    clock.now = 28
    assert t.get("s") is None
    assert len(t) == 0


def test_lru_bound_evicts_least_recently_used() -> None:
    t = SessionTable(ttl_s=100, max_entries=2, clock=Clock())
    t.bind("a", "r1")
    t.bind("b", "r1")
    assert t.get("a") == "r1"  # a is now the most recent
    t.bind("c", "r2")
    assert t.get("b") is None
    assert t.get("a") == "r1" and t.get("c") == "r2"


def test_drop_replica_unbinds_its_sessions() -> None:
    t = SessionTable(ttl_s=100, max_entries=10, clock=Clock())
    t.bind("a", "r1")
    t.bind("b", "r2")
    assert t.drop_replica("r1") == 1
    assert t.get("a") is None and t.get("b") == "r2"


def test_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError):
        SessionTable(ttl_s=0, max_entries=1)


def test_expired_sessions_are_dropped_without_being_looked_up() -> None:
    clock = Clock()
    t = SessionTable(ttl_s=10, max_entries=1000, clock=clock)
    for i in range(100):
        t.bind(f"old-{i}", "r0")
    clock.now += 11
    t.bind("new", "r1")  # any later operation sweeps what expired
    assert len(t) == 1 and t.get("new") == "r1"


def test_a_session_key_of_any_size_costs_the_same() -> None:
    tracemalloc.start()
    try:
        t = SessionTable(ttl_s=100, max_entries=1000, clock=Clock())
        before, _ = tracemalloc.get_traced_memory()
        for i in range(40):
            key = f"{i}-" + "u" * (1 << 20)  # 1 MiB `user` strings
            t.bind(key, "r0")
            del key
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - before < 64 * 1024  # 40 MiB of keys given, a few KiB kept
    assert t.get("7-" + "u" * (1 << 20)) == "r0"


def test_awaited_sessions_count_their_blocks_per_replica_until_back_or_expired() -> None:
    clock = Clock()
    t = AwaitedSessions(ttl_s=30, max_entries=10, clock=clock)
    t.mark(b"s1", "r1", 40)
    t.mark(b"s2", "r1", 25)
    t.mark(b"s3", "r2", 7)
    assert (t.blocks("r1"), t.blocks("r2"), t.blocks("r3"), len(t)) == (65, 7, 0, 3)
    assert t.blocks("r1", excluding=b"s1") == 25  # a session's own blocks do not count against its own placement
    assert t.blocks("r2", excluding=b"s1") == 7
    t.mark(b"s1", "r2", 50)  # its next answer, on another replica, was a tool call again
    assert (t.blocks("r1"), t.blocks("r2")) == (25, 57)
    t.back(b"s2")
    assert t.blocks("r1") == 0
    clock.now = 29
    t.mark(b"s4", "r1", 3)
    clock.now = 31  # s3 and s1 (marked at 0) expire, s4 (at 29) does not
    assert (t.blocks("r1"), t.blocks("r2"), len(t)) == (3, 0, 1)
    t.drop_replica("r1")
    assert (t.blocks("r1"), len(t)) == (0, 0)


def test_a_session_awaited_with_no_blocks_is_not_counted_nor_breaks_the_count() -> None:
    """A tool call whose conversation is shorter than a block (or whose prompt could not be tokenized) holds
    nothing to spare: it is not awaited, and the sessions awaited beside it still count (a zero-block entry outlived
    its replica's total and raised KeyError, failing the request that read it)."""
    clock = Clock()
    t = AwaitedSessions(ttl_s=30, max_entries=10, clock=clock)
    t.mark(b"a", "r1", 5)
    t.mark(b"b", "r1", 0)
    t.back(b"a")
    t.back(b"b")
    assert (t.blocks("r1"), len(t)) == (0, 0)
    t.mark(b"c", "r1", 0)
    clock.now = 100
    assert t.blocks("r2") == 0


def test_awaited_sessions_are_bounded() -> None:
    t = AwaitedSessions(ttl_s=30, max_entries=2, clock=Clock())
    for i in range(5):
        t.mark(bytes([i]), "r1", 10)
    assert (len(t), t.blocks("r1")) == (2, 20)
    with pytest.raises(ValueError):
        AwaitedSessions(ttl_s=0, max_entries=2)
