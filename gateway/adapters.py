"""LoRA adapters loaded on demand (models.dynamic_lora): the async shell around `policies.lora.place_adapter`.

A request for an adapter of `models.adapters` that no ready replica holds waits for one load: the first such
request starts it (a task of its own, so a client leaving does not abort it), the others await the same task. The
load picks a replica of the adapter's base model (`place_adapter`: free slot, then least load; else unload the
least recently requested adapter), asks the engine (`ReplicaSet.load_adapter`), and the replica is routable for
the adapter at once; one placement and load at a time per base model (two at once would take the same free slot
or evict the same adapter). A refusal is an `AdapterLoadFailed` (502, the engine's reason; the same answer at once,
with no engine call and no eviction, for `_FAILED_LOAD_S`), a load past
`lora_load_timeout_s` a 504, no replica of the base model ready a 503 with Retry-After: never a hang. A hot
adapter (every holder has `lora_replicate_load` requests outstanding) is loaded on one more replica with a free
slot in the background (`policies.lora.replica_to_add`), one such load at a time per adapter. Per request
O(1) when the adapter is resident (one dict lookup and a scan of its holders); a load costs O(replicas x adapters)
plus the engine's time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Mapping
from typing import Any

from engine_pool.replica import Replica
from engine_pool.replica_set import ReplicaSet
from gateway.config import AdapterSpec, ModelsConfig
from gateway.errors import AdapterLoadFailed, GatewayError, Overloaded, UpstreamTimeout, UpstreamUnavailable
from gateway.metrics import GatewayMetrics
from policies.lora import place_adapter, replica_to_add

log = logging.getLogger("kvgate.adapters")

_FAILED_LOAD_S = 30.0  # an adapter whose load the engine refused is refused at once this long (no eviction for it)


class AdapterLoader:
    def __init__(self, replicas: ReplicaSet, metrics: GatewayMetrics, models: ModelsConfig) -> None:
        self.replicas = replicas
        self.metrics = metrics
        self.last_used: dict[str, float] = {}  # adapter -> when it was last requested (bounded by the catalog)
        self._loading: dict[str, asyncio.Task[None]] = {}
        # a load that failed: refused again at once until then (no engine call, no eviction), bounded by the catalog
        self._failed: dict[str, tuple[float, str]] = {}
        self._placing: dict[str, asyncio.Lock] = {}  # base model -> one placement and load at a time on its replicas
        self.configure(models)

    def configure(self, models: ModelsConfig) -> None:
        """The catalog and its limits (at start and on a config reload)."""
        self.catalog: Mapping[str, AdapterSpec] = models.adapters if models.dynamic_lora else {}
        self.slots = models.lora_slots
        self.replicate_load = models.lora_replicate_load
        self.timeout_s = models.lora_load_timeout_s

    async def ensure(self, name: str) -> None:
        """Return once some ready replica holds adapter `name` (at once when one does, or `name` is not in the
        catalog); raises the load's error otherwise."""
        spec = self.catalog.get(name)
        if spec is None:
            return
        self.last_used[name] = time.monotonic()
        failed = self._failed.get(name)
        if failed is not None and failed[0] > self.last_used[name]:
            raise AdapterLoadFailed(f"{failed[1]} (not tried again for {failed[0] - self.last_used[name]:.0f} s)")
        for _ in range(2):  # a background replication awaited first may have failed: then a load of our own
            now = time.monotonic()
            task = self._loading.get(name)
            holders = [r for r in self.replicas.for_model(name) if r.routable(now)]
            if holders:
                if task is None and self.replicate_load is not None:
                    self._replicate_if_hot(name, spec, holders, now)
                return
            if task is None:
                task = self._start(name, self._load(name, spec))
            await asyncio.shield(task)

    async def close(self) -> None:
        """Cancel the loads in progress (shutdown)."""
        tasks = list(self._loading.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _start(self, name: str, load: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = self._loading[name] = asyncio.create_task(load, name=f"lora-load:{name}")
        task.add_done_callback(self._loaded)
        return task

    def _replicate_if_hot(self, name: str, spec: AdapterSpec, holders: list[Replica], now: float) -> None:
        """Load a hot adapter on one more replica in the background (`replica_to_add`); its requests meanwhile
        go to the holders."""
        assert self.replicate_load is not None
        held = {r.id for r in holders}
        others = [r for r in self._bases(spec) if r.id not in held]
        target = replica_to_add(
            [r.snapshot(now) for r in holders],
            [r.snapshot(now) for r in others],
            {r.id: list(r.adapters) for r in others},
            slots=self.slots,
            threshold=self.replicate_load,
        )
        replica = None if target is None else self.replicas.get(target)
        if replica is not None:
            self._start(name, self._replicate(name, spec, replica))

    async def _replicate(self, name: str, spec: AdapterSpec, replica: Replica) -> None:
        try:
            async with self._placing.setdefault(spec.base, asyncio.Lock()):
                error = await self._call(replica, name, None, spec.path)
        except GatewayError as exc:
            error = str(exc)
        self.metrics.lora_loads.labels(name, "failed" if error else "loaded").inc()
        if error is None:
            log.info("loaded hot adapter %s on one more replica, %s", name, replica.id)
        else:
            log.warning("loading hot adapter %s on %s failed: %s", name, replica.id, error)

    def _bases(self, spec: AdapterSpec) -> list[Replica]:
        """The replicas that may load an adapter of `spec.base`."""
        return [r for r in self.replicas.for_model(spec.base) if r.model == spec.base and r.role != "prefill"]

    def _loaded(self, task: asyncio.Task[None]) -> None:
        name = task.get_name().removeprefix("lora-load:")
        if self._loading.get(name) is task:
            del self._loading[name]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter got it already, or none was left to

    async def _load(self, name: str, spec: AdapterSpec) -> None:
        """Place and load under the base model's lock: two loads at once would both see the same free slot or evict
        the same adapter."""
        async with self._placing.setdefault(spec.base, asyncio.Lock()):
            try:
                await self._place_and_load(name, spec)
            except AdapterLoadFailed as exc:
                self._failed[name] = (time.monotonic() + _FAILED_LOAD_S, str(exc))
                raise
            self._failed.pop(name, None)

    async def _place_and_load(self, name: str, spec: AdapterSpec) -> None:
        now = time.monotonic()
        bases = self._bases(spec)
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
