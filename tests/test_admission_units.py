"""Admission building blocks on literal values: config, auth, fair queue, drain rate, local quota store."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from engine_pool.replica import Replica
from gateway.admission.auth import Authenticator, check_admin
from gateway.admission.capacity import CapacityGate
from gateway.admission.config import AdmissionConfig, LimitsConfig, TenantConfig, hash_key
from gateway.admission.local import LocalQuotaStore
from gateway.admission.metrics import AdmissionMetrics
from gateway.admission.queue import AttainedService, DrainRate, FairQueue
from gateway.admission.quota import format_reset, token_cost
from gateway.errors import NotFound, Unauthorized


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _config(**kw: object) -> AdmissionConfig:
    base: dict[str, object] = {
        "auth": True,
        "tenants": {
            "alice": {"keys": [hash_key("sk-alice")], "priority": "interactive"},
            "bob": {"keys": [hash_key("sk-bob")], "priority": "batch"},
        },
    }
    base.update(kw)
    return AdmissionConfig.model_validate(base)


def test_hash_key_format_and_config_rejects_clear_or_shared_keys() -> None:
    assert hash_key("x").startswith("sha256:") and len(hash_key("x")) == 7 + 64
    with pytest.raises(ValidationError, match="sha256"):
        TenantConfig(keys=["sk-in-clear"])
    with pytest.raises(ValidationError, match="also belongs"):
        AdmissionConfig.model_validate({"tenants": {"a": {"keys": [hash_key("k")]}, "b": {"keys": [hash_key("k")]}}})
    with pytest.raises(ValidationError, match="unknown class"):
        AdmissionConfig.model_validate({"tenants": {"a": {"priority": "urgent"}}})
    with pytest.raises(ValidationError, match="Extra inputs"):
        AdmissionConfig.model_validate({"tenant": {}})


def test_auth_maps_keys_to_tenants_and_clamps_priority() -> None:
    auth = Authenticator(_config())
    assert auth.identify(CIMultiDict({"authorization": "Bearer sk-alice"})).tenant == "alice"
    bob = auth.identify(CIMultiDict({"authorization": "Bearer sk-bob", "x-kvgate-priority": "interactive"}))
    assert (bob.tenant, bob.priority_name) == ("bob", "batch")  # cannot rise above the tenant's ceiling
    alice_batch = auth.identify(CIMultiDict({"authorization": "Bearer sk-alice", "x-kvgate-priority": "batch"}))
    assert alice_batch.priority_name == "batch"  # may lower itself
    for headers in ({}, {"authorization": "Bearer sk-nobody"}, {"authorization": "Basic sk-alice"}):
        with pytest.raises(Unauthorized):
            auth.identify(CIMultiDict(headers))
    # a key sent twice: a proxy before the gateway may have read the other one
    for pairs in (
        [("authorization", "Bearer sk-alice"), ("authorization", "Bearer sk-nobody")],
        [("authorization", "Bearer sk-alice"), ("authorization", "Bearer sk-alice")],
    ):
        with pytest.raises(Unauthorized, match="more than one"):
            auth.identify(CIMultiDict(pairs))
    both = [("x-api-key", "sk-nobody"), ("authorization", "Bearer sk-alice")]
    with pytest.raises(Unauthorized, match="more than one"):
        auth.identify(CIMultiDict(both), x_api_key=True)
    same = [("x-api-key", "sk-alice"), ("authorization", "Bearer sk-alice")]
    assert auth.identify(CIMultiDict(same), x_api_key=True).tenant == "alice"
    empty = [("x-api-key", ""), ("authorization", "Bearer sk-alice")]  # an empty header is no key
    assert auth.identify(CIMultiDict(empty), x_api_key=True).tenant == "alice"
    off = Authenticator(AdmissionConfig())
    assert off.identify(CIMultiDict({"authorization": "Bearer whatever"})).tenant == "anonymous"


def test_admin_check() -> None:
    check_admin({"authorization": "Bearer adm"}, "adm")
    for headers in ({"authorization": "Bearer no"}, {"authorization": "adm"}, {}):
        with pytest.raises(Unauthorized):
            check_admin(headers, "adm")
    with pytest.raises(NotFound):  # no admin key configured: the admin routes are off
        check_admin({"authorization": "Bearer adm"}, None)


async def test_fair_queue_interleaves_a_flood_with_a_light_tenant() -> None:
    q = FairQueue()
    for _ in range(50):
        q.push("flood", 1.0, 0)
    for _ in range(5):
        q.push("light", 1.0, 0)
    first_ten = [e.tenant for e in (q.pop() for _ in range(10)) if e is not None]
    assert Counter(first_ten)["light"] == 5  # light's 5 entries all leave within the first 10 pops


async def test_fair_queue_weights_and_priority() -> None:
    q = FairQueue()
    for _ in range(30):
        q.push("heavy", 3.0, 1)
        q.push("one", 1.0, 1)
    q.push("vip", 1.0, 0)
    first = q.pop()
    assert first is not None and first.tenant == "vip"  # higher class first, whatever its arrival
    got = [e.tenant for e in (q.pop() for _ in range(20)) if e is not None]
    assert Counter(got) == Counter({"heavy": 15, "one": 5})  # 3:1 share while both are backlogged


async def test_each_priority_class_keeps_its_own_fair_queue_clock_and_tags() -> None:
    """A tenant's batch backlog does not push its interactive request behind another tenant's interactive flood
    (second in line, as without the backlog); interactive dispatches do not push a new batch tenant behind another
    batch tenant's backlog (second in line there too)."""
    q = FairQueue()
    for _ in range(100):
        q.push("a", 1.0, 1)  # batch
    for _ in range(50):
        q.push("b", 1.0, 0)  # interactive
    assert q.ahead("a", 1.0, 0) == 1
    mine = q.push("a", 1.0, 0)
    assert [q.pop() for _ in range(2)][1] is mine
    q = FairQueue()
    for _ in range(100):
        q.push("c", 1.0, 1)
    for _ in range(300):  # interactive traffic served meanwhile
        q.push("e", 1.0, 0)
        q.pop()
    newcomer = q.push("d", 1.0, 1)
    assert [q.pop() for _ in range(2)][1] is newcomer


async def test_a_new_requests_place_in_the_fair_queue_is_what_dispatches_before_it() -> None:
    """`ahead` counts the requests that would leave before one pushed now: behind a flood of 50 a light tenant's
    first is second in line, the flood's next is behind all of its own, a higher class is first; removed requests
    no longer count. Checked against the order the queue then pops."""
    q = FairQueue()
    flood = [q.push("flood", 1.0, 1) for _ in range(50)]
    assert q.ahead("light", 1.0, 1) == 1  # the flood's head (tagged at the same virtual time, pushed earlier)
    assert q.ahead("flood", 1.0, 1) == 50 and q.class_len("flood", 1) == 50
    assert q.ahead("vip", 1.0, 0) == 0
    light = q.push("light", 1.0, 1)
    order = [q.pop() for _ in range(3)]
    assert order[1] is light  # where `ahead` placed it
    for entry in flood[10:]:
        q.remove(entry)
    assert q.ahead("flood", 1.0, 1) == len(q) == 8


async def test_fair_queue_lazy_removal_keeps_counts_and_heap_bounded() -> None:
    q = FairQueue()
    entries = [q.push(f"t{i % 3}", 1.0, 0) for i in range(300)]
    for e in entries[:290]:
        q.remove(e)
    assert len(q) == 10 and q.tenant_len("t0") + q.tenant_len("t1") + q.tenant_len("t2") == 10
    assert len(q._slots) <= 2 * 64 + 20
    popped = [q.pop() for _ in range(11)]
    assert popped[-1] is None and all(p is not None and not p.future.done() for p in popped[:10])
    q.remove(entries[0])  # removing twice is a no-op
    assert len(q) == 0
    await asyncio.sleep(0)


async def test_within_a_tenant_the_program_with_the_least_service_goes_first() -> None:
    """Autellix's rule inside the fair share: a tenant's queued requests leave least attained service first (then in
    arrival order), while the tenants still alternate by their tags."""
    q = FairQueue()
    long_turn = q.push("a", 1.0, 0, attained=30.0)  # the 10th turn of a long agent program
    short_turn = q.push("a", 1.0, 0, attained=0.5)
    new_program = q.push("a", 1.0, 0)
    other = q.push("b", 1.0, 0, attained=99.0)
    assert [q.pop() for _ in range(4)] == [new_program, other, short_turn, long_turn]
    assert q.pop() is None


async def test_a_removed_request_leaves_its_tenants_share_unchanged() -> None:
    q = FairQueue()
    a = [q.push("a", 1.0, 0, attained=float(i)) for i in range(3)]
    b = [q.push("b", 1.0, 0) for _ in range(3)]
    q.remove(a[0])
    got = [q.pop() for _ in range(5)]
    assert got == [a[1], b[0], a[2], b[1], b[2]] and q.pop() is None
    gone = [q.push("a", 1.0, 0) for _ in range(2)]
    for entry in gone:  # both time out: a's slots stay in the heap, void
        q.remove(entry)
    first = q.push("b", 1.0, 0)
    again = q.push("a", 1.0, 0)  # a tenant that emptied its queue takes a new slot, not its void earlier one
    assert [q.pop(), q.pop(), q.pop()] == [first, again, None]


def test_attained_service_is_per_program_and_bounded() -> None:
    service = AttainedService(max_programs=2)
    service.add(b"p1", 1.5)
    service.add(b"p1", 0.5)
    service.add(b"p2", 3.0)
    assert (service.of(b"p1"), service.of(b"p2"), service.of(None), service.of(b"new")) == (2.0, 3.0, 0.0, 0.0)
    service.add(b"p3", 1.0)  # the least recently served program is forgotten
    assert service.of(b"p1") == 0.0 and service.of(b"p3") == 1.0


def test_drain_rate_and_retry_after() -> None:
    clock = FakeClock(0.0)
    rate = DrainRate(window=8, horizon_s=10.0, clock=clock)
    assert rate.retry_after(100) == 1.0  # nothing measured yet
    for _ in range(8):
        clock.now += 0.5
        rate.record()
    assert rate.rate() == pytest.approx(8 / 3.5)
    assert rate.retry_after(9) == pytest.approx(10 / (8 / 3.5))
    assert rate.retry_after(10_000) == 60.0
    clock.now += 100
    assert rate.rate() == 0.0


def test_format_reset_and_token_cost() -> None:
    assert [format_reset(s) for s in (0.02, 1.0, 59.6, 360.0, 3723.0)] == ["20ms", "1s", "1m0s", "6m0s", "1h2m3s"]
    assert token_cost(100, 80, 10, 0.25) == 20 + 20 + 10
    assert token_cost(10, 50, 0, 0.0) == 0  # cached never exceeds prompt


async def test_local_store_limits_and_reconcile() -> None:
    clock = FakeClock(60.0 * 1000 + 10)  # 10 s into a minute
    store = LocalQuotaStore(clock=clock)
    limits = LimitsConfig(max_concurrency=2, requests_per_minute=3, tokens_per_minute=100)
    a = await store.check("t", limits, 10, "a")
    b = await store.check("t", limits, 10, "b")
    assert a.allowed and b.allowed and b.remaining_requests == 1 and b.remaining_tokens == 80
    c = await store.check("t", limits, 10, "c")
    assert (c.allowed, c.reason) == (False, "concurrency")
    assert a.lease is not None and b.lease is not None
    await store.release(a.lease, 90)  # real cost 90: 80 more charged now
    d = await store.check("t", limits, 10, "d")
    assert (d.allowed, d.reason, d.retry_after_s) == (False, "tokens", 50.0)
    await store.release(b.lease, 0)  # 10 refunded -> 90 used
    assert (await store.check("t", limits, 5, "e")).allowed  # 95 <= 100, third request of the minute
    f = await store.check("t", limits, 1, "f")
    assert (f.reason, f.headers()["x-ratelimit-remaining-requests"]) == ("requests", "0")
    assert f.headers()["x-ratelimit-reset-requests"] == "50s"
    clock.now += 60  # next minute: windows restart, the live lease still counts for concurrency
    g = await store.check("t", limits, 1, "g")
    assert g.allowed and store.in_flight("t") == 2


async def test_local_store_daily_budget_and_tenant_bound() -> None:
    clock = FakeClock(86_400.0 * 100)
    store = LocalQuotaStore(max_tenants=2, clock=clock)
    limits = LimitsConfig(tokens_per_day=50)
    first = await store.check("t", limits, 40, "1")
    assert first.allowed and first.lease is not None
    await store.release(first.lease, 40)
    assert (await store.check("t", limits, 20, "2")).reason == "daily_tokens"
    for name in ("u", "v", "w"):
        await store.check(name, LimitsConfig(), 1, name)
    assert len(store._tenants) <= 3  # at most max_tenants idle ones plus the one being added


class _Replicas(list[Replica]):
    """The replica set as the capacity gate reads it: iterated, listened to."""

    def add_listener(self, listener: object) -> None:
        pass


async def test_a_data_parallel_ranks_defaulted_gate_follows_a_reload_as_its_first_ranks() -> None:
    """The other rank of a data-parallel engine takes its first rank's gate (`Replica.for_rank`); where that gate is
    the config's default, a reload that changes the default changes it on every rank, not on the first alone."""
    first = Replica("e", "http://127.0.0.1:8000", "m")
    replicas = _Replicas([first])
    config = AdmissionConfig(replica_max_concurrency=4)
    no_targets = SimpleNamespace(enabled=False)
    gate = CapacityGate(config, replicas, no_targets, AdmissionMetrics(CollectorRegistry()))  # type: ignore[arg-type]
    gate.replica_up(first)
    other = first.for_rank(1)
    first.ranks.append(other)
    replicas.append(other)
    gate.replica_up(other)
    gate.reload(AdmissionConfig(replica_max_concurrency=2))
    assert (first.max_concurrency, other.max_concurrency) == (2, 2)
