"""A managed replica's slot (its state, process and history), the pool's errors, and the pool's metrics."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from prometheus_client import CollectorRegistry

from engine_pool.launcher import EngineProcess
from engine_pool.replica import Replica
from engine_pool.spec import ModelPoolConfig
from kvcommon.fastmetrics import CallbackGauge, FastCounter, FastHistogram

After = Literal["stop", "restart", "remove", "backoff"]  # what a stopping replica does next


class SlotState(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    FAILED = "failed"
    REMOVED = "removed"


class PoolError(Exception):
    """An engine-pool operation that cannot be done (unknown replica, conflicting state)."""


class UnknownReplica(PoolError, KeyError):
    pass


@dataclass(eq=False)
class Slot:
    """One managed replica: its fixed identity and ports, and the state of its current process."""

    id: str
    model: ModelPoolConfig
    index: int
    port: int
    kv_port: int | None
    kv_replay_port: int | None
    replica: Replica
    state: SlotState = SlotState.STOPPED
    gen: int = 0
    process: EngineProcess | None = None
    after: After = "stop"
    drain: bool = False
    attempts: int = 0  # failures since the replica was last ready (backoff exponent)
    restarts: int = 0
    failures: deque[float] = field(default_factory=deque)
    last_error: str | None = None
    failure_reason: str = "crash"  # the last unplanned failure's kind: its restart's reason
    started_at: float = 0.0
    ready_at: float | None = None
    events: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=32))
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    waiters: list[tuple[frozenset[SlotState], int, asyncio.Future[SlotState]]] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "model": self.model.name,
            "kind": self.model.kind,
            "state": str(self.state),
            "url": self.replica.url,
            "kv_events_endpoint": self.replica.kv_events_endpoint,
            "pid": self.process.pid if self.process and self.process.returncode is None else None,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "in_flight": self.replica.in_flight,
            "events": [f"{t:.1f} {e}" for t, e in self.events],
        }


class PoolMetrics:
    """The pool's metrics; replica states are read from the slots themselves at scrape time (`slots`)."""

    def __init__(self, registry: CollectorRegistry, slots: Callable[[], Iterable[Slot]]) -> None:
        def states() -> list[tuple[tuple[str, str, str], float]]:
            return [
                ((slot.id, slot.model.name, st.value), 1.0 if st is slot.state else 0.0)
                for slot in slots()
                if slot.state is not SlotState.REMOVED
                for st in SlotState
                if st is not SlotState.REMOVED
            ]

        CallbackGauge(
            "kvgate_pool_replica_state",
            "1 for the current state of each managed replica.",
            ["replica", "model", "state"],
            registry,
            states,
        )
        self.restarts = FastCounter(
            "kvgate_pool_restarts", "Managed replica restarts by reason.", ["replica", "model", "reason"], registry
        )
        self.crash_loops = FastCounter(
            "kvgate_pool_crash_loops", "Crash loops detected (replica left failed).", ["replica", "model"], registry
        )
        self.startup = FastHistogram(
            "kvgate_pool_startup_seconds",
            "Launch to ready (warm-up done).",
            ["model"],
            registry,
            (1, 2.5, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600),
        )
