"""The admission controller: `CompletionService.handle` runs `proxy.forward` inside `async with slot(...)`
(`admit` on entry, `finish` on exit, however the block ends).

Per request (no suspension in the common case: no remote store, a free slot): identify the tenant (401) -> quota
check in the store (429, or 503 when the store is down and the policy is fail-closed; skipped for a tenant without
limits) -> latency targets (`LatencyGate`, gateway.admission.targets: 503 at once where no replica is predicted to
meet them) -> capacity gate (`CapacityGate`, gateway.admission.capacity: pass at once when nothing of the model is
queued and a slot is free, otherwise wait in the model's fair queue, its program's attained service ordering it
among its tenant's; 503 at once when the queue is full or no
replica is ready, 503 after `max_wait_s`) -> forward -> release the slot (which dispatches the next queued request)
and reconcile tokens. Here: the tickets (the tenant's in-flight count, its token usage, its quota lease), the
tenant's cache salt, and the order of the steps.
A refusal costs one quota check and a few dict lookups: no engine is involved.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from multidict import MultiMapping

from cacheindex.sessions import session_digest
from engine_pool.replica_set import ReplicaSet
from gateway.admission.auth import Authenticator, Identity
from gateway.admission.capacity import CapacityGate
from gateway.admission.config import AdmissionConfig
from gateway.admission.metrics import AdmissionMetrics
from gateway.admission.queue import AttainedService
from gateway.admission.quota import Lease, QuotaResult, QuotaStore, token_cost
from gateway.admission.targets import LatencyGate
from gateway.context import RequestContext
from gateway.errors import BadRequest, GatewayError, Overloaded, RateLimited
from gateway.ids import IdSource
from gateway.router import Router
from policies.base import RequestInfo
from policies.latency import Targets

log = logging.getLogger("kvgate.admission")

SALT_PREFIX = "kvgate:"
_UNLIMITED = QuotaResult(allowed=True)  # a tenant without limits: no lease, no rate-limit headers


@dataclass(frozen=True, slots=True)
class Demand:
    """What admission by predicted latency needs of a request."""

    info: RequestInfo
    max_tokens: int | None
    targets: Targets


def _seconds(value: float | None) -> str:
    return "none" if value is None or math.isinf(value) else f"{value:g} s"


@dataclass(slots=True)
class Ticket:
    identity: Identity
    model: str
    prompt_estimate: int
    lease: Lease | None  # None once released
    quota: QuotaResult
    counted: bool = True  # in the tenant's in-flight count (until finished)
    holds_slot: bool = False
    targets: Targets | None = None  # its latency targets, with admission by predicted latency
    session: bytes | None = None  # its program (its tenant's session, digested), whose attained service it adds to


class AdmissionSlot:
    """The async context manager `AdmissionController.slot` returns: `finish` always runs, however the block ends."""

    __slots__ = ("controller", "ctx", "demand", "identity", "model", "prompt_tokens", "ticket")

    def __init__(
        self,
        controller: AdmissionController,
        identity: Identity,
        model: str,
        prompt_tokens: int,
        ctx: RequestContext,
        demand: Demand | None,
    ) -> None:
        self.controller = controller
        self.identity, self.model, self.prompt_tokens, self.ctx = identity, model, prompt_tokens, ctx
        self.demand = demand
        self.ticket: Ticket | None = None

    async def __aenter__(self) -> Ticket:
        try:
            self.ticket = await self.controller.admit(
                self.identity, self.model, self.prompt_tokens, self.ctx, self.demand
            )
        except GatewayError:
            self.ctx.refused_at = time.monotonic()
            raise
        self.ctx.admitted_at = time.monotonic()
        return self.ticket

    async def __aexit__(self, *exc_info: object) -> None:
        assert self.ticket is not None
        await self.controller.finish(self.ticket, self.ctx)


class AdmissionController:
    def __init__(
        self,
        config: AdmissionConfig,
        replicas: ReplicaSet,
        router: Router,
        store: QuotaStore,
        metrics: AdmissionMetrics,
    ) -> None:
        self.latency = LatencyGate(config, replicas, router, metrics)
        self.config = config
        self.auth = Authenticator(config)
        self.replicas = replicas
        self.router = router
        self.store = store
        self.metrics = metrics
        self.capacity_gate = CapacityGate(config, replicas, self.latency, metrics)  # slots and the fair queues
        self.attained = AttainedService()  # each program's service so far: the queue's order within a tenant
        self._tenant_active: dict[str, int] = {}  # tenant -> admitted, not finished (bounded by configured tenants)
        self._lease_ids = IdSource()
        metrics.export(self.tenants_in_flight, self.capacity_gate.queued)

    # --- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.capacity_gate.start()

    async def close(self) -> None:
        await self.capacity_gate.close()
        await self.store.close()

    # --- per request -------------------------------------------------------------------------------------------
    def identify(self, headers: MultiMapping[str], *, x_api_key: bool = False) -> Identity:
        return self.auth.identify(headers, x_api_key=x_api_key)

    def apply_cache_salt(self, identity: Identity, body: dict[str, Any]) -> bool:
        """Inject the tenant's cache_salt into the body (and so into prefix hashing); True when the body changed."""
        client = body.get("cache_salt")
        if isinstance(client, str) and client.startswith(SALT_PREFIX):
            raise BadRequest(f"cache_salt values starting with {SALT_PREFIX!r} are reserved", param="cache_salt")
        tenant = self.config.tenant(identity.tenant)
        if not (tenant.cache_isolation or tenant.cache_salt):
            return False
        secret = (self.config.cache_salt_secret or "").encode()
        salt = tenant.cache_salt or hmac.new(secret, identity.tenant.encode(), hashlib.sha256).hexdigest()[:32]
        body["cache_salt"] = f"{SALT_PREFIX}{salt}" + (f":{client}" if isinstance(client, str) and client else "")
        return True

    def slot(
        self, identity: Identity, model: str, prompt_tokens: int, ctx: RequestContext, demand: Demand | None = None
    ) -> AdmissionSlot:
        """`async with controller.slot(...)`: admitted inside the block (or a refusal raised), released after it."""
        return AdmissionSlot(self, identity, model, prompt_tokens, ctx, demand)

    async def admit(
        self, identity: Identity, model: str, prompt_tokens: int, ctx: RequestContext, demand: Demand | None = None
    ) -> Ticket:
        """Admission: the quota check (no round trip without limits or with the in-process store), then the
        latency targets (`demand`: refused at once where no replica is predicted to meet them), then a slot, at
        once when one is free and nothing of the model is queued, else in the model's fair queue, for at most what
        the time-to-first-token target leaves. A request for which the engine computes no KV (`ctx.computed`:
        counting or rendering a prompt, a realtime session) passes the quota check only."""
        tenant = identity.tenant
        tenant_cfg = self.config.tenant(tenant)
        limits = tenant_cfg.limits
        if limits.unlimited:
            quota = _UNLIMITED
        else:
            quota = await self.store.check(tenant, limits, prompt_tokens, self._lease_ids.next())
        ticket = self._ticket(identity, model, prompt_tokens, quota, ctx)
        try:
            if self.config.enabled and ctx.computed:
                max_wait = self.config.queue.max_wait_s
                if demand is not None and self.latency.enabled:
                    ticket.targets = demand.targets
                    max_wait = self._judge(identity, model, prompt_tokens, ctx, demand, max_wait)
                session = demand.info.session_key if demand is not None else None
                ticket.session = session_digest(f"{tenant}\x00{session}") if session is not None else None
                try:
                    await self.capacity_gate.acquire_slot(
                        identity, tenant_cfg.weight, tenant_cfg.max_queued, model, ctx, max_wait,
                        self.attained.of(ticket.session) if self.config.queue.order == "least-attained" else 0.0,
                    )  # fmt: skip
                except Overloaded:  # the queue refused it (full, or no slot in time): a refusal of its targets too
                    if ticket.targets is not None:
                        self.latency.refused(model, identity)
                    raise
                ticket.holds_slot = True
        except BaseException:  # refused by a gate, or its client left while queued: not admitted
            await self.finish(ticket, ctx, failed=True, admitted=False)
            raise
        return ticket

    def _ticket(
        self, identity: Identity, model: str, prompt_tokens: int, quota: QuotaResult, ctx: RequestContext
    ) -> Ticket:
        """The ticket of a quota check's grant (counted as the tenant's active request), or its refusal raised."""
        tenant = identity.tenant
        if quota is not _UNLIMITED:
            ctx.extra_headers.update(quota.headers(anthropic=ctx.api == "anthropic"))
        if not quota.allowed:
            self.metrics.rejections.labels(tenant, quota.reason or "quota").inc()
            if quota.reason == "store_unavailable":
                raise Overloaded(
                    "quota store unavailable", retry_after_s=quota.retry_after_s, code="quota_store_unavailable"
                )
            retry = str(max(1, math.ceil(quota.retry_after_s)))  # up: a client that waits it finds room
            raise RateLimited(
                f"rate limit exceeded for tenant {tenant!r}: {quota.reason}",
                code="rate_limit_exceeded",
                headers={"Retry-After": retry},
            )
        self._tenant_active[tenant] = self._tenant_active.get(tenant, 0) + 1
        return Ticket(identity, model, prompt_tokens, quota.lease, quota)

    async def finish(self, ticket: Ticket, ctx: RequestContext, *, failed: bool = False, admitted: bool = True) -> None:
        """Release the ticket's slot (dispatching the next queued request), count its tokens, release its lease
        (shielded: a cancelled request still gives its lease back; one `admitted` False leaves its minute's request
        count too)."""
        if ticket.holds_slot:
            ticket.holds_slot = False
            held = time.monotonic() - ctx.admitted_at if ctx.admitted_at is not None else None
            self.capacity_gate.give_back(ticket.model, held)
            if ticket.session is not None and held is not None:
                self.attained.add(ticket.session, held)
        if ticket.targets is not None or ctx.held_on is not None:
            self.latency.finish(ctx, ticket.identity, ticket.targets)
            ticket.targets = None
        if ticket.counted:
            ticket.counted = False
            tenant = ticket.identity.tenant
            left = self._tenant_active[tenant] - 1
            if left:
                self._tenant_active[tenant] = left
            else:
                del self._tenant_active[tenant]
            if ctx.computed:
                stats = self.metrics.tenant(tenant)
                prompt, cached, completion = ctx.prompt_tokens, ctx.cache_hits(), ctx.delivered_tokens()
                if prompt:
                    stats.prompt.value += prompt
                if cached:
                    stats.cached.value += cached
                if completion:
                    stats.completion.value += completion
        lease, ticket.lease = ticket.lease, None
        if lease is not None:
            await asyncio.shield(self.store.release(lease, self._cost(ticket, ctx, failed), admitted=admitted))

    def _cost(self, ticket: Ticket, ctx: RequestContext, failed: bool) -> int:
        """Tokens charged for the request: as the engine reported them, else the estimate of the prompt (nothing if
        it failed) and the tokens its stream delivered."""
        if not ctx.computed:  # a stored response read carries the usage it was charged when it was made
            return 0
        prompt = ctx.prompt_tokens if ctx.prompt_tokens is not None else (0 if failed else ticket.prompt_estimate)
        weight = self.config.tenant(ticket.identity.tenant).limits.cached_token_weight
        return token_cost(prompt, ctx.cache_hits(), ctx.delivered_tokens(), weight)

    def tenant_in_flight(self, tenant: str) -> int:
        """Requests of the tenant this controller admitted and has not finished."""
        return self._tenant_active.get(tenant, 0)

    def tenants_in_flight(self) -> Mapping[str, int]:
        """Every configured tenant (0 when idle: a gauge's series should not come and go) and any other active."""
        return {**dict.fromkeys(self.config.tenants, 0), **self._tenant_active}

    def _judge(
        self, identity: Identity, model: str, prompt_tokens: int, ctx: RequestContext, demand: Demand, max_wait: float
    ) -> float:
        """Refuse at once (503, Retry-After: the predicted drain) where no replica is predicted to meet the
        request's targets; else hold its KV on the best replica. Returns how long it may wait in the queue."""
        latency, targets = self.latency, demand.targets
        verdict = latency.judge(demand.info, prompt_tokens, demand.max_tokens, targets)
        if verdict.reason == "no-replica":
            return max_wait  # the capacity gate answers it (no_ready_replica)
        if not verdict.admit:
            reason = verdict.reason.replace("-", "_")
            self.metrics.rejections.labels(identity.tenant, reason).inc()
            latency.refused(model, identity)
            raise Overloaded(
                f"no replica of model {model!r} is predicted to meet the request's latency targets now "
                f"(ttft {_seconds(targets.ttft_s)}, tpot {_seconds(targets.tpot_s)})",
                retry_after_s=verdict.retry_after_s,
                code="latency_target",
            )
        assert verdict.best is not None
        ctx.prefer, ctx.predictions = verdict.prefer, verdict.predictions
        replica = self.replicas.get(verdict.best.replica)
        if replica is not None:
            latency.hold(ctx, replica, verdict.best, prompt_tokens, demand.max_tokens)
        if targets.ttft_s is None or verdict.reason == "no-wait":
            return max_wait
        return max(0.0, min(max_wait, targets.ttft_s - verdict.best.ttft_s))

    # --- reload -------------------------------------------------------------------------------------------------
    def reload(self, config: AdmissionConfig) -> None:
        """Swap tenants, keys, limits and queue bounds; in-flight and queued requests keep their leases."""
        if config.redis != self.config.redis:
            log.warning("admission.redis changed: the quota store is only rebuilt on restart")
        self.config = config
        self.latency.config = config
        self.auth = Authenticator(config)
        self.capacity_gate.reload(config)
        log.info("admission config reloaded: %d tenants, auth %s", len(config.tenants), "on" if config.auth else "off")
        self.capacity_gate.pump_all()
