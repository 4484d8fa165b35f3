"""The degradation watcher's cadence: each model's rule samples its replicas at its own `check_interval_s`, whatever
interval the watcher's loop runs at (the shortest of all the rules), so its window spans `window_s` and the rule
fires; literal samples, a fake clock, no engine."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from engine_pool.degradation import DegradationWatcher
from engine_pool.slots import SlotState
from engine_pool.spec import DegradationRule


class Pool:
    def __init__(self, slot: Any) -> None:
        self.models: dict[str, Any] = {}
        self.slot = slot
        self.restarted: list[str] = []

    def slots(self) -> list[Any]:
        return [self.slot]

    async def restart_one(self, replica_id: str, *, reason: str, wait_others_s: float | None = None) -> object:
        self.restarted.append(replica_id)
        return None


async def test_a_rule_with_a_longer_interval_than_the_loops_still_fires() -> None:
    """The loop turns every second (another model's rule checks each second); this rule checks every 10 s over a
    60 s window, and its replica's mean time to first token is 5 s against a limit of 0.1 s: it is restarted."""
    rule = DegradationRule(window_s=60, check_interval_s=10, ttft_mean_max_s=0.1)
    metrics = SimpleNamespace(ttft_sum=0.0, ttft_count=0.0, kv_usage=0.0)
    replica = SimpleNamespace(metrics=metrics, answered=0, failed=0)
    slot = SimpleNamespace(id="m-0", gen=1, model=SimpleNamespace(degradation=rule), state=SlotState.READY,
                           replica=replica)  # fmt: skip
    pool = Pool(slot)
    now = [0.0]
    watcher = DegradationWatcher(pool, clock=lambda: now[0])  # type: ignore[arg-type]
    for second in range(200):
        now[0] = float(second)
        metrics.ttft_sum, metrics.ttft_count = 5.0 * second, float(second)  # one request a second, 5 s each
        await watcher._check(slot, rule)  # type: ignore[arg-type]  # a turn of the loop
        if watcher._restarts:
            await asyncio.gather(*watcher._restarts)
            break
    assert pool.restarted == ["m-0"] and now[0] <= 80
