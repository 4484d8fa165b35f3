"""Predicted latency of one more request on a replica, and the admission verdict that follows: pure functions of
literal snapshots (the learning is `engine_pool.latency`; the async shell is `gateway.admission.targets`).

Model (per replica):
- time to first token = wait for KV room + overhead + prefill seconds per token x the request's uncached tokens;
- wait for KV room: every request the gateway has on the replica holds `tokens` of KV (its uncached prompt there +
  output) until its predicted end, and pins the prompt blocks it found cached there (`cached` tokens, up to its
  deepest cached block, `prefix`): a running request's cached blocks cannot be evicted, but requests that found the
  same run cached (a shared system prompt) pin one copy, as vLLM's prefix cache and the simulator share it. The KV
  in use is the held tokens plus each distinct pinned run once; the new request's tokens (and its own run, where no
  held request pins it yet) fit when that plus its own <= the replica's KV capacity (vLLM's scheduler runs a
  request only when its blocks fit beside the running ones); otherwise it waits until enough of the held requests
  have ended, taken in the order of their predicted ends (a pinned run is freed with the last of its holders; one
  that has run `d` past its predicted end is expected to need `d` more: a model that knows nothing yet, whose
  requests all look overdue at once, still sees the KV fill during a first burst). This is the knee: it moves with
  context length by itself. Counting only uncached tokens made a replica whose agents each resumed a private 13k
  history look nearly empty (their histories were evicted by each other: a fifth fewer cache hits); counting every
  cached prompt whole made a burst on one shared system prompt look twenty times its size;
- time per output token = the decode step at the batch the request joins: step + per-sequence cost x batch;
- plus a margin: how late this replica's first tokens recently came against their predictions (what the model does
  not see: the gateway's own queueing, a busy machine, other gateways' requests), so admitted requests keep their
  target at a high quantile, not only on average.
A capacity that is not known (an engine that does not publish it) never makes a request wait.

Verdict: admit where some replica is predicted to meet the targets, or where the request need not wait at all (its
own prefill may be longer than its target: no replica can do better, so it is served, not refused); otherwise
refuse, with the time until room is predicted (the drain) as `retry_after_s`.
Cost: O(k) per replica for its k held requests when the new one fits at once, O(k log k) when it must wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class Held:
    """A request the gateway has on a replica: the KV it holds at most and when it is predicted to end; the cached
    prompt run it pins there (`cached` tokens ending at the block `prefix`; 0: none), shared with its other holders."""

    tokens: int
    ends_at: float
    prefix: int = 0
    cached: int = 0


@dataclass(frozen=True, slots=True)
class ReplicaLatency:
    """What is known of one replica's speed and what it holds (times in seconds)."""

    replica: str
    kv_tokens: int | None  # KV capacity in tokens; None: not known
    held: tuple[Held, ...]
    overhead_s: float  # time to first token of a request that computes nothing
    prefill_s_per_token: float
    step_s: float  # the fixed part of a decode step
    step_per_seq_s: float  # what each sequence in the batch adds to the step
    margin_s: float = 0.0  # how late this replica's first tokens came against their predictions (a high quantile)
    decode_learned: bool = True  # False: the decode terms are a prior (the engine's counters), never a refusal
    mean_output: float = 0.0  # the mean output tokens of its answers (before any, the engine's mean); 0: not known


class Prediction(NamedTuple):
    """One request on one replica (a NamedTuple: built per candidate and request, in a third of a frozen
    dataclass's time)."""

    replica: str
    wait_s: float  # for KV room
    ttft_s: float
    tpot_s: float
    batch: int  # the batch it would join, itself included
    margin_s: float = 0.0  # included in ttft_s: the replica's recent prediction error
    tokens: int = 0  # the KV it would hold there
    decode_learned: bool = True  # False: tpot_s comes from a prior, not from this replica's answers
    prefix: int = 0  # the cached prompt run it would pin there (`Held`)
    cached: int = 0


@dataclass(frozen=True, slots=True)
class Targets:
    """A request's latency targets in seconds (None: none)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def looser(self, ttft_s: float | None, tpot_s: float | None) -> Targets:
        """These targets, with any of the given ones that is looser (a request may ask for less, never more)."""
        return Targets(
            ttft_s if ttft_s is not None and (self.ttft_s is None or ttft_s > self.ttft_s) else self.ttft_s,
            tpot_s if tpot_s is not None and (self.tpot_s is None or tpot_s > self.tpot_s) else self.tpot_s,
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    admit: bool
    reason: str  # within-target, no-wait, ttft-target, tpot-target, no-replica
    retry_after_s: float  # when refused: the predicted time until a replica has room
    best: Prediction | None  # the lowest predicted time to first token among the replicas that meet the targets
    prefer: tuple[str, ...]  # where to route it first: () = anywhere (see `judge`)
    predictions: tuple[Prediction, ...] = ()  # on every replica weighed: the one it is routed to holds its own


def expected_end(h: Held, now: float) -> float:
    """When a held request is expected to end: its predicted end, or, once it has run `d` past that (the model was
    optimistic, or knew nothing yet), `d` from now: it is not over until it ends."""
    return h.ends_at if h.ends_at > now else 2 * now - h.ends_at


def pinned_prefix(block_hashes: Sequence[int], block_size: int, cached: int) -> int:
    """The key of the cached run a request pins on a replica holding `cached` tokens of its prompt (its blocks'
    chained hashes): its deepest cached block's hash (0: none)."""
    n = cached // block_size if block_size else 0
    return (block_hashes[n - 1] or 1) if 0 < n <= len(block_hashes) else 0


def _pinned(held: Sequence[Held]) -> dict[int, int]:
    """The cached runs the held requests pin, each once: prefix -> its tokens."""
    pinned: dict[int, int] = {}
    for h in held:
        if h.prefix and h.cached > pinned.get(h.prefix, 0):
            pinned[h.prefix] = h.cached
    return pinned


def room_wait(
    kv_tokens: int | None, held: Sequence[Held], tokens: int, now: float, prefix: int = 0, cached: int = 0
) -> float:
    """Seconds until `tokens` more, and the cached run `prefix` of `cached` tokens where no held request pins it
    yet, fit beside `held` in `kv_tokens` of KV."""
    if kv_tokens is None:
        return 0.0
    pinned = _pinned(held) if held else {}
    own = max(0, cached - pinned.get(prefix, 0)) if prefix else 0
    excess = sum(h.tokens for h in held) + sum(pinned.values()) + min(tokens + own, kv_tokens) - kv_tokens
    if excess <= 0:
        return 0.0
    last = {h.prefix: h for h in sorted(held, key=lambda h: expected_end(h, now)) if h.prefix}  # frees its run
    freed = sorted(
        (expected_end(h, now), h.tokens + (pinned[h.prefix] if h.prefix and last[h.prefix] is h else 0)) for h in held
    )
    for end, size in freed:
        excess -= size
        if excess <= 0:
            return max(0.0, end - now)
    return 0.0  # unreachable: the held requests' tokens cover the excess


def predict(r: ReplicaLatency, now: float, tokens: int, uncached: int, prefix: int = 0, cached: int = 0) -> Prediction:
    """The request (`tokens` of KV in all, `uncached` of its prompt to compute, the cached run `prefix` of `cached`
    tokens pinned) on replica `r` now."""
    wait = room_wait(r.kv_tokens, r.held, tokens, now, prefix, cached)
    ttft = wait + r.overhead_s + r.prefill_s_per_token * max(0, uncached) + r.margin_s
    batch = len(r.held) + 1
    tpot = r.step_s + r.step_per_seq_s * batch
    return Prediction(r.replica, wait, ttft, tpot, batch, r.margin_s, tokens, r.decode_learned, prefix, cached)


def _prefer(
    no_wait: Sequence[Prediction],
    best: Prediction,
    predictions: Sequence[Prediction],
    fast_enough: Sequence[Prediction],
) -> tuple[str, ...]:
    """Where routing should look first: nowhere in particular while every replica has KV room (the routing policy
    weighs cache against load); when some have none, the replicas with room and those that must wait but are
    still predicted to answer no later than the soonest with room (a cached prefix outweighs a short wait: what the
    policy does not see is the room); the one predicted first when all must wait (its prediction counts its cached
    prefix; elsewhere the request waits longer than it was admitted for)."""
    if len(no_wait) == len(predictions):
        return ()
    if not no_wait:
        return (best.replica,)
    soonest = min(p.ttft_s for p in no_wait)  # a replica that must wait but still answers first (its cached prefix)
    return tuple(p.replica for p in fast_enough if p.wait_s == 0.0 or p.ttft_s <= soonest)


def judge(predictions: Sequence[Prediction], targets: Targets) -> Verdict:
    """Admit or refuse a request given its predictions on the replicas that may serve it."""
    if not predictions:
        return Verdict(False, "no-replica", 1.0, None, ())
    # a replica with nothing else to decode is as fast as the engine gets, and a decode speed not yet learned from
    # answers is a guess: neither is a reason to refuse
    fast_enough = [
        p
        for p in predictions
        if targets.tpot_s is None or p.tpot_s <= targets.tpot_s or p.batch == 1 or not p.decode_learned
    ]
    meeting = [p for p in fast_enough if targets.ttft_s is None or p.ttft_s <= targets.ttft_s]
    no_wait = [p for p in fast_enough if p.wait_s == 0.0]
    if meeting:
        best = min(meeting, key=lambda p: p.ttft_s)
        prefer = _prefer(no_wait, best, predictions, fast_enough)
        return Verdict(True, "within-target", 0.0, best, prefer, tuple(predictions))
    if no_wait:  # its own prefill is longer than the target: nowhere better than where it starts at once
        best = min(no_wait, key=lambda p: p.ttft_s)
        return Verdict(True, "no-wait", 0.0, best, _prefer(no_wait, best, predictions, fast_enough), tuple(predictions))
    if not fast_enough:
        return Verdict(False, "tpot-target", 1.0, None, ())
    drain = min(p.wait_s for p in fast_enough)
    return Verdict(False, "ttft-target", drain, None, ())
