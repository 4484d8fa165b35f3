"""The capacity gate: the slots of a model's replicas and the fair queue a request waits in for one (the admission
controller, gateway.admission.controller, holds one and calls it after the quota check and the latency targets).

Capacity of a model = sum of `max_concurrency` over its routable, unsaturated replicas (unbounded if one has no
gate); a slot is free while the requests this gate admitted for the model are fewer than that and some routable
replica is below its gate (so the router can place it). Counting admitted requests (not the replicas' in-flight
counts) means a request granted but not yet sent still holds its slot, so a burst of releases never over-admits.
`acquire_slot` passes at once when nothing of the model is queued and a slot is free; otherwise the request waits in
the model's fair queue (gateway.admission.queue): 503 at once when the queue is full (in all or for the tenant) or
no replica is ready, or when its wait is predicted past its longest (`queue_wait`: the requests the fair queue
would dispatch before it, plus one, times the model's mean slot holding time over its slots; a slot's holding time
is learned as each ends, an exponential mean), else 503 after its longest wait (Retry-After from the measured drain
rate). So a request that would time out in the queue is told so at once, and the fair queue's order decides which:
a light tenant's request is ahead of a flood's backlog and waits, the flood's are refused. Queued requests are
dispatched on a release (`give_back`), on any replica-set change and every `queue.tick_s` (engine saturation
changes without notice).
Default gates (a replica-set listener): a replica configured without `max_concurrency` gets
`replica_max_concurrency`, or `num_blocks x block_size / expected_context_tokens` when that is set.
Cost: a free slot is one pass over the model's replicas that stops as soon as it finds one; a queued request
O(log n) in the queue, and one such pass per dispatch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from engine_pool.replica import Replica
from engine_pool.replica_set import ReplicaSet
from gateway.admission.auth import Identity
from gateway.admission.config import AdmissionConfig
from gateway.admission.metrics import AdmissionMetrics
from gateway.admission.queue import DrainRate, FairQueue, QueueEntry
from gateway.admission.targets import LatencyGate
from gateway.context import RequestContext
from gateway.errors import Overloaded
from policies.saturation import saturated

_UNBOUNDED = 1 << 30
_HOLD_WEIGHT = 0.1  # of each slot's holding time in the mean (about the last 10 slots)


class CapacityGate:
    def __init__(
        self, config: AdmissionConfig, replicas: ReplicaSet, latency: LatencyGate, metrics: AdmissionMetrics
    ) -> None:
        self.config = config
        self.replicas = replicas
        self.latency = latency  # with admission by predicted latency on, saturation does not close a replica
        self.metrics = metrics
        # per base model (its LoRA adapters run on its replicas, in its slots: one queue and one count for them all);
        # models come from the replica set (bounded)
        self._queues: dict[str, FairQueue] = {}
        self._active: dict[str, int] = {}  # base model -> admitted requests holding a slot
        self._defaulted: set[str] = set()  # replicas whose gate this gate set
        self.drain = DrainRate()
        self._hold: dict[str, float] = {}  # base model -> mean seconds a slot is held (learned as slots go back)
        self._tasks: list[asyncio.Task[None]] = []
        replicas.add_listener(self)

    # --- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        for replica in self.replicas:
            self._apply_default_gate(replica)
        self._tasks = [
            asyncio.create_task(self._watch(), name="kvgate:admission-watch"),
        ]

    async def close(self) -> None:
        """Stop dispatching; every queued request is refused (503 `shutting_down`)."""
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for queue in self._queues.values():
            while (entry := queue.pop()) is not None:
                if not entry.future.done():
                    entry.future.set_exception(Overloaded("gateway shutting down", code="shutting_down"))

    def reload(self, config: AdmissionConfig) -> None:
        """Swap the config; the gates this gate set are set again from it (dispatch with `pump`)."""
        self.config = config
        for replica in self.replicas:
            if replica.id in self._defaulted:
                self._apply_default_gate(replica)

    # --- replica gates (ReplicaListener) ----------------------------------------------------------------------
    def replica_up(self, replica: Replica) -> None:
        self._apply_default_gate(replica)

    def replica_down(self, replica: Replica) -> None:
        return None

    def replica_removed(self, replica: Replica) -> None:
        self._defaulted.discard(replica.id)

    def reconfigured(self, replica: Replica) -> None:
        """The replica's configured gate was changed in place (a reload): a configured one replaces the default, none
        takes the default."""
        self._defaulted.discard(replica.id)
        self._apply_default_gate(replica)

    def _apply_default_gate(self, replica: Replica) -> None:
        if (
            replica.max_concurrency is not None
            and replica.id not in self._defaulted
            and not self._rank_of_defaulted(replica)
        ):
            return  # configured explicitly
        gate = self.config.replica_max_concurrency
        m, expected = replica.metrics, self.config.expected_context_tokens
        if expected and m.num_blocks and m.block_size:
            gate = max(1, m.num_blocks * m.block_size // expected)
        if gate is not None:
            replica.max_concurrency = gate
            self._defaulted.add(replica.id)
        elif replica.id in self._defaulted:  # the gate this set is gone from the config (a reload): no gate
            replica.max_concurrency = None
            self._defaulted.discard(replica.id)

    def _rank_of_defaulted(self, replica: Replica) -> bool:
        """A data-parallel engine's other rank, whose gate came from its first rank's (`Replica.for_rank`): a
        default there is a default here too (a reload changes both). O(replicas), once a rank comes up."""
        return any(replica in first.ranks and first.id in self._defaulted for first in self.replicas)

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
        """A slot is free: fewer admitted requests of its base model (adapters included) than the base's
        `capacity`, and some routable replica of `model` below its gate (what the router needs to place it), in one
        pass over the replicas that stops as soon as both hold."""
        base = self.replicas.base_model(model)
        now, cap, gate_open = time.monotonic(), 0, False
        active, threshold = self._active.get(base, 0), self.config.saturation_kv_usage
        for r in self.replicas.for_model(base):
            if not r.routable(now):
                continue
            gate = r.max_concurrency
            if model == base or model in r.adapters:
                gate_open = gate_open or gate is None or r.in_flight < gate
            if self._saturated(r, now, threshold):
                continue
            cap += _UNBOUNDED if gate is None else gate
            if gate_open and active < cap:
                return True
        return gate_open and active < cap

    def _free(self, model: str) -> bool:
        """Admit without queueing: nothing of its base model is queued (they go first) and a slot is free."""
        queue = self._queues.get(self.replicas.base_model(model))
        return (queue is None or not len(queue)) and self._has_slot(model)

    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def queued_for(self, tenant: str) -> int:
        return sum(q.tenant_len(tenant) for q in self._queues.values())

    async def acquire_slot(
        self,
        identity: Identity,
        weight: float,
        tenant_bound: int | None,
        model: str,
        ctx: RequestContext,
        max_wait_s: float,
        attained_s: float = 0.0,
    ) -> None:
        """A slot for the request: at once when one is free and nothing is queued, else in the model's fair queue
        (`attained_s`: its program's service so far, which orders it among its tenant's), for at most `max_wait_s`."""
        base = self.replicas.base_model(model)
        if self._free(model):
            self._take(base)
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
        queue = self._queues.setdefault(base, FairQueue())
        wait = self._predicted_wait(base, queue, identity, weight, max_wait_s)
        if wait is not None and wait > max_wait_s:
            if not len(queue):
                del self._queues[base]
            self.metrics.rejections.labels(tenant, "queue_wait").inc()
            raise Overloaded(
                f"no capacity for model {model!r} within {max_wait_s:.1f} s (a slot predicted in {wait:.1f} s)",
                retry_after_s=wait,
                code="queue_wait",
            )
        entry = queue.push(tenant, weight, identity.priority, attained_s, model)
        started = time.monotonic()
        try:
            async with asyncio.timeout(max_wait_s):
                await entry.future
        except BaseException as exc:
            self._abandon(queue, entry, base)
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
            self.give_back(model)  # granted as we gave up: pass the slot on
        else:
            queue.remove(entry)

    def _take(self, model: str) -> None:
        self._active[model] = self._active.get(model, 0) + 1
        self.drain.record()

    def _predicted_wait(
        self, model: str, queue: FairQueue, identity: Identity, weight: float, max_wait_s: float
    ) -> float | None:
        """Seconds until a slot is predicted free for the request, queued now (None: not known yet, no gate bounds
        the model, or certainly within `max_wait_s`). The fair queue's order is counted only where the bounds do not
        decide: its own class's backlog alone (a flood's) already too long, or the whole queue short enough."""
        hold, slots = self._hold.get(model), self.capacity(model)[0]
        if hold is None or not 0 < slots < _UNBOUNDED:
            return None
        per = hold / slots  # seconds between releases, the slots held in turn
        own = (queue.class_len(identity.tenant, identity.priority) + 1) * per  # at least: its class's backlog first
        if own > max_wait_s or (len(queue) + 1) * per <= max_wait_s:
            return own  # decided without the order: too long already, or within it wherever it lands
        return (queue.ahead(identity.tenant, weight, identity.priority) + 1) * per

    def give_back(self, model: str, held_s: float | None = None) -> None:
        """Release a slot of the model (held for `held_s`: learned), dispatching the next queued request of its
        base model's."""
        model = self.replicas.base_model(model)
        if held_s is not None:
            mean = self._hold.get(model)
            self._hold[model] = held_s if mean is None else mean + _HOLD_WEIGHT * (held_s - mean)
        left = self._active.get(model, 0) - 1
        if left > 0:
            self._active[model] = left
        else:
            self._active.pop(model, None)
        self.pump(model)

    def pump(self, model: str) -> int:
        """Dispatch queued requests of the base model (its adapters' included) while slots are free, in the queue's
        order (the head waits for a replica of its own model); returns how many were dispatched."""
        queue = self._queues.get(model)
        n = 0
        while queue is not None and (entry := queue.peek()) is not None:
            if entry.future.done():  # its waiter was cancelled and has not cleaned up yet
                queue.pop()
                continue
            if not self._has_slot(entry.model or model):
                break
            queue.pop()
            self._take(model)
            entry.future.set_result(None)
            n += 1
        if queue is not None and not len(queue):
            del self._queues[model]
        return n

    def pump_all(self) -> None:
        for model in list(self._queues):
            self.pump(model)

    async def _watch(self) -> None:
        while True:
            changed = self.replicas.changed  # captured before waiting: the set replaces it on every change
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.queue.tick_s):
                    await changed.wait()
            self.pump_all()
