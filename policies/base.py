"""Routing contracts: the snapshot a policy sees, the stages it is built from, and the decision it returns.

A routing decision is a pure function of a `RoutingView` (a frozen snapshot of the candidate replicas, what the
gateway knows of their caches, and the request): `Policy.decide(view) -> Decision`. Only the async shell in
`gateway.router` gathers the snapshot, calls the policy and records metrics, so every policy is testable with
literal values.

Every policy implements `Policy` as plain steps in one function: filter the candidates (`policies.filters.routable`:
ready, not draining, below their gate), then pick (round-robin, least load), or, for cache-aware, cost each
candidate by a model (normalised into `Decision.scores`) and take the cheapest.
The per-decision records are NamedTuples: immutable like frozen dataclasses, and built in a third of the time
(one per candidate replica and request on the hot path).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from policies.latency import ReplicaLatency

Role = Literal["both", "prefill", "decode"]  # disaggregated serving: which step a replica takes


class ReplicaState(NamedTuple):
    """Everything a policy may know about one replica at decision time."""

    id: str
    model: str
    ready: bool = True
    in_flight: int = 0  # requests the gateway has sent and not yet finished
    # engine-reported vllm:num_requests_running / _waiting at the last scrape, less the requests the gateway has
    # seen finish since that scrape (they were counted in it)
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # engine-reported vllm:kv_cache_usage_perc, in [0, 1]
    max_concurrency: int | None = None  # capacity gate; None = unlimited
    max_num_seqs: int | None = None  # the engine's batch slots (vLLM --max-num-seqs); None = unknown
    metrics_age_s: float = 0.0  # seconds since the engine metrics were scraped (inf = never)
    draining: bool = False
    # one more outstanding request's cost in prompt tokens, learned from the engine's metrics
    # (policies.queue_price); None until known
    queue_price: float | None = None

    @property
    def load(self) -> int:
        """Outstanding work as the gateway sees it: its own in-flight count or the engine's queue, whichever is
        larger (the engine also counts requests of other gateways)."""
        return max(self.in_flight, self.running + self.waiting)


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a policy may know about the request being routed (a dataclass: the prefix state extends it)."""

    model: str
    prompt_tokens: int = 0  # estimated or exact prompt length in tokens
    block_hashes: tuple[int, ...] = ()  # chained prefix hashes of the prompt's full blocks
    block_size: int = 0  # tokens per block that block_hashes were computed with
    session_key: str | None = None
    tenant: str = "default"
    request_id: int = 0  # numbers the request where the info is its own (the prefix state's); 0: shared by requests


class Footprint(NamedTuple):
    """A replica's hot working set (distinct blocks routed there recently) against its KV capacity, in blocks, how
    many leading blocks of the request being routed are part of that working set (routed there recently, whether or
    not the engine still holds them), and the blocks of other sessions expected back there soon (their last answer
    was a tool call)."""

    hot_blocks: int
    capacity_blocks: int
    hot_overlap: int = 0
    awaited_blocks: int = 0


EMPTY_MAPPING: Mapping[str, Any] = MappingProxyType({})  # the empty default of the mapping fields below


class RoutingView(NamedTuple):
    """A frozen snapshot: the request, the candidate replicas and what the gateway knows of their caches."""

    request: RequestInfo
    replicas: tuple[ReplicaState, ...]
    # replica id -> number of leading blocks of request.block_hashes that replica is believed to hold
    overlap: Mapping[str, int] = EMPTY_MAPPING
    # replica id the request's session is bound to, if any
    session_replica: str | None = None
    # monotonically increasing per decision; policies use it instead of hidden counters or unseeded randomness
    seq: int = 0
    # replica id -> its hot footprint and capacity (cache-aware placement); absent = unknown
    footprint: Mapping[str, Footprint] = EMPTY_MAPPING
    # replica id -> blocks after its `overlap` run held by its offloading tier (CPU memory): loaded, not recomputed
    offloaded: Mapping[str, int] = EMPTY_MAPPING
    # replica id -> what its latency model has learned and what it holds (policies.latency), for a policy that
    # prices in predicted seconds (`uses_latency`); absent = not asked for
    latency: Mapping[str, ReplicaLatency] = EMPTY_MAPPING
    now: float = 0.0  # the monotonic clock of the snapshot (the held requests' predicted ends are on it)


class Decision(NamedTuple):
    replica: str
    reason: str  # short label: "round-robin", "least-load", "cache-hit", "cold-least-load", "session", ...
    scores: Mapping[str, float] = EMPTY_MAPPING
    seconds: bool = False  # the costs behind the scores were predicted seconds (cache-aware with learned speeds)


class NoCandidate(Exception):
    """Raised by a policy when no replica in the view can take the request."""

    def __init__(self, reason: str = "no-candidate") -> None:
        super().__init__(reason)
        self.reason = reason


class PolicyParams(BaseModel):
    """A policy's parameters (`routing.params`): typed, every name known, numbers not strings or booleans.
    Validated when the configuration loads; an error names its path (`routing.params.imbalance_cost: ...`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class NoParams(PolicyParams):
    """The policy takes no parameters."""


@runtime_checkable
class Policy(Protocol):
    name: str

    def decide(self, view: RoutingView) -> Decision:
        """Pick a replica from view.replicas; raise NoCandidate when none fits."""
        ...
