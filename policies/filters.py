"""The candidate filter every policy applies first, and the finalists a large pool's decision weighs in full.

`routable`: O(n) over the candidates; keeps their order. `finalists`: O(n log n) over the candidates (two sorts of
at most `routing.max_candidates` snapshots)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from policies.base import EMPTY_MAPPING, ReplicaState
from policies.saturation import not_saturated


def routable(replicas: Iterable[ReplicaState]) -> list[ReplicaState]:
    """Ready, not draining, below its capacity gate (when it has one); saturated replicas only when every candidate
    is saturated (the admission queue in front keeps that case rare)."""
    candidates = [
        r
        for r in replicas
        if r.ready and not r.draining and (r.max_concurrency is None or r.in_flight < r.max_concurrency)
    ]
    return not_saturated(candidates) or candidates


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
    order = {r.id: (i - start) % n for i, r in enumerate(ready)}
    chosen: dict[str, None] = {}
    if session is not None and session in order:
        chosen[session] = None
    holders = [r for r in ready if overlap.get(r.id, 0) > 0]
    holders.sort(key=lambda r: (-overlap[r.id], r.load, order[r.id]))
    for r in holders:
        if len(chosen) >= (k + 1) // 2:
            break
        chosen[r.id] = None
    by_load = sorted(ready, key=lambda r: (r.load, -overlap.get(r.id, 0), order[r.id]))
    by_room = sorted(ready, key=lambda r: (-room.get(r.id, 0), r.load, order[r.id])) if room else by_load
    for pair in zip(by_load, by_room, strict=True):
        for r in pair:
            if len(chosen) >= k:
                return list(chosen)
            chosen[r.id] = None
    return list(chosen)
