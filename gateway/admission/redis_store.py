"""Quota store shared by several gateways through Redis: one Lua script per check and one per release.

Keys (a tenant's under its `{tenant}` hash tag, so they share a cluster slot):
  <prefix>:{t}:conc        sorted set lease_id -> expiry (ms, Redis clock); expired leases are dropped on check,
                           live ones renewed every lease_s/3 by the gateway that holds them, so a crashed gateway's
                           slots come back after at most lease_s; added back by it if Redis lost them (restarted
                           without persistence: found by the gateway's mark key missing, within lease_s/3)
  <prefix>:{t}:gone:<id>   a lease released before its check ran (the check's client left while Redis was slow,
                           and the release, on another connection, was run first): the check then grants nothing
                           and deletes it (expires after two leases)
  <prefix>:gateway:<id>    a gateway's mark, set with each renewal (expires after two leases)
  <prefix>:{t}:req:<min>   requests admitted in the clock minute (expires after 2 min): counted by the check,
                           taken out again by the release of a request that was not admitted after all
  <prefix>:{t}:tok:<min>   tokens charged in the clock minute (expires after 2 min)
  <prefix>:{t}:day:<day>   tokens charged in the UTC day (expires after 2 days)
Times come from Redis' TIME, so gateways with skewed clocks still share one window.

Failure policy: a command that fails on a connection is retried once on a fresh one (a pooled connection to a
restarted server fails once: that is not an outage); a second failure, or a command slower than its timeout, marks
the store down (metric, one warning log) and starts a reconnect task (PING with exponential backoff from
reconnect_min_s to reconnect_max_s). While down, checks never touch Redis: policy "open" answers from an in-process
`LocalQuotaStore` (each gateway enforces the limits alone, its requests still running on Redis leases counted
in them), "closed" refuses (503).
Recovery makes the shared counts exact again as the store is marked up: the releases of Redis leases that came
while it was down (and the lease of a check whose outcome was lost) are applied, the requests and tokens of the
local grants that finished while it was down are counted there (in the minute and day each was granted in, not the
one Redis came back in), and the live leases granted locally while it was
down are adopted into Redis (slot, request and tokens counted there; later renewed and released there like any
other), each in one script call per pass. Under traffic every pass finds the leases
granted (and released) during the one before, so the store is marked up after at most `_PASSES_BEFORE_UP` passes
(checks go to Redis from then on, so no more are granted locally) and the passes continue until none is left:
the counts miss at most the grants of one pass's round trip, for one more. (Waiting for a pass that finds nothing
kept a busy gateway down, its gauge at 0, for as long as its traffic lasted.) Memory: both tables are bounded by
the requests in flight during the outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway.admission.config import LimitsConfig, RedisConfig
from gateway.admission.local import LocalQuotaStore
from gateway.admission.metrics import AdmissionMetrics
from gateway.admission.quota import Lease, QuotaResult, limit_or_zero, token_window
from gateway.admission.redis_scripts import ADOPT, CHECK, RELEASE, RENEW
from kvcommon.backoff import Backoff

log = logging.getLogger("kvgate.admission.redis")

# What a Redis call raises when the server or the link is gone: redis-py's errors, the socket's, and uvloop's
# RuntimeError for a write to a transport that closed under the client (redis-py 8 writes its connection's
# health check before it notices the close: seen as a 500 in CI before it was listed here).
REDIS_ERRORS = (RedisError, OSError, TimeoutError, RuntimeError)
_PASSES_BEFORE_UP = 3  # reconciliation passes before the store is marked up (see the module header)


class RedisQuotaStore:
    name = "redis"

    def __init__(self, config: RedisConfig, metrics: AdmissionMetrics, *, max_tenants: int = 10_000) -> None:
        self.config = config
        self.metrics = metrics
        self.client: Any = aioredis.Redis.from_url(
            config.url,
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
            # once more on a fresh connection (a stale pooled one fails once), only where the command never ran: a
            # timeout is not retried (the scripts count: run twice, a request would be counted twice)
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            health_check_interval=0,
        )
        self._check = self.client.register_script(CHECK)
        self._release = self.client.register_script(RELEASE)
        self._renew = self.client.register_script(RENEW)
        self._adopt = self.client.register_script(ADOPT)
        self.fallback = LocalQuotaStore(max_tenants=max_tenants)
        self.up = True
        self._call_timeout_s = 2 * config.timeout_s  # the retry on a fresh connection included
        self._leases: dict[str, str] = {}  # lease_id -> tenant, for renewal; bounded by requests in flight
        # Redis lease -> (tenant, token delta, the minute to take its request out of or -1), while down
        self._unreleased: dict[str, tuple[str, int, int]] = {}
        self._granted_locally: dict[str, Lease] = {}  # live leases the fallback granted while down
        # (tenant, minute granted) -> [requests, tokens] of the local grants that finished while down (bounded by the
        # tenants and the outage's minutes)
        self._finished_locally: dict[tuple[str, int], list[int]] = {}
        self._adopting: set[str] = set()  # the live local leases a recovery pass is adopting now
        self._reconnect: asyncio.Task[None] | None = None
        self._giving_back: set[asyncio.Task[None]] = set()  # releases of leases whose request was cancelled
        self._renewer: asyncio.Task[None] | None = None
        # this gateway's mark in Redis, set with every renewal: found missing, Redis lost what the gateway wrote there
        # (a restart without persistence, a flush, an outage longer than two leases) and its live leases are put back
        self._mark = f"{config.key_prefix}:gateway:{secrets.token_hex(8)}"
        metrics.store_up.labels("redis").set(1)

    def start(self) -> None:
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew_loop(), name="kvgate:redis-lease-renew")

    async def check(self, tenant: str, limits: LimitsConfig, tokens: int, lease_id: str) -> QuotaResult:
        if self.up:
            args: list[str | int] = [
                self.config.key_prefix,
                tenant,
                limit_or_zero(limits.max_concurrency),
                limit_or_zero(limits.requests_per_minute),
                limit_or_zero(limits.tokens_per_minute),
                limit_or_zero(limits.tokens_per_day),
                tokens,
                lease_id,
                round(self.config.lease_s * 1000),
            ]
            try:
                async with asyncio.timeout(self._call_timeout_s):
                    raw = await self._check(args=args)
            except REDIS_ERRORS as exc:
                self._unreleased[lease_id] = (tenant, 0, -1)  # it may have been granted: undone on recovery
                self._mark_down(exc)
            except asyncio.CancelledError:  # the client left while Redis answered: a slot it may hold goes back
                self._give_back(tenant, lease_id)
                raise
            else:
                return self._result(tenant, limits, tokens, lease_id, raw)
        if self.config.failure_policy == "closed":
            self.metrics.store_fallbacks.labels("closed").inc()
            return QuotaResult(allowed=False, reason="store_unavailable", retry_after_s=self.config.reconnect_max_s)
        self.metrics.store_fallbacks.labels("open").inc()
        result = await self.fallback.check(tenant, limits, tokens, lease_id)
        if result.lease is not None:
            self._granted_locally[lease_id] = result.lease
        return result

    def _result(self, tenant: str, limits: LimitsConfig, tokens: int, lease_id: str, raw: list[Any]) -> QuotaResult:
        reason_raw, retry_ms, reqs, toks, to_min_ms, day_toks, to_day_ms, minute = raw
        reason = reason_raw.decode() if isinstance(reason_raw, bytes) else str(reason_raw)
        lease = None
        if not reason:
            lease = Lease(tenant, lease_id, tokens, self.name, int(minute))
            self._leases[lease_id] = tenant
        rpm, tpm, tpd = limits.requests_per_minute, limits.tokens_per_minute, limits.tokens_per_day
        limit_tokens, remaining_tokens, reset_tokens = token_window(
            tpm, int(toks), int(to_min_ms) / 1000, tpd, int(day_toks), int(to_day_ms) / 1000
        )
        return QuotaResult(
            allowed=not reason,
            reason=reason or None,
            retry_after_s=int(retry_ms) / 1000,
            lease=lease,
            limit_requests=rpm,
            remaining_requests=(rpm - int(reqs)) if rpm else 0,
            reset_requests_s=int(to_min_ms) / 1000,
            limit_tokens=limit_tokens,
            remaining_tokens=remaining_tokens,
            reset_tokens_s=reset_tokens,
        )

    def _release_head(self) -> list[str | int]:
        """The release script's first arguments: the key prefix and the lease in ms (a tombstone's lifetime)."""
        return [self.config.key_prefix, round(self.config.lease_s * 1000)]

    def _give_back(self, tenant: str, lease_id: str) -> None:
        """Release a lease the check may have granted to a request that is gone (in a task of its own: the request's
        is cancelled); while Redis is down, recorded for the recovery."""

        async def release() -> None:
            try:
                async with asyncio.timeout(self._call_timeout_s):
                    await self._release(args=[*self._release_head(), tenant, lease_id, 0, -1])
            except REDIS_ERRORS as exc:
                self._unreleased[lease_id] = (tenant, 0, -1)
                self._mark_down(exc)

        if not self.up:
            self._unreleased[lease_id] = (tenant, 0, -1)
            return
        task = asyncio.get_running_loop().create_task(release(), name="kvgate:redis-give-back")
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)

    async def release(self, lease: Lease, tokens: int, *, admitted: bool = True) -> None:
        if lease.store != self.name:
            # counted in Redis on recovery (one being adopted now is counted by that, released after it)
            if self._granted_locally.pop(lease.lease_id, None) is not None and lease.lease_id not in self._adopting:
                done = self._finished_locally.setdefault((lease.tenant, lease.minute), [0, 0])
                done[0], done[1] = done[0] + admitted, done[1] + tokens
            await self.fallback.release(lease, tokens, admitted=admitted)
            return
        self._leases.pop(lease.lease_id, None)
        self.fallback.unhold(lease.tenant, lease.lease_id)
        delta = tokens - lease.charged_tokens
        lease.charged_tokens = tokens
        entry = (lease.tenant, delta, -1 if admitted else lease.minute)
        if not self.up:
            self._unreleased[lease.lease_id] = entry  # applied when Redis answers again
            return
        try:
            async with asyncio.timeout(self._call_timeout_s):
                await self._release(args=[*self._release_head(), lease.tenant, lease.lease_id, *entry[1:]])
        except REDIS_ERRORS as exc:
            self._unreleased[lease.lease_id] = entry
            self._mark_down(exc)

    async def _reconcile_pass(self) -> None:
        """One pass making Redis' counts what they would be had it never been down (see the module header): the
        releases recorded so far, then the local grants live now, one script call each; raises on a Redis error
        (what it did not apply stays recorded)."""
        releases = list(self._unreleased.items())
        if releases:
            args = self._release_head()
            for lease_id, (tenant, delta, refused) in releases:
                args += [tenant, lease_id, delta, refused]
            async with asyncio.timeout(self._call_timeout_s):
                await self._release(args=args)
            for lease_id, entry in releases:
                if self._unreleased.get(lease_id) is entry:  # not recorded again meanwhile
                    del self._unreleased[lease_id]
        # one call: (tenant, lease or "", requests, tokens, the minute granted) for the finished grants' counts (in
        # the minute and day they were granted in, not the one Redis came back in) and the live leases
        finished = list(self._finished_locally.items())
        adopted = list(self._granted_locally.values())
        if not finished and not adopted:
            return
        args = [self.config.key_prefix, round(self.config.lease_s * 1000)]
        for (tenant, minute), (requests, tokens) in finished:
            args += [tenant, "", requests, tokens, minute]
        for lease in adopted:
            args += [lease.tenant, lease.lease_id, 1, lease.charged_tokens, lease.minute]
        self._adopting = {lease.lease_id for lease in adopted}
        try:
            async with asyncio.timeout(self._call_timeout_s):
                await self._adopt(args=args)
        except BaseException:  # not adopted: those that finished meanwhile are counted as finished ones
            for lease in adopted:
                if lease.lease_id not in self._granted_locally:
                    done = self._finished_locally.setdefault((lease.tenant, lease.minute), [0, 0])
                    done[0], done[1] = done[0] + 1, done[1] + lease.charged_tokens
            raise
        finally:
            self._adopting = set()
        for key, (requests, tokens) in finished:  # less what was applied: more may have come meanwhile
            done = self._finished_locally[key]
            done[0], done[1] = done[0] - requests, done[1] - tokens
            if done[0] <= 0 and done[1] <= 0:
                del self._finished_locally[key]
        for lease in adopted:
            if self._granted_locally.pop(lease.lease_id, None) is None:  # it finished while being adopted
                self._unreleased[lease.lease_id] = (lease.tenant, 0, -1)
                continue
            await self.fallback.release(lease, lease.charged_tokens)  # the local slot is Redis' now
            lease.store = self.name
            self._leases[lease.lease_id] = lease.tenant

    def _behind(self) -> bool:
        """Whether Redis' counts still miss something recorded while it was down."""
        return bool(self._unreleased or self._granted_locally or self._finished_locally)

    def _mark_down(self, exc: BaseException) -> None:
        if not self.up:
            return
        self._set_down(exc)
        if self._reconnect is None or self._reconnect.done():
            self._reconnect = asyncio.create_task(self._reconnect_loop(), name="kvgate:redis-reconnect")

    def _set_down(self, exc: BaseException) -> None:
        self.up = False
        for lease_id, tenant in self._leases.items():  # its own running requests fill the local limits too
            self.fallback.hold(tenant, lease_id)
        self.metrics.store_up.labels("redis").set(0)
        self.metrics.store_transitions.labels("redis", "down").inc()
        log.warning(
            "quota store redis unreachable (%s: %s); policy fail-%s until it answers again",
            type(exc).__name__,
            exc,
            self.config.failure_policy,
        )

    def _set_up(self) -> None:
        self.up = True
        self.metrics.store_up.labels("redis").set(1)
        self.metrics.store_transitions.labels("redis", "up").inc()
        log.warning("quota store redis is reachable again; shared limits resume")

    async def _reconnect_loop(self) -> None:
        """PING with backoff until Redis answers; reconcile (at most `_PASSES_BEFORE_UP` passes), mark the store up,
        then reconcile what the last passes left. A failure on the way, or the store marked down again by a
        request meanwhile, starts over."""
        backoff = Backoff(self.config.reconnect_min_s, self.config.reconnect_max_s)
        while True:
            await asyncio.sleep(backoff.next())
            try:
                async with asyncio.timeout(self._call_timeout_s):
                    await self.client.ping()
                for _ in range(_PASSES_BEFORE_UP):
                    await self._reconcile_pass()
                    if not self._behind():
                        break
            except REDIS_ERRORS:
                continue
            self._set_up()
            try:
                while self.up and self._behind():  # once up, no more local grants: this ends
                    await self._reconcile_pass()
            except REDIS_ERRORS as exc:
                if self.up:
                    self._set_down(exc)
            if self.up:
                return
            backoff.reset()

    async def _renew_loop(self) -> None:
        while True:
            if self.up:
                try:
                    await self._renew_leases()
                except REDIS_ERRORS as exc:
                    self._mark_down(exc)
            await asyncio.sleep(self.config.lease_s / 3)

    async def _renew_leases(self) -> None:
        """Extend this gateway's live Redis leases by lease_s and set its mark; where the mark is gone (Redis lost
        its data) the leases are added back, not only extended. A release racing that re-addition may leave its
        lease until it expires (lease_s): only after such a loss."""
        args: list[str | int] = [self.config.key_prefix, round(self.config.lease_s * 1000), self._mark]
        for lease_id, tenant in self._leases.items():
            args += [tenant, lease_id]
        async with asyncio.timeout(self._call_timeout_s):
            lost = await self._renew(args=args)
        if lost and len(args) > 3:
            log.warning(
                "redis had lost this gateway's %d live leases (restarted or flushed): added back", (len(args) - 3) // 2
            )

    async def close(self) -> None:
        await asyncio.gather(*self._giving_back, return_exceptions=True)
        for task in (self._reconnect, self._renewer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.client.aclose()
        await self.fallback.close()
