"""Wires the prefix-cache state (tokenizers, KV block index, KV events, sessions) to the replica set, and makes it
follow the routing policy.

The state is built at start-up whatever the policy (an index, a session table and metrics: no thread, socket or
task until started) and always knows the replicas: a replica coming up is registered with its block size and KV
capacity as its engine reports them (`vllm:cache_config_info`), falling back to the config; a replica going down or
removed forgets its entries (a restarted engine starts with an empty cache). It runs (KV-event subscribers,
tokenizer preloads, the tokenizer thread pool) only while the policy consumes prefix overlap (`uses_prefix_cache`),
and the router consults it only then. `PrefixCacheSwitch.follow(policy)` is called at start-up and by every reload:
switching to such a policy starts it; leaving it stops it and forgets what it knew (with no events read, it would
go stale). Cost of a switch: O(replicas).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from cacheindex.state import CacheAwareState
from engine_pool.replica import Replica
from engine_pool.replica_set import ReplicaSet
from gateway.config import RoutingConfig
from gateway.fleet import RoutingShare, shared_redis_url
from gateway.keys import CACHE, CONFIG, FLEET, REGISTRY, REPLICAS
from gateway.router import Router
from policies.base import Policy


class CacheReplicaListener:
    def __init__(self, state: CacheAwareState, default_block_size: int) -> None:
        self.state = state
        self.default_block_size = default_block_size

    def replica_up(self, replica: Replica) -> None:
        """Up, or its KV layout became known: registered anew (its index starts over), its sessions kept (a
        session placed there before the engine's first metrics stays there)."""
        self.state.remove_replica(replica.id, keep_sessions=True)
        self.state.add_replica(
            replica.id,
            model=replica.model or "",
            block_size=replica.metrics.block_size or replica.block_size or self.default_block_size,
            num_blocks=replica.metrics.num_blocks,
            kv_events_endpoint=replica.kv_events_endpoint,
            kv_events_replay_endpoint=replica.kv_events_replay_endpoint,
            kv_events_topic=replica.kv_events_topic,
            tokenizer=replica.tokenizer,
        )

    def replica_down(self, replica: Replica) -> None:
        self.state.remove_replica(replica.id)

    def replica_removed(self, replica: Replica) -> None:
        self.state.remove_replica(replica.id)
        self.state.metrics.forget_replica(replica.id)


def uses_prefix_cache(policy: Policy) -> bool:
    return bool(getattr(policy, "uses_prefix_cache", False))


class PrefixCacheSwitch:
    """Runs the cache state while the routing policy uses it (see the module docstring)."""

    def __init__(self, state: CacheAwareState, replicas: ReplicaSet, default_block_size: int) -> None:
        self.state = state
        self.replicas = replicas
        self.listener = CacheReplicaListener(state, default_block_size)
        replicas.add_listener(self.listener)
        self._register_healthy()

    def _register_healthy(self) -> None:
        for replica in self.replicas:
            if replica.healthy:
                self.listener.replica_up(replica)  # re-registering forgets what was known of its cache

    async def route_with(self, router: Router, policy: Policy, routing: RoutingConfig) -> None:
        """Make `router` decide with `policy`, the cache state running before a router consults it and stopped
        after none does."""
        uses = uses_prefix_cache(policy)
        if uses and not self.state.started:
            await self.state.start()
        cache = self.state if uses else None
        router.use(policy, cache, max_candidates=routing.max_candidates, max_weighed=routing.max_weighed)
        if not uses and self.state.started:
            await self.state.stop()
            self._register_healthy()

    async def close(self) -> None:
        if self.state.started:
            await self.state.stop()


async def cache_ctx(app: web.Application) -> AsyncIterator[None]:
    """The routing state shared with the other gateways, when a Redis is configured for it (gateway.fleet: routing
    decisions, sessions, stored-response holders), and the prefix-cache state, built with it: the state publishes
    through it, and it reads the other gateways' decisions into the state."""
    cfg = app[CONFIG]
    url = shared_redis_url(cfg.fleet, cfg.admission.redis.url if cfg.admission.redis is not None else None)
    share = RoutingShare(cfg.fleet, url, app[REGISTRY], session_ttl_s=cfg.cache.session_ttl_s) if url else None
    state = app[CACHE] = CacheAwareState(cfg.cache, app[REGISTRY], shared=share)  # the router consults it per policy
    switch = app[CACHE_SWITCH] = PrefixCacheSwitch(state, app[REPLICAS], cfg.cache.default_block_size)
    if share is not None:
        app[FLEET] = share
        share.start(state)
    try:
        yield
    finally:
        await switch.close()
        if share is not None:
            await share.close()


CACHE_SWITCH = web.AppKey("cache_switch", PrefixCacheSwitch)
