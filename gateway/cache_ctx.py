"""Wires the prefix-cache state (tokenizers, KV block index, KV events, sessions) to the replica set.

Only built when the routing policy consumes prefix overlap (`uses_prefix_cache`). A replica coming up is
registered with its block size and KV capacity as its engine reports them (`vllm:cache_config_info`), falling back to
the config; a replica going down or removed forgets its entries (a restarted engine starts with an empty cache).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from engine_pool.replica import Replica
from gateway.keys import CACHE, CONFIG, REGISTRY, REPLICAS
from policies.prefix.state import CacheAwareState
from policies.registry import build_policy


class CacheReplicaListener:
    def __init__(self, state: CacheAwareState, default_block_size: int) -> None:
        self.state = state
        self.default_block_size = default_block_size

    def replica_up(self, replica: Replica) -> None:
        self.state.remove_replica(replica.id)
        self.state.add_replica(
            replica.id,
            model=replica.model or "",
            block_size=replica.metrics.block_size or self.default_block_size,
            num_blocks=replica.metrics.num_blocks,
            kv_events_endpoint=replica.kv_events_endpoint,
            kv_events_replay_endpoint=replica.kv_events_replay_endpoint,
            tokenizer=replica.tokenizer,
        )

    def replica_down(self, replica: Replica) -> None:
        self.state.remove_replica(replica.id)

    def replica_removed(self, replica: Replica) -> None:
        self.state.remove_replica(replica.id)


def policy_uses_prefix_cache(app: web.Application) -> bool:
    cfg = app[CONFIG]
    return bool(getattr(build_policy(cfg.routing.policy, cfg.routing.params), "uses_prefix_cache", False))


async def cache_ctx(app: web.Application) -> AsyncIterator[None]:
    if not policy_uses_prefix_cache(app):
        yield
        return
    cfg = app[CONFIG]
    state = CacheAwareState(cfg.cache, app[REGISTRY])
    app[CACHE] = state
    await state.start()
    listener = CacheReplicaListener(state, cfg.cache.default_block_size)
    app[REPLICAS].add_listener(listener)
    for replica in app[REPLICAS]:
        if replica.healthy:
            listener.replica_up(replica)
    try:
        yield
    finally:
        await state.stop()
