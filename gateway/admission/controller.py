"""The admission controller: `CompletionService.handle` runs `proxy.forward` inside `async with slot(...)`
(`admit` on entry, `finish` on exit, however the block ends).

Per request (no suspension in the common case: no remote store, a free slot): identify the tenant (401) -> quota
check in the store (429, or 503 when the store is down and the policy is fail-closed; skipped for a tenant without
limits) -> capacity gate: pass at once when nothing of the
model is queued and a slot is free, otherwise wait in the model's fair queue (503 at once when the queue is full or
no replica is ready, 503 after `max_wait_s`) -> forward -> release the slot (which dispatches the next queued
request) and reconcile tokens.

Capacity of a model = sum of `max_concurrency` over its routable, unsaturated replicas (unbounded if one has no
gate); a slot is free while the requests this controller admitted for the model are fewer than that and some
routable replica is below its gate (so the router can place it). Counting admitted requests (not the replicas'
in-flight counts) means a request granted but not yet sent still holds its slot, so a burst of releases never
over-admits. Queued requests are dispatched on a release, on any replica-set change and every `queue.tick_s`
(engine saturation changes without notice).
A refusal costs one quota check and a few dict lookups: no engine is involved.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine_pool.replica import Replica
from engine_pool.replica_set import ReplicaSet
from gateway.admission.auth import Authenticator, Identity
from gateway.admission.config import AdmissionConfig
from gateway.admission.metrics import AdmissionMetrics
from gateway.admission.queue import DrainRate, FairQueue, QueueEntry
from gateway.admission.quota import Lease, QuotaResult, QuotaStore, token_cost
from gateway.admission.targets import LatencyGate
from gateway.context import RequestContext
from gateway.errors import BadRequest, Overloaded, RateLimited
from gateway.ids import IdSource
from gateway.router import Router
from policies.base import RequestInfo
from policies.latency import Targets
from policies.saturation import saturated

log = logging.getLogger("kvgate.admission")

SALT_PREFIX = "kvgate:"
_UNBOUNDED = 1 << 30
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
        self.ticket = await self.controller.admit(self.identity, self.model, self.prompt_tokens, self.ctx, self.demand)
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
        self._queues: dict[str, FairQueue] = {}  # per model; models come from the replica set (bounded)
        self._active: dict[str, int] = {}  # model -> admitted requests holding a slot
        self._tenant_active: dict[str, int] = {}  # tenant -> admitted, not finished (bounded by configured tenants)
        self._defaulted: set[str] = set()  # replicas whose gate this controller set
        self.drain = DrainRate()
        self._lease_ids = IdSource()
        self._tasks: list[asyncio.Task[None]] = []
        replicas.add_listener(self)
        metrics.export(self.tenants_in_flight, self.queued)

    # --- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        for replica in self.replicas:
            self._apply_default_gate(replica)
        self._tasks = [
            asyncio.create_task(self._watch(), name="kvgate:admission-watch"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for queue in self._queues.values():
            while (entry := queue.pop()) is not None:
                if not entry.future.done():
                    entry.future.set_exception(Overloaded("gateway shutting down", code="shutting_down"))
        await self.store.close()

    # --- replica gates (ReplicaListener) ----------------------------------------------------------------------
    def replica_up(self, replica: Replica) -> None:
        self._apply_default_gate(replica)

    def replica_down(self, replica: Replica) -> None:
        return None

    def replica_removed(self, replica: Replica) -> None:
        self._defaulted.discard(replica.id)

    def _apply_default_gate(self, replica: Replica) -> None:
        if replica.max_concurrency is not None and replica.id not in self._defaulted:
            return  # configured explicitly
        gate = self.config.replica_max_concurrency
        m, expected = replica.metrics, self.config.expected_context_tokens
        if expected and m.num_blocks and m.block_size:
            gate = max(1, m.num_blocks * m.block_size // expected)
        if gate is not None:
            replica.max_concurrency = gate
            self._defaulted.add(replica.id)

    # --- per request -------------------------------------------------------------------------------------------
    def identify(self, headers: Mapping[str, str], *, x_api_key: bool = False) -> Identity:
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
        the time-to-first-token target leaves."""
        tenant = identity.tenant
        tenant_cfg = self.config.tenant(tenant)
        limits = tenant_cfg.limits
        if limits.unlimited:
            quota = _UNLIMITED
        else:
            quota = await self.store.check(tenant, limits, prompt_tokens, self._lease_ids.next())
        ticket = self._ticket(identity, model, prompt_tokens, quota, ctx)
        try:
            if self.config.enabled:
                max_wait = self.config.queue.max_wait_s
                if demand is not None and self.latency.enabled:
                    ticket.targets = demand.targets
                    max_wait = self._judge(identity, model, prompt_tokens, ctx, demand, max_wait)
                await self._acquire_slot(identity, tenant_cfg.weight, tenant_cfg.max_queued, model, ctx, max_wait)
                ticket.holds_slot = True
        except BaseException:
            await self.finish(ticket, ctx, failed=True)
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
            retry = str(max(1, round(quota.retry_after_s)))
            raise RateLimited(
                f"rate limit exceeded for tenant {tenant!r}: {quota.reason}",
                code="rate_limit_exceeded",
                headers={"Retry-After": retry},
            )
        self._tenant_active[tenant] = self._tenant_active.get(tenant, 0) + 1
        return Ticket(identity, model, prompt_tokens, quota.lease, quota)

    async def finish(self, ticket: Ticket, ctx: RequestContext, *, failed: bool = False) -> None:
        """Release the ticket's slot (dispatching the next queued request), count its tokens, release its lease
        (shielded: a cancelled request still gives its lease back)."""
        if ticket.holds_slot:
            ticket.holds_slot = False
            self._give_back(ticket.model)
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
            stats = self.metrics.tenant(tenant)
            prompt, cached, completion = ctx.prompt_tokens, ctx.cached_tokens, ctx.completion_tokens
            if prompt:
                stats.prompt.value += prompt
            if cached:
                stats.cached.value += cached
            if completion:
                stats.completion.value += completion
        lease, ticket.lease = ticket.lease, None
        if lease is not None:
            await asyncio.shield(self.store.release(lease, self._cost(ticket, ctx, failed)))

    def _cost(self, ticket: Ticket, ctx: RequestContext, failed: bool) -> int:
        """Tokens charged for the request: as the engine reported them, else the estimate (nothing if it failed)."""
        prompt = ctx.prompt_tokens if ctx.prompt_tokens is not None else (0 if failed else ticket.prompt_estimate)
        weight = self.config.tenant(ticket.identity.tenant).limits.cached_token_weight
        return token_cost(prompt, ctx.cached_tokens or 0, ctx.completion_tokens or 0, weight)

    def tenant_in_flight(self, tenant: str) -> int:
        """Requests of the tenant this controller admitted and has not finished."""
        return self._tenant_active.get(tenant, 0)

    def tenants_in_flight(self) -> Mapping[str, int]:
        """Every configured tenant (0 when idle: a gauge's series should not come and go) and any other active."""
        return {**dict.fromkeys(self.config.tenants, 0), **self._tenant_active}

    # --- capacity and queue ------------------------------------------------------------------------------------
    def capacity(self, model: str) -> tuple[int, int]:
        """(slots of routable unsaturated replicas, replicas ready) for the model."""
        now, cap, ready = time.monotonic(), 0, 0
        threshold = self.config.saturation_kv_usage
        for r in self.replicas.for_model(model):
            if not r.routable(now):
                continue
            ready += 1
            if self._saturated(r, now, threshold):
                continue
            cap += _UNBOUNDED if r.max_concurrency is None else r.max_concurrency
        return cap, ready

    def _saturated(self, r: Replica, now: float, threshold: float) -> bool:
        """A replica with waiting requests and its KV nearly full has no capacity, unless admission by predicted
        latency is on: the prediction already prices the engine's queue (KV room), and a request it admitted should
        not then wait in the gateway for a saturation it was admitted into."""
        if self.latency.enabled:
            return False
        return r.metrics.waiting > 0 and saturated(r.snapshot(now), threshold)  # saturation needs waiting > 0

    def _has_slot(self, model: str) -> bool:
        """A slot is free: fewer admitted requests than `capacity` and some routable replica below its gate (what
        the router needs to place it), in one pass over the replicas that stops as soon as both hold."""
        now, cap, gate_open = time.monotonic(), 0, False
        active, threshold = self._active.get(model, 0), self.config.saturation_kv_usage
        for r in self.replicas.for_model(model):
            if not r.routable(now):
                continue
            gate = r.max_concurrency
            gate_open = gate_open or gate is None or r.in_flight < gate
            if self._saturated(r, now, threshold):
                continue
            cap += _UNBOUNDED if gate is None else gate
            if gate_open and active < cap:
                return True
        return gate_open and active < cap

    def _free(self, model: str) -> bool:
        """Admit without queueing: nothing of the model is queued (they go first) and a slot is free."""
        queue = self._queues.get(model)
        return (queue is None or not len(queue)) and self._has_slot(model)

    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def queued_for(self, tenant: str) -> int:
        return sum(q.tenant_len(tenant) for q in self._queues.values())

    def _judge(
        self, identity: Identity, model: str, prompt_tokens: int, ctx: RequestContext, demand: Demand, max_wait: float
    ) -> float:
        """Refuse at once (503, Retry-After: the predicted drain) where no replica is predicted to meet the
        request's targets; else hold its KV on the best replica. Returns how long it may wait in the queue."""
        latency, targets = self.latency, demand.targets
        verdict = latency.judge(model, demand.info, prompt_tokens, demand.max_tokens, targets)
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
        ctx.prefer = verdict.prefer
        replica = self.replicas.get(verdict.best.replica)
        if replica is not None:
            latency.hold(ctx, replica, verdict.best, demand.max_tokens)
        if targets.ttft_s is None or verdict.reason == "no-wait":
            return max_wait
        return max(0.0, min(max_wait, targets.ttft_s - verdict.best.ttft_s))

    async def _acquire_slot(
        self,
        identity: Identity,
        weight: float,
        tenant_bound: int | None,
        model: str,
        ctx: RequestContext,
        max_wait_s: float,
    ) -> None:
        if self._free(model):
            self._take(model)
            self.metrics.queue_wait.labels(identity.tenant).observe(0.0)  # admitted at once: waited nothing
            return
        qcfg, tenant = self.config.queue, identity.tenant
        reason = None
        if self.capacity(model)[1] == 0:
            reason = "no_ready_replica"
        elif self.queued() >= qcfg.max_queued:
            reason = "queue_full"
        elif self.queued_for(tenant) >= (qcfg.max_queued_per_tenant if tenant_bound is None else tenant_bound):
            reason = "tenant_queue_full"
        if reason is not None:
            self.metrics.rejections.labels(tenant, reason).inc()
            raise Overloaded(
                f"no capacity for model {model!r} now ({reason})",
                retry_after_s=self.drain.retry_after(self.queued()),
                code=reason,
            )
        queue = self._queues.setdefault(model, FairQueue())
        entry = queue.push(tenant, weight, identity.priority)
        started = time.monotonic()
        try:
            async with asyncio.timeout(max_wait_s):
                await entry.future
        except BaseException as exc:
            self._abandon(queue, entry, model)
            if isinstance(exc, TimeoutError):
                self.metrics.rejections.labels(tenant, "queue_timeout").inc()
                raise Overloaded(
                    f"waited {max_wait_s:.1f} s for capacity on model {model!r}",
                    retry_after_s=self.drain.retry_after(self.queued()),
                    code="queue_timeout",
                ) from None
            raise
        finally:
            ctx.queue_wait_s = time.monotonic() - started
        self.metrics.queue_wait.labels(tenant).observe(ctx.queue_wait_s)

    def _abandon(self, queue: FairQueue, entry: QueueEntry, model: str) -> None:
        fut = entry.future
        if entry.dead and fut.done() and not fut.cancelled() and fut.exception() is None:
            self._give_back(model)  # granted as we gave up: pass the slot on
        else:
            queue.remove(entry)

    def _take(self, model: str) -> None:
        self._active[model] = self._active.get(model, 0) + 1
        self.drain.record()

    def _give_back(self, model: str) -> None:
        left = self._active.get(model, 0) - 1
        if left > 0:
            self._active[model] = left
        else:
            self._active.pop(model, None)
        self.pump(model)

    def pump(self, model: str) -> int:
        """Dispatch queued requests of the model while slots are free; returns how many were dispatched."""
        queue = self._queues.get(model)
        n = 0
        while queue is not None and (entry := queue.peek()) is not None:
            if entry.future.done():  # its waiter was cancelled and has not cleaned up yet
                queue.pop()
                continue
            if not self._has_slot(model):
                break
            queue.pop()
            self._take(model)
            entry.future.set_result(None)
            n += 1
        if queue is not None and not len(queue):
            del self._queues[model]
        return n

    async def _watch(self) -> None:
        while True:
            changed = self.replicas.changed  # captured before waiting: the set replaces it on every change
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.queue.tick_s):
                    await changed.wait()
            for model in list(self._queues):
                self.pump(model)

    # --- reload -------------------------------------------------------------------------------------------------
    def reload(self, config: AdmissionConfig) -> None:
        """Swap tenants, keys, limits and queue bounds; in-flight and queued requests keep their leases."""
        if config.redis != self.config.redis:
            log.warning("admission.redis changed: the quota store is only rebuilt on restart")
        self.config = config
        self.latency.config = config
        self.auth = Authenticator(config)
        for replica in self.replicas:
            if replica.id in self._defaulted:
                self._apply_default_gate(replica)
        log.info("admission config reloaded: %d tenants, auth %s", len(config.tenants), "on" if config.auth else "off")
        for model in list(self._queues):
            self.pump(model)
