"""Where to load a LoRA adapter that no ready replica holds (vLLM's runtime LoRA API), and what it displaces.

`place_adapter` is a pure function of the base model's replicas, the adapters each holds and when each adapter was
last asked for. It prefers a replica with a free adapter slot, then the least loaded; on a replica whose slots are
all taken it unloads the adapter asked for least recently (the engine keeps serving requests already running with
it: vLLM's unload only forgets the name). Adapters kvgate cannot load again (not in its catalog: loaded by someone
else, or from the engine's command line) are never chosen to leave, and a replica whose slots they fill all is
used only when no other can take the adapter. O(r x a) for r replicas holding a adapters each.

`replica_to_add` is the residency term for a hot adapter: when every replica holding it has at least `threshold`
requests outstanding (its own queue) and a replica of the base model with a free slot has fewer, the adapter is
loaded there too, so its requests stop queueing behind one another while other replicas idle. O(r).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from policies.base import ReplicaState
from policies.filters import routable


@dataclass(frozen=True, slots=True)
class AdapterPlacement:
    replica: str
    evict: str | None  # the adapter to unload first to free a slot, or None
    reason: str  # "free-slot", "evict-lru", "over-slots"


def place_adapter(
    replicas: Sequence[ReplicaState],
    resident: Mapping[str, Collection[str]],
    *,
    slots: int,
    last_used: Mapping[str, float],
    loadable: Collection[str],
) -> AdapterPlacement | None:
    """The replica to load an adapter on (None when no replica can take a request now). `resident`: replica id ->
    the adapters it holds; `slots`: adapters a replica holds at most; `last_used`: adapter -> when it was last asked
    for (never asked: 0); `loadable`: the adapters kvgate can load again (its catalog)."""
    candidates = routable(replicas)
    if not candidates:
        return None
    free = [r for r in candidates if len(resident.get(r.id, ())) < slots]
    if free:
        best = min(free, key=lambda r: (r.load, len(resident.get(r.id, ()))))
        return AdapterPlacement(best.id, None, "free-slot")
    victims: dict[str, str] = {}
    for r in candidates:
        evictable = [a for a in resident.get(r.id, ()) if a in loadable]
        if evictable:
            victims[r.id] = min(evictable, key=lambda a: (last_used.get(a, 0.0), a))
    if victims:
        with_victim = [r for r in candidates if r.id in victims]
        best = min(with_victim, key=lambda r: (r.load, last_used.get(victims[r.id], 0.0)))
        return AdapterPlacement(best.id, victims[best.id], "evict-lru")
    return AdapterPlacement(min(candidates, key=lambda r: r.load).id, None, "over-slots")


def replica_to_add(
    holders: Sequence[ReplicaState],
    others: Sequence[ReplicaState],
    resident: Mapping[str, Collection[str]],
    *,
    slots: int,
    threshold: int,
) -> str | None:
    """Another replica (of `others`, the base model's replicas without the adapter) to load a hot adapter on, or
    None: only when every holder has `threshold` requests outstanding or more, onto a free slot (never evicting)."""
    ready = routable(holders)
    if not ready or min(r.load for r in ready) < threshold:
        return None
    free = [r for r in routable(others) if len(resident.get(r.id, ())) < slots and r.load < threshold]
    return min(free, key=lambda r: r.load).id if free else None
