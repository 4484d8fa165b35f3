"""Applies one replica's decoded KV events to the index: what is stored and removed, on which tier.

Tiers by the event's `medium`: GPU (None, "GPU"; vLLM's own block pool) and CPU ("CPU"; vLLM's KV offloading
connector, LMCache's CPU backend). Other media ("STORAGE", ...) and events of other KV-cache groups than the
first (hybrid models' sliding-window groups) are counted as skipped; so are multimodal blocks (their extra keys
hold identifiers kvgate cannot predict) and stores whose parent the index cannot place. A root block's
`cache_salt` is read back from its extra keys so it re-hashes into the same context as the request. Cost: O(1) per
event plus the index's O(blocks) re-hashing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

from cacheindex.hashing import context_seed
from cacheindex.kv_events import AllBlocksClearedEvent, BlockRemovedEvent, BlockStoredEvent, KvEvent
from cacheindex.kv_index import KvIndex, StoredBlocks
from cacheindex.metrics import PrefixMetrics

log = logging.getLogger(__name__)

_GPU = frozenset({None, "GPU", "gpu"})
_CPU = frozenset({"CPU", "cpu"})


class ReplicaCache(Protocol):
    """What the sink needs of a registered replica: its model (the hash seed) and block size (corrected from the
    events when they disagree)."""

    model: str
    block_size: int


class KvEventApplier:
    def __init__(self, index: KvIndex, metrics: PrefixMetrics) -> None:
        self.index = index
        self.metrics = metrics
        self._warned_block_size: set[str] = set()

    def apply(self, replica_id: str, replica: ReplicaCache, events: Iterable[KvEvent]) -> None:
        m, index = self.metrics, self.index
        for ev in events:
            if isinstance(ev, BlockStoredEvent):
                reason = self._stored_skip_reason(replica_id, replica, ev)
                if reason is None:
                    salt, seed_name = None, ev.lora_name or replica.model
                    if ev.parent_block_hash is None and ev.extra_keys:
                        salt = _salt_of(ev.extra_keys[0], ev.lora_name)
                    stored = StoredBlocks(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size)
                    seed = context_seed(seed_name, None, salt)
                    if index.apply_stored(replica_id, stored, seed, offloaded=ev.medium in _CPU) < 0:
                        reason = "unknown-parent"
                if reason is not None:
                    m.events_skipped.labels(replica_id, reason).inc()
                    continue
                m.events.labels(replica_id, "BlockStored").inc()
            elif isinstance(ev, BlockRemovedEvent):
                if ev.group_idx not in (None, 0) or not (ev.medium in _GPU or ev.medium in _CPU):
                    continue
                index.apply_removed(replica_id, ev.block_hashes, offloaded=ev.medium in _CPU)
                m.events.labels(replica_id, "BlockRemoved").inc()
            elif isinstance(ev, AllBlocksClearedEvent):
                index.clear(replica_id)
                m.events.labels(replica_id, "AllBlocksCleared").inc()

    def _stored_skip_reason(self, replica_id: str, r: ReplicaCache, ev: BlockStoredEvent) -> str | None:
        if not (ev.medium in _GPU or ev.medium in _CPU):
            return "medium"
        if ev.group_idx not in (None, 0):
            return "group"
        if ev.extra_keys and any(_has_mm(k) for k in ev.extra_keys):
            return "multimodal"
        if ev.token_ids and ev.block_size != r.block_size and replica_id not in self._warned_block_size:
            self._warned_block_size.add(replica_id)
            log.warning(
                "replica %s publishes blocks of %d tokens but was registered with %d; using %d",
                replica_id, ev.block_size, r.block_size, ev.block_size,
            )  # fmt: skip
            r.block_size = ev.block_size
        return None


def _has_mm(keys: Any) -> bool:
    """Multimodal blocks carry (identifier, offset) pairs in their extra keys; kvgate cannot predict those."""
    return isinstance(keys, list | tuple) and any(isinstance(k, list | tuple) for k in keys)


def _salt_of(keys: Any, lora_name: str | None) -> str | None:
    """The cache_salt in a root block's extra keys: the first string after the LoRA name (when one is set)."""
    if not isinstance(keys, list | tuple):
        return None
    strings = [k for k in keys if isinstance(k, str)]
    if lora_name is not None and strings and strings[0] == lora_name:
        strings = strings[1:]
    return strings[0] if strings else None
