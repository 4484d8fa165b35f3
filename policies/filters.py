"""The candidate filter every policy applies first, and the finalists a large pool's decision weighs in full.

`routable`: O(n) over the candidates; keeps their order. `finalists`: O(n log n) over the candidates (two sorts of
at most `routing.max_candidates` snapshots)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from policies.base import EMPTY_MAPPING, ReplicaState
from policies.saturation import not_saturated, saturated


def _open(r: ReplicaState) -> bool:
    """Ready, not draining, below its capacity gate (when it has one)."""
    return r.ready and not r.draining and (r.max_concurrency is None or r.in_flight < r.max_concurrency)


def routable(replicas: Iterable[ReplicaState]) -> list[ReplicaState]:
    """The open replicas (`_open`); saturated ones only when every open candidate is saturated (the admission queue
    in front keeps that case rare)."""
    candidates = [r for r in replicas if _open(r)]
    return not_saturated(candidates) or candidates


def takes(replica: ReplicaState) -> bool:
    """Whether one replica may take a request now: open and not saturated."""
    return _open(replica) and not saturated(replica)


def finalists(
    replicas: Sequence[ReplicaState],
    overlap: Mapping[str, int],
    session: str | None,
    k: int,
    seed: int = 0,
    room: Mapping[str, int] = EMPTY_MAPPING,
) -> list[str]:
    """At most k of the routable candidates, for the full cost model (predictions, placement) to weigh, one axis of
    the decision at a time: the session's replica and the deepest holders of the prompt (up to half of k, the less
    loaded first among equal depths), then by turns the least loaded (the more of the prompt held first among equal
    loads) and those with the most `room` (KV blocks not taken by the recent working set: where a prompt no replica
    holds evicts the least; the less loaded first among equal rooms). What the cost model could still prefer among
    the rest is a replica behind the finalists on every axis. Remaining ties go by the candidates' order rotated by
    `seed` (the request's: an idle pool's cold prompts spread over all of it). All of them when k or fewer are
    routable."""
    ready = routable(replicas)
    n = len(ready)
    if n <= k:
        return [r.id for r in ready]
    start = seed % n
    ready = ready[start:] + ready[:start]  # the sorts below are stable: ties keep this order
    ids = [r.id for r in ready]
    loads = [r.load for r in ready]
    held = [overlap.get(rid, 0) for rid in ids]
    every = range(n)
    chosen: dict[str, None] = {}
    if session is not None and session in ids:
        chosen[session] = None
    half = (k + 1) // 2
    if len(chosen) < half:
        for j in sorted([j for j in every if held[j] > 0], key=lambda j: (-held[j], loads[j])):
            if len(chosen) >= half:
                break
            chosen[ids[j]] = None
    by_load = sorted(every, key=lambda j: (loads[j], -held[j]))
    if room:
        space = [room.get(rid, 0) for rid in ids]
        by_room = sorted(every, key=lambda j: (-space[j], loads[j]))
    else:
        by_room = by_load
    for pair in zip(by_load, by_room, strict=True):
        for j in pair:
            if len(chosen) >= k:
                return list(chosen)
            chosen[ids[j]] = None
    return list(chosen)
