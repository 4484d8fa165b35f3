"""LoRA adapters loaded on demand (models.dynamic_lora): the async shell around `policies.lora.place_adapter`.

A request for an adapter of `models.adapters` that no ready replica holds waits for one load: the first such
request starts it (a task of its own, so a client leaving does not abort it), the others await the same task. The
load picks a replica of the adapter's base model (`place_adapter`: free slot, then least load; else unload the
least recently requested adapter), asks the engine (`ReplicaSet.load_adapter`), and the replica is routable for
the adapter at once. A refusal is an `AdapterLoadFailed` (502, the engine's reason), a load past
`lora_load_timeout_s` a 504, no replica of the base model ready a 503 with Retry-After: never a hang. Per request
O(1) when the adapter is resident (one dict lookup and a scan of its holders); a load costs O(replicas x adapters)
plus the engine's time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from engine_pool.replica import Replica
from engine_pool.replica_set import ReplicaSet
from gateway.config import AdapterSpec, ModelsConfig
from gateway.errors import AdapterLoadFailed, Overloaded, UpstreamTimeout, UpstreamUnavailable
from gateway.metrics import GatewayMetrics
from policies.lora import place_adapter

log = logging.getLogger("kvgate.adapters")


class AdapterLoader:
    def __init__(self, replicas: ReplicaSet, metrics: GatewayMetrics, models: ModelsConfig) -> None:
        self.replicas = replicas
        self.metrics = metrics
        self.last_used: dict[str, float] = {}  # adapter -> when it was last requested (bounded by the catalog)
        self._loading: dict[str, asyncio.Task[None]] = {}
        self.configure(models)

    def configure(self, models: ModelsConfig) -> None:
        """The catalog and its limits (at start and on a config reload)."""
        self.catalog: Mapping[str, AdapterSpec] = models.adapters if models.dynamic_lora else {}
        self.slots = models.lora_slots
        self.timeout_s = models.lora_load_timeout_s

    async def ensure(self, name: str) -> None:
        """Return once some ready replica holds adapter `name` (at once when one does, or `name` is not in the
        catalog); raises the load's error otherwise."""
        spec = self.catalog.get(name)
        if spec is None:
            return
        now = time.monotonic()
        self.last_used[name] = now
        if any(r.routable(now) for r in self.replicas.for_model(name)):
            return
        task = self._loading.get(name)
        if task is None:
            task = self._loading[name] = asyncio.create_task(self._load(name, spec), name=f"lora-load:{name}")
            task.add_done_callback(self._loaded)
        await asyncio.shield(task)

    def _loaded(self, task: asyncio.Task[None]) -> None:
        name = task.get_name().removeprefix("lora-load:")
        if self._loading.get(name) is task:
            del self._loading[name]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter got it already, or none was left to

    async def _load(self, name: str, spec: AdapterSpec) -> None:
        now = time.monotonic()
        bases = [r for r in self.replicas.for_model(spec.base) if r.model == spec.base and r.role != "prefill"]
        placement = place_adapter(
            [r.snapshot(now) for r in bases],
            {r.id: list(r.adapters) for r in bases},
            slots=self.slots,
            last_used=self.last_used,
            loadable=self.catalog,
        )
        if placement is None:
            self.metrics.lora_loads.labels(name, "no_replica").inc()
            raise Overloaded(f"no replica of {spec.base!r} can load the adapter {name!r} now", code="no_ready_replica")
        replica = self.replicas.get(placement.replica)
        assert replica is not None  # placed among the replica set's own
        if placement.evict is not None:
            error = await self._call(replica, name, placement.evict)
            self.metrics.lora_unloads.labels(placement.evict, "failed" if error else "unloaded").inc()
            if error is not None:  # the load is still worth trying: vLLM swaps adapters beyond its slots itself
                log.warning("unloading adapter %s from %s failed: %s", placement.evict, replica.id, error)
        error = await self._call(replica, name, None, spec.path)
        if error is not None:
            self.metrics.lora_loads.labels(name, "failed").inc()
            raise AdapterLoadFailed(f"loading the LoRA adapter {name!r} on replica {replica.id} failed: {error}")
        self.metrics.lora_loads.labels(name, "loaded").inc()
        log.info("loaded adapter %s on %s (%s)", name, replica.id, placement.reason)

    async def _call(self, replica: Replica, name: str, evict: str | None, path: str = "") -> str | None:
        """One engine call (unload `evict`, else load `name` from `path`); None on success, else the reason.
        Timeouts and unreachable engines are raised as gateway errors."""
        what = f"unloading the adapter {evict!r}" if evict is not None else f"loading the adapter {name!r}"
        try:
            if evict is not None:
                return await self.replicas.unload_adapter(replica, evict, timeout_s=self.timeout_s)
            return await self.replicas.load_adapter(replica, name, path, timeout_s=self.timeout_s)
        except TimeoutError:
            self.metrics.lora_loads.labels(name, "timeout").inc()
            raise UpstreamTimeout(f"{what} on replica {replica.id} took longer than {self.timeout_s:g} s") from None
        except ConnectionError as exc:
            self.metrics.lora_loads.labels(name, "unreachable").inc()
            raise UpstreamUnavailable(f"{what} on replica {replica.id}: {exc}") from None
