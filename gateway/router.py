"""The async shell around a routing policy: gathers a snapshot, calls the pure `decide`, records the outcome.

Per decision: O(r) to snapshot the model's r replicas, plus whatever the cache hooks cost (O(prompt blocks) per
replica for the prefix index), plus, for a policy that prices in seconds, each replica's latency view (kept until
its replica's state changes: `Replica.latency_view`), plus the policy itself. With the cache hooks and more than
`max_candidates` replicas, r is bounded: the view holds only the replicas holding the prompt's first block (the
index's hints, O(those)), the session's, and a random sample of the others seeded by the request (`max_candidates`
in all, at least `_MIN_SAMPLE` sampled): a cold prompt is placed by the power of d choices, a cached one among its
holders. Of more than `max_weighed` candidates, each costs a snapshot and a lookup (its overlap with the prompt, its
room), and only `max_weighed` finalists (`policies.filters.finalists`: the session's, the deepest holders, the least
loaded, the most room) the full cost: latency views, placement, predictions.
Admission's verdict on latency targets weighs the same finalists (`candidates`), and the route then decides among
those it weighed (`gateway.proxy`), so the finalists are drawn once a request.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeVar

from engine_pool.replica import Replica
from engine_pool.replica_set import ReplicaSet
from gateway.errors import Overloaded
from gateway.metrics import GatewayMetrics
from gateway.request_parse import BodyKind
from policies.base import EMPTY_MAPPING, Decision, Footprint, NoCandidate, Policy, RequestInfo, RoutingView
from policies.disagg import Split, split
from policies.filters import finalists, routable, takes
from policies.latency import Held, ReplicaLatency


class CacheHooks(Protocol):
    """What the router needs from the prefix-cache state (cacheindex.state.CacheAwareState)."""

    async def request_info(
        self,
        *,
        model: str,
        endpoint: Literal["chat", "completions"],
        body: Mapping[str, Any],
        tenant: str,
        session_key: str | None,
        base_model: str | None = None,
    ) -> RequestInfo: ...

    def overlap(self, info: RequestInfo, replica_ids: Sequence[str]) -> dict[str, int]: ...

    def offloaded(self, info: RequestInfo, overlap: Mapping[str, int]) -> Mapping[str, int]: ...

    def session_replica(self, info: RequestInfo) -> str | None: ...

    def holders(self, info: RequestInfo) -> list[str]: ...

    async def claim_cold(self, info: RequestInfo, replica: str) -> str: ...

    def footprint(self, info: RequestInfo, replica_ids: Sequence[str]) -> Mapping[str, Footprint]: ...

    def room(self, replica_ids: Sequence[str]) -> Mapping[str, int]: ...

    def on_routed(self, info: RequestInfo, decision: Decision) -> None: ...


_MIN_SAMPLE = 8
T = TypeVar("T")
_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads consecutive seeds over 64 bits
_MASK = (1 << 64) - 1


def sample(items: Sequence[T], k: int, seed: int) -> list[T]:
    """k distinct items (k <= len), each as likely as any other: every step-th from a start, with the start and a
    step prime to the length drawn from `seed`. O(k), a few integer operations an item (a general random sample
    costs microseconds a draw in Python)."""
    n = len(items)
    h = (seed * _MIX) & _MASK
    start, step = h % n, 1 + (h >> 32) % max(1, n - 1)
    while math.gcd(step, n) != 1:
        step += 1
    return [items[(start + i * step) % n] for i in range(k)]


class Router:
    def __init__(
        self,
        policy: Policy,
        replicas: ReplicaSet,
        metrics: GatewayMetrics,
        cache: CacheHooks | None = None,
        *,
        max_candidates: int = 16,
        max_weighed: int = 4,
    ) -> None:
        self.policy = policy
        self.replicas = replicas
        self.metrics = metrics
        self.cache = cache
        self.max_candidates = max_candidates
        self.max_weighed = max_weighed
        self._rng = random.Random(0)  # the candidate sample: seeded, so a run is reproducible
        self._seq = 0
        self._plain: dict[tuple[str, str], RequestInfo] = {}  # see request_info

    def use(self, policy: Policy, cache: CacheHooks | None, *, max_candidates: int, max_weighed: int) -> None:
        """Decide with `policy` from the next request on (a reload), consulting `cache` (None: no cache hooks)."""
        self.policy, self.cache = policy, cache
        self.max_candidates, self.max_weighed = max_candidates, max_weighed

    async def request_info(
        self,
        *,
        model: str,
        endpoint: BodyKind,
        body: Mapping[str, Any],
        tenant: str,
        session_key: str | None,
    ) -> RequestInfo:
        """What the policy needs to know of the request: prefix block hashes from the cache hooks (chat and
        completions bodies), or just model, tenant and session, one immutable info shared per model and tenant
        when there is no session (bounded by both)."""
        if self.cache is not None and (endpoint == "chat" or endpoint == "completions"):
            base = self.replicas.base_model(model)  # a LoRA adapter is tokenized as its base model
            return await self.cache.request_info(
                model=model, endpoint=endpoint, body=body, tenant=tenant, session_key=session_key, base_model=base
            )
        if session_key is not None:
            return RequestInfo(model=model, tenant=tenant, session_key=session_key)
        key = (model, tenant)
        info = self._plain.get(key)
        if info is None:
            info = RequestInfo(model=model, tenant=tenant)
            if len(self._plain) < 4096:
                self._plain[key] = info
        return info

    def view(
        self,
        info: RequestInfo,
        exclude: Collection[str] = (),
        *,
        prefill: bool = False,
        hold: Held | None = None,
        only: Collection[str] = (),
        over_gate: bool = False,
    ) -> RoutingView:
        """The snapshot for one decision: the request's candidates (`candidates`), or `only` those replicas; with
        each one's latency model for a policy that prices in seconds, the request's own `hold` (admission's) left
        out. `over_gate`: the replicas' capacity gates left out (`choose`)."""
        now = time.monotonic()
        replicas: Sequence[Replica]
        if only:
            replicas = [r for rid in only if (r := self.replicas.get(rid)) is not None and rid not in exclude]
        else:
            replicas = self.candidates(info, prefill=prefill, exclude=exclude, over_gate=over_gate)
        snaps = tuple([r.snapshot(now) for r in replicas])
        if over_gate:
            snaps = tuple([s._replace(max_concurrency=None) for s in snaps])
        overlap: Mapping[str, int] = EMPTY_MAPPING
        footprint: Mapping[str, Footprint] = EMPTY_MAPPING
        offloaded: Mapping[str, int] = EMPTY_MAPPING
        session = None
        if self.cache is not None:
            if info.block_hashes:
                ids = [s.id for s in snaps]
                overlap = self.cache.overlap(info, ids)
                offloaded = self.cache.offloaded(info, overlap)
                footprint = self.cache.footprint(info, ids)
            session = self.cache.session_replica(info)
        latency: Mapping[str, ReplicaLatency] = EMPTY_MAPPING
        if getattr(self.policy, "uses_latency", False):
            latency = {r.id: r.latency_view(hold) for r in replicas}
        self._seq += 1
        return RoutingView(info, snaps, overlap, session, self._seq, footprint, offloaded, latency, now)

    def candidates(
        self, info: RequestInfo, *, prefill: bool = False, exclude: Collection[str] = (), over_gate: bool = False
    ) -> Sequence[Replica]:
        """The replicas a decision on the request weighs: the model's that answer whole requests (roles both,
        decode), or with `prefill` its prefill replicas (the first step of a disaggregated request); less `exclude`.
        With the cache hooks, over a pool of more than `max_candidates` a bounded subset (`_candidates`), and of
        those at most `max_weighed` finalists (`policies.filters.finalists`), so a decision costs about the same on
        4 replicas as on 1,024. Admission's verdict weighs the same set."""
        replicas = self.replicas.for_model(info.model)
        if prefill or (replicas and self.replicas.disaggregated(info.model)):
            return [r for r in replicas if (r.role == "prefill") == prefill and r.id not in exclude]
        if self.cache is not None and len(replicas) > self.max_candidates:
            replicas = self._candidates(info, replicas)
        if exclude:
            replicas = [r for r in replicas if r.id not in exclude]
        if self.cache is not None and len(replicas) > self.max_weighed:
            replicas = self._finalists(info, replicas, over_gate)
        return replicas

    def _candidates(self, info: RequestInfo, replicas: Sequence[Replica]) -> list[Replica]:
        """A bounded subset of a large pool: the session's replica, the holders of the prompt's first block (as
        many as leave room for the sample), then a random sample of the rest."""
        assert self.cache is not None
        chosen: dict[str, Replica] = {}
        session = self.cache.session_replica(info)
        for rid in ([session] if session else []) + self.cache.holders(info):
            r = self.replicas.get(rid)
            if r is not None and (r.model == info.model or info.model in r.adapters):
                chosen[rid] = r
                if len(chosen) >= self.max_candidates - _MIN_SAMPLE:
                    break
        # seeded by the request where its info is its own (numbered): admission's verdict and the route then weigh
        # the same replicas and share one lookup of each
        seed = info.request_id or self._rng.getrandbits(64)
        for r in sample(replicas, min(len(replicas), self.max_candidates - len(chosen)), seed):
            chosen.setdefault(r.id, r)
        return list(chosen.values())

    def _finalists(self, info: RequestInfo, replicas: Sequence[Replica], over_gate: bool) -> list[Replica]:
        """The candidates' finalists, from their snapshots, the prompt's overlap with each (one walk of the index,
        which the verdict and the route then share) and their room."""
        assert self.cache is not None
        now = time.monotonic()
        snaps = [r.snapshot(now) for r in replicas]
        if over_gate:
            snaps = [s._replace(max_concurrency=None) for s in snaps]
        overlap: Mapping[str, int] = EMPTY_MAPPING
        room: Mapping[str, int] = EMPTY_MAPPING
        if info.block_hashes:
            ids = [s.id for s in snaps]
            overlap = self.cache.overlap(info, ids)
            if offloaded := self.cache.offloaded(info, overlap):
                overlap = {rid: n + offloaded.get(rid, 0) for rid, n in overlap.items()}
            room = self.cache.room(ids)
        seed = info.request_id or self._rng.getrandbits(64)
        kept = set(finalists(snaps, overlap, self.cache.session_replica(info), self.max_weighed, seed, room))
        return [r for r in replicas if r.id in kept]

    def _takes(
        self, rid: str, view: RoutingView, exclude: Collection[str], only: Collection[str], over_gate: bool
    ) -> bool:
        """Whether replica `rid` may take the request of `view`: one of its routable replicas, or (the finalists
        being a few of the candidates) a replica of its model that could have been one."""
        if any(r.id == rid for r in routable(view.replicas)):
            return True
        r = self.replicas.get(rid)
        if r is None or rid in exclude or (only and rid not in only) or r.role == "prefill":
            return False
        model = view.request.model
        if r.model != model and model not in r.adapters:
            return False
        snap = r.snapshot(view.now)
        return takes(snap._replace(max_concurrency=None) if over_gate else snap)

    def cached_tokens(self, info: RequestInfo, replica_ids: Sequence[str]) -> Mapping[str, int]:
        """Per replica, the prompt tokens the prefix index predicts it holds (absent: none or not known)."""
        if self.cache is None or not info.block_hashes or not replica_ids:
            return EMPTY_MAPPING
        return {rid: n * info.block_size for rid, n in self.cache.overlap(info, replica_ids).items()}

    def split(self, info: RequestInfo, prompt_tokens: int, min_prefill_tokens: int) -> Split:
        """Whether the request's prefill runs on a prefill replica (`policies.disagg`)."""
        decode = self.view(info)
        prefill = self.view(info, prefill=True)
        block_size = info.block_size if info.block_hashes else 0
        return split(
            prompt_tokens, block_size, prefill.replicas, decode.replicas, decode.overlap,
            min_prefill_tokens=min_prefill_tokens,
        )  # fmt: skip

    async def choose(
        self,
        info: RequestInfo,
        exclude: Collection[str] = (),
        *,
        prefill: bool = False,
        hold: Held | None = None,
        only: Collection[str] = (),
        over_gate: bool = False,
        tentative: bool = False,
    ) -> tuple[Replica, Decision]:
        """Route now (among `only` when given), or raise Overloaded (503 + Retry-After) when no replica of the model
        can take it (counted as a rejected decision unless `tentative`: the caller then tries again more widely). A
        prefix placed cold may go where another gateway just placed it instead (`CacheHooks.claim_cold`), whether
        or not it was among the replicas weighed. `over_gate`: replicas at their capacity gate count too (an
        admitted stream whose engine failed continues: the dead replica's place is what it takes)."""
        view = self.view(info, exclude, prefill=prefill, hold=hold, only=only, over_gate=over_gate)
        try:
            decision = self.policy.decide(view)
        except NoCandidate as exc:
            if not tentative:
                self.metrics.decisions.labels(self.policy.name, f"rejected:{exc.reason}").inc()
            raise Overloaded(
                f"no replica of model {info.model!r} can take the request now", code="no_ready_replica"
            ) from None
        if decision.reason == "cold-least-load" and self.cache is not None:
            claimed = await self.cache.claim_cold(info, decision.replica)
            if claimed != decision.replica and self._takes(claimed, view, exclude, only, over_gate):
                decision = Decision(claimed, "fleet-claim", decision.scores, decision.seconds)
        replica = self.replicas.get(decision.replica)
        if replica is None:  # a policy may only pick from the view; this is a policy bug
            raise RuntimeError(f"policy {self.policy.name} picked unknown replica {decision.replica!r}")
        self.metrics.decisions.labels(self.policy.name, decision.reason).inc()
        if decision.seconds:
            self.metrics.decisions_in_seconds.labels(self.policy.name).inc()
        if self.cache is not None:
            self.cache.on_routed(info, decision)
        return replica, decision
