"""Degradation watcher: restart a replica whose service degraded for a while (rule: `DegradationRule`).

Every `check_interval_s`, for each ready replica of a model with a rule, one sample is taken: the engine's TTFT
histogram sum and count (`vllm:time_to_first_token_seconds_{sum,count}`) and the KV cache free fraction (1 - the
`kv_cache_usage_perc`), both from the replica set's last scrape of its /metrics, and the replica's attempts and
failed attempts (cumulative, counted on the replica by the proxy: `Replica.answered`, `Replica.failed`).
Once the samples span `window_s`, the window's deltas are checked:
  mean TTFT = d(sum) / d(count) > ttft_mean_max_s,  error rate = d(errors) / d(answers) > error_rate_max (with at
  least min_requests answers),  or every sample's KV free fraction < kv_free_min.
A hit asks the pool for a one-replica restart that keeps N-1 ready (skipped when the others are not ready), at most
once per `cooldown_s` per replica. Memory: at most window_s / check_interval_s + 2 samples per replica. Cost per
check: O(1) per replica (no request of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from engine_pool.slots import PoolError, Slot, SlotState
from engine_pool.spec import DegradationRule, ModelPoolConfig

log = logging.getLogger("kvgate.pool.degradation")


class RestartablePool(Protocol):
    """What the watcher needs of the pool (engine_pool.pool.EnginePool), which owns it."""

    @property
    def models(self) -> Mapping[str, ModelPoolConfig]: ...

    def slots(self) -> list[Slot]: ...

    async def restart_one(self, replica_id: str, *, reason: str, wait_others_s: float | None = None) -> object: ...


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    ttft_sum: float
    ttft_count: float
    answers: float
    errors: float
    kv_free: float


def degraded(rule: DegradationRule, samples: deque[Sample]) -> str | None:
    """Why the window of samples breaks the rule, or None (pure: testable with literal samples)."""
    if len(samples) < 2 or samples[-1].t - samples[0].t < rule.window_s:
        return None
    first, last = samples[0], samples[-1]
    d_count = last.ttft_count - first.ttft_count
    if rule.ttft_mean_max_s is not None and d_count > 0:
        mean = (last.ttft_sum - first.ttft_sum) / d_count
        if mean > rule.ttft_mean_max_s:
            return f"mean TTFT {mean:.3f} s > {rule.ttft_mean_max_s} s"
    answers = last.answers - first.answers
    if rule.error_rate_max is not None and answers >= rule.min_requests:
        rate = (last.errors - first.errors) / answers
        if rate > rule.error_rate_max:
            return f"error rate {rate:.2f} > {rule.error_rate_max}"
    if rule.kv_free_min is not None and all(s.kv_free < rule.kv_free_min for s in samples):
        return f"KV free below {rule.kv_free_min} for {rule.window_s:.0f} s"
    return None


class DegradationWatcher:
    def __init__(self, pool: RestartablePool, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.clock = clock
        self._samples: dict[str, tuple[int, deque[Sample]]] = {}  # replica id -> (launch generation, window)
        self._last_restart: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._restarts: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        rules = [m.degradation for m in self.pool.models.values() if m.degradation is not None]
        if rules:
            interval = min(r.check_interval_s for r in rules)
            self._task = asyncio.create_task(self._loop(interval), name="pool-degradation")

    async def close(self) -> None:
        for task in [self._task, *self._restarts]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            live = {s.id for s in self.pool.slots()}
            for gone in [rid for rid in self._samples if rid not in live]:
                del self._samples[gone]
                self._last_restart.pop(gone, None)
            for slot in self.pool.slots():
                rule = slot.model.degradation
                if rule is not None and slot.state is SlotState.READY:
                    await self._check(slot, rule)

    def _sample(self, slot: Slot, now: float) -> Sample:
        replica = slot.replica
        m = replica.metrics  # the replica set's last scrape of the engine's /metrics
        attempts = replica.answered + replica.failed
        return Sample(now, m.ttft_sum, m.ttft_count, attempts, replica.failed, 1.0 - m.kv_usage)

    async def _check(self, slot: Slot, rule: DegradationRule) -> None:
        """Sample the slot, at most once per its rule's `check_interval_s` (the loop runs at the shortest interval
        of all rules: sampled at every turn, a model of a longer interval filled its bounded window before it
        spanned `window_s`, and its rule never fired), and restart it when the window breaks the rule."""
        now = self.clock()
        gen, window = self._samples.get(slot.id, (-1, deque[Sample]()))
        if gen != slot.gen:
            window = deque(maxlen=int(rule.window_s / rule.check_interval_s) + 2)
            self._samples[slot.id] = (slot.gen, window)
        elif window and now - window[-1].t < rule.check_interval_s * 0.9:  # (a late turn of the loop still samples)
            return
        window.append(self._sample(slot, now))
        while len(window) > 2 and window[-1].t - window[1].t >= rule.window_s:
            window.popleft()  # keep the shortest suffix that still spans the window
        why = degraded(rule, window)
        if why is None or self._restarts:
            return
        if now - self._last_restart.get(slot.id, -float("inf")) < rule.cooldown_s:
            return
        self._last_restart[slot.id] = now
        window.clear()
        log.warning("replica %s degraded (%s): rolling it", slot.id, why)
        task = asyncio.create_task(self._restart(slot.id, rule, why), name=f"degraded:{slot.id}")
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, replica_id: str, rule: DegradationRule, why: str) -> None:
        try:
            await self.pool.restart_one(replica_id, reason="degraded", wait_others_s=rule.check_interval_s)
        except PoolError as exc:
            log.warning("not restarting degraded replica %s (%s): %s", replica_id, why, exc)
