"""The gateway's own Prometheus metrics, on a registry owned by the app (no process-global registry).

Buckets cover sub-millisecond gateway overhead up to multi-minute generations.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry

from engine_pool.discovery import DnsDiscovery
from engine_pool.replica import Replica
from kvcommon.fastmetrics import Buckets, CallbackGauge, FastCounter, FastHistogram, Value

GC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)


class ModelMetrics:
    """One model's children, resolved once: a request updates them without a label lookup each."""

    __slots__ = (
        "cached",
        "cancelled",
        "completion",
        "e2e",
        "itl",
        "migrated",
        "migration_closed",
        "migration_failed",
        "prompt",
        "retries",
        "ttft",
    )

    def __init__(self, metrics: GatewayMetrics, model: str) -> None:
        self.ttft: Buckets = metrics.ttft.labels(model)
        self.itl: Buckets = metrics.itl.labels(model)
        self.e2e: Buckets = metrics.e2e.labels(model)
        self.prompt: Value = metrics.tokens.labels(model, "prompt")
        self.cached: Value = metrics.tokens.labels(model, "cached")
        self.completion: Value = metrics.tokens.labels(model, "completion")
        self.cancelled: Value = metrics.cancelled.labels(model)
        self.retries: Value = metrics.retries.labels(model)
        self.migrated: Value = metrics.migrations.labels(model, "resumed")
        self.migration_failed: Value = metrics.migrations.labels(model, "failed")
        self.migration_closed: Value = metrics.migrations.labels(model, "closed")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._models: dict[str, ModelMetrics] = {}  # bounded: only models the replica set serves get here
        r = registry
        self.requests = FastCounter(
            "kvgate_requests",
            "Requests answered, by model, replica, endpoint and status.",
            ["model", "replica", "endpoint", "status"],
            r,
        )
        self.ttft = FastHistogram(
            "kvgate_time_to_first_token_seconds",
            "Time from request arrival to the first token byte sent (every request that got one, also those whose "
            "client left before the end).",
            ["model"],
            r,
            LATENCY_BUCKETS,
        )
        self.itl = FastHistogram(
            "kvgate_inter_token_latency_seconds", "Time between streamed chunks relayed to the client.", ["model"], r,
            ITL_BUCKETS,
        )  # fmt: skip
        self.e2e = FastHistogram(
            "kvgate_e2e_request_latency_seconds",
            "Time from request arrival to the last byte sent.",
            ["model"],
            r,
            LATENCY_BUCKETS,
        )
        self.upstream_errors = FastCounter(
            "kvgate_upstream_errors",
            "Failed upstream attempts by replica and kind (connect, protocol, timeout, reset, empty, http_<status>, "
            "bad_status, not_json, timeout_total, reset_mid_stream, stall_mid_stream; prefill_ before a prefill "
            "step's).",
            ["replica", "kind"],
            r,
        )
        self.retries = FastCounter("kvgate_retries", "Attempts retried on another replica.", ["model"], r)
        self.migrations = FastCounter(
            "kvgate_stream_migrations",
            "Streams whose engine failed mid-answer, by outcome: resumed on another replica in the same client "
            "stream, closed by the gateway (nothing was left to generate: the answer's end written as the engine "
            "would have), or failed (the client got an error event).",
            ["model", "outcome"],
            r,
        )
        self.decisions = FastCounter(
            "kvgate_routing_decisions", "Routing decisions by policy and reason.", ["policy", "reason"], r
        )
        self.decisions_in_seconds = FastCounter(
            "kvgate_routing_seconds_decisions",
            "Routing decisions priced in predicted seconds (cache-aware, once every candidate's latency model knows "
            "its prefill speed); the rest are priced in token equivalents.",
            ["policy"],
            r,
        )
        self.cancelled = FastCounter(
            "kvgate_client_disconnects", "Requests whose client left before the end.", ["model"], r
        )
        self.fallbacks = FastCounter(
            "kvgate_model_fallbacks",
            "Requests for a model without capacity sent on to a fallback model (models.fallbacks).",
            ["model", "fallback"],
            r,
        )
        self.lora_loads = FastCounter(
            "kvgate_lora_loads",
            "LoRA adapter loads kvgate asked an engine for (models.dynamic_lora), by outcome: loaded, failed, "
            "timeout, unreachable, no_replica.",
            ["adapter", "outcome"],
            r,
        )
        self.lora_unloads = FastCounter(
            "kvgate_lora_unloads",
            "LoRA adapters unloaded to free a slot for another (least recently requested first), by outcome.",
            ["adapter", "outcome"],
            r,
        )
        self.connections_refused = FastCounter(
            "kvgate_client_connections_refused", "Connections refused over server.max_connections.", [], r
        ).labels()
        self.connections_reclaimed = FastCounter(
            "kvgate_client_connections_reclaimed",
            "Idle keep-alive connections closed at server.max_connections to let a new connection in.",
            [],
            r,
        ).labels()
        self.disagg = FastCounter(
            "kvgate_disagg_requests",
            "Requests of disaggregated models by how they ran: split (prefill step, then decode) or aggregated, "
            "with why (short-prompt, prefill-saturated, no-prefill-replica, prefill-failed).",
            ["model", "mode"],
            r,
        )
        self.prefill_step = FastHistogram(
            "kvgate_disagg_prefill_seconds",
            "The prefill step of split requests: sent to a prefill replica until its answer (the KV hand-over "
            "follows in the decode replica's time to first token).",
            ["model"],
            r,
            LATENCY_BUCKETS,
        )
        self.handover = FastHistogram(
            "kvgate_disagg_handover_seconds",
            "Split requests: from the prefill step's answer to the decode replica's first token (the KV hand-over "
            "and the first decode step; the decode after it is e2e less time to first token).",
            ["model"],
            r,
            LATENCY_BUCKETS,
        )
        self.tokens = FastCounter(
            "kvgate_tokens",
            "Tokens by kind (prompt, cached, completion), from engine usage (a cut stream: those delivered).",
            ["model", "kind"],
            r,
        )

    @contextmanager
    def gc_pauses(self) -> Iterator[None]:
        """While inside: every garbage collection of the process is timed, by generation. A collection stops the
        event loop, so its pause is every in-flight request's (a full one over a heap of startup objects took
        30-35 ms here until `gateway.serve` froze them)."""
        pauses = FastHistogram(
            "kvgate_gc_pause_seconds",
            "Python garbage collections of the gateway process (each pauses every request), by generation.",
            ["generation"],
            self.registry,
            GC_BUCKETS,
        )
        by_generation = [pauses.labels(str(g)) for g in range(3)]
        started = [0.0]

        def timed(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                by_generation[info["generation"]].observe(time.perf_counter() - started[0])

        gc.callbacks.append(timed)
        try:
            yield
        finally:
            gc.callbacks.remove(timed)

    def export_connections(self, open_connections: Callable[[], int]) -> None:
        """The server's open client connections, read from the listener at scrape time."""
        CallbackGauge(
            "kvgate_client_connections",
            "Open client connections (server.max_connections caps them).",
            [],
            self.registry,
            lambda: [((), open_connections())],
        )

    def export_discovery(self, discoveries: Iterable[DnsDiscovery]) -> None:
        """Per DNS discovery target: the engines its name stands for, and its failed resolutions in a row."""
        CallbackGauge(
            "kvgate_discovery_endpoints",
            "Engines a DNS discovery name resolves to now (engines.dns).",
            ["target"],
            self.registry,
            lambda: [((d.target.id,), d.endpoints) for d in discoveries],
        )
        CallbackGauge(
            "kvgate_discovery_failing_resolutions",
            "Failed resolutions in a row of a DNS discovery name (0 after a success); the engines are kept meanwhile.",
            ["target"],
            self.registry,
            lambda: [((d.target.id,), d.failing) for d in discoveries],
        )

    def export_replicas(self, replicas: Iterable[Replica]) -> None:
        """Per-replica gauges read from the replicas themselves at scrape time."""

        def in_flight() -> list[tuple[tuple[str], float]]:
            return [((r.id,), r.in_flight) for r in replicas]

        def ready() -> list[tuple[tuple[str, str], float]]:
            now = time.monotonic()
            return [((r.id, r.model or "?"), 1.0 if r.routable(now) else 0.0) for r in replicas]

        def adapter_replicas() -> list[tuple[tuple[str], float]]:
            held: dict[str, int] = {}
            for r in replicas:
                for adapter in r.adapters:
                    held[adapter] = held.get(adapter, 0) + 1
            return [((adapter,), n) for adapter, n in held.items()]

        CallbackGauge(
            "kvgate_replica_in_flight", "Requests in flight per replica.", ["replica"], self.registry, in_flight
        )
        CallbackGauge(
            "kvgate_lora_adapter_replicas",
            "Replicas holding each LoRA adapter now (its requests per adapter: kvgate_requests_total{model}).",
            ["adapter"],
            self.registry,
            adapter_replicas,
        )

        def queue_price() -> list[tuple[tuple[str], float]]:
            return [((r.id,), price) for r in replicas if (price := r.queue_price.value) is not None]

        CallbackGauge(
            "kvgate_replica_ready", "1 when the replica is routable.", ["replica", "model"], self.registry, ready
        )
        CallbackGauge(
            "kvgate_replica_queue_price_tokens",
            "What one more outstanding request on the replica costs, in prompt tokens of prefill, learned from its "
            "metrics (2 x decode slowdown per sequence x output tokens / prefill seconds per token); absent until "
            "known",
            ["replica"],
            self.registry,
            queue_price,
        )

    # --- a replica removed for good (engine_pool.replica_set.ReplicaListener): its series go --------------------
    def replica_up(self, replica: Replica) -> None:
        pass

    def replica_down(self, replica: Replica) -> None:
        pass

    def replica_removed(self, replica: Replica) -> None:
        self.requests.forget("replica", replica.id)
        self.upstream_errors.forget("replica", replica.id)

    def model(self, name: str) -> ModelMetrics:
        found = self._models.get(name)
        if found is None:
            found = self._models[name] = ModelMetrics(self, name)
        return found
