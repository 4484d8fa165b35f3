"""Routing state shared by several gateways through Redis, so that N gateways behind a balancer route as one.

What is shared is what a gateway learns from its own routing: the prompt blocks it sent to a replica (the
speculative inserts of the approximate index, which is all there is for engines without KV events) and session
bindings. KV events need no sharing: every gateway subscribes to every engine.

- Publish: `publish` (called from `CacheAwareState.on_routed`) appends the decision to a bounded buffer (O(1));
  one task sends the buffer every `flush_ms` as one pub/sub message (JSON: this gateway's id and
  `[replica, block hashes, session digest]` per decision) and, in the same pipeline, `SET`s each session binding
  at `<prefix>:session:<digest>` with the session TTL. A full buffer drops its oldest decision (counted).
- Apply: one task reads the channel and hands the other gateways' decisions to `CacheAwareState.apply_shared`
  (O(prompt blocks) each); its own are skipped.
- Sessions a gateway has not heard of: while it has not been subscribed for a whole session TTL (just started,
  or after losing Redis) a binding may predate its subscription, so a local miss asks Redis (`GET`, bounded by
  `timeout_s`); after that, every live binding reached it through the channel and a miss costs nothing.
- Failure: Redis errors never fail a request. Decisions that cannot be sent are dropped and counted; both tasks
  reconnect with exponential backoff up to `reconnect_max_s`, and the session lookups resume until the
  subscription has again lasted a TTL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import deque
from collections.abc import Sequence

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.exceptions import RedisError

from gateway.config import FleetConfig
from policies.prefix.state import CacheAwareState

log = logging.getLogger("kvgate.fleet")

_MIN_BACKOFF_S = 0.05


class FleetMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "kvgate_fleet_decisions_total",
            "Routing decisions shared with the other gateways: published (this gateway's, sent), applied (theirs, "
            "learned here), dropped (this gateway's, not sent: Redis down or the buffer full)",
            ["outcome"],
            registry=registry,
        )
        self.connected = Gauge(
            "kvgate_fleet_connected", "1 while subscribed to the shared routing channel", registry=registry
        )
        self.session_lookups = Counter(
            "kvgate_fleet_session_lookups_total",
            "Sessions unknown here looked up in Redis (found, missing, error)",
            ["outcome"],
            registry=registry,
        )


class RoutingShare:
    def __init__(self, config: FleetConfig, url: str, state: CacheAwareState, registry: CollectorRegistry) -> None:
        self.config = config
        self.state = state
        self.metrics = FleetMetrics(registry)
        self.gateway_id = os.urandom(8).hex()
        self._session_ttl = max(1, round(state.config.session_ttl_s))
        self._pending: deque[tuple[str, Sequence[int], bytes | None]] = deque(maxlen=config.max_pending)
        self._wake = asyncio.Event()
        timeout = config.timeout_s
        self._client = aioredis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        # the subscription idles between messages: no read timeout on its connection
        self._sub_client = aioredis.Redis.from_url(url, socket_connect_timeout=timeout)
        self._subscribed_since: float | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def _session_key(self, digest: bytes) -> str:
        return f"{self.config.key_prefix}:session:{digest.hex()}"

    # --- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [
            asyncio.get_running_loop().create_task(self._send_loop(), name="fleet:send"),
            asyncio.get_running_loop().create_task(self._listen_loop(), name="fleet:listen"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self._client.aclose()
        await self._sub_client.aclose()

    def subscribed(self) -> bool:
        return self._subscribed_since is not None

    # --- SharedRouting ----------------------------------------------------------------------------------------
    def publish(self, replica: str, hashes: Sequence[int], session: bytes | None) -> None:
        if len(self._pending) == self._pending.maxlen:
            self.metrics.decisions.labels("dropped").inc()
        self._pending.append((replica, hashes, session))
        self._wake.set()

    async def session_replica(self, session: bytes) -> str | None:
        since = self._subscribed_since
        if since is not None and time.monotonic() - since > self._session_ttl:
            return None  # every live binding came through the channel
        try:
            value = await self._client.get(self._session_key(session))
        except (RedisError, OSError):
            self.metrics.session_lookups.labels("error").inc()
            return None
        self.metrics.session_lookups.labels("missing" if value is None else "found").inc()
        return None if value is None else value.decode() if isinstance(value, bytes) else str(value)

    # --- tasks ------------------------------------------------------------------------------------------------
    def _backoff(self, delay: float) -> float:
        return min(max(delay * 2, _MIN_BACKOFF_S), self.config.reconnect_max_s)

    async def _send_loop(self) -> None:
        delay = 0.0
        while True:
            await self._wake.wait()
            if self.config.flush_ms:
                await asyncio.sleep(self.config.flush_ms / 1000)
            self._wake.clear()
            batch = list(self._pending)
            self._pending.clear()
            message = json.dumps(
                {"g": self.gateway_id, "d": [[r, list(h), s.hex() if s else None] for r, h, s in batch]},
                separators=(",", ":"),
            )
            try:
                async with self._client.pipeline(transaction=False) as pipe:
                    pipe.publish(self.config.channel, message)
                    for replica, _, session in batch:
                        if session is not None:
                            pipe.set(self._session_key(session), replica, ex=self._session_ttl)
                    await pipe.execute()
            except (RedisError, OSError) as exc:
                self.metrics.decisions.labels("dropped").inc(len(batch))
                if not delay:
                    log.warning("could not publish routing decisions to the other gateways: %r", exc)
                delay = self._backoff(delay)
                await asyncio.sleep(delay)
                continue
            delay = 0.0
            self.metrics.decisions.labels("published").inc(len(batch))

    async def _listen_loop(self) -> None:
        delay = 0.0
        while True:
            try:
                async with self._sub_client.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self.config.channel)
                    self._subscribed_since = time.monotonic()
                    self.metrics.connected.set(1)
                    if delay:
                        log.info("shared routing channel subscribed again")
                    delay = 0.0
                    while True:
                        message = await pubsub.get_message(timeout=1.0)
                        if message is not None:
                            self._apply(message["data"])
            except (RedisError, OSError) as exc:
                if self._subscribed_since is not None or not delay:
                    log.warning("lost the shared routing channel: %r", exc)
                self._subscribed_since = None
                self.metrics.connected.set(0)
                delay = self._backoff(delay)
                await asyncio.sleep(delay)

    def _apply(self, data: bytes) -> None:
        try:
            message = json.loads(data)
            if message["g"] == self.gateway_id:
                return
            decisions = [
                (str(r), [int(h) for h in hashes], bytes.fromhex(s) if s else None) for r, hashes, s in message["d"]
            ]
        except (ValueError, KeyError, TypeError) as exc:
            log.debug("ignoring a malformed routing message: %r", exc)
            return
        for replica, hashes, session in decisions:
            self.state.apply_shared(replica, hashes, session)
        self.metrics.decisions.labels("applied").inc(len(decisions))


def shared_redis_url(config: FleetConfig, admission_redis_url: str | None) -> str | None:
    """Where the routing state is shared, or None when it is not."""
    if not config.share_routing:
        return None
    return config.redis_url or admission_redis_url
