"""The gateway's own Prometheus metrics, on a registry owned by the app (no process-global registry).

Buckets cover sub-millisecond gateway overhead up to multi-minute generations.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)


class Labelled(Generic[M]):
    """A labelled metric whose children are cached by label values: `labels()` costs one dict lookup instead of
    prometheus_client's validation and locking on every request. Cardinality is the metric's own."""

    __slots__ = ("_children", "metric")

    def __init__(self, metric: M) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], M] = {}

    def labels(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Labelled(
            Counter(
                "kvgate_requests",
                "Requests answered, by model, replica, endpoint and status.",
                ["model", "replica", "endpoint", "status"],
                registry=registry,
            )
        )
        self.ttft = Labelled(
            Histogram(
                "kvgate_time_to_first_token_seconds",
                "Time from request arrival to the first token byte sent.",
                ["model"],
                buckets=LATENCY_BUCKETS,
                registry=registry,
            )
        )
        self.itl = Labelled(
            Histogram(
                "kvgate_inter_token_latency_seconds",
                "Time between streamed chunks relayed to the client.",
                ["model"],
                buckets=ITL_BUCKETS,
                registry=registry,
            )
        )
        self.e2e = Labelled(
            Histogram(
                "kvgate_e2e_request_latency_seconds",
                "Time from request arrival to the last byte sent.",
                ["model"],
                buckets=LATENCY_BUCKETS,
                registry=registry,
            )
        )
        self.in_flight = Labelled(
            Gauge("kvgate_replica_in_flight", "Requests in flight per replica.", ["replica"], registry=registry)
        )
        self.replica_ready = Labelled(
            Gauge("kvgate_replica_ready", "1 when the replica is routable.", ["replica", "model"], registry=registry)
        )
        self.upstream_errors = Labelled(
            Counter(
                "kvgate_upstream_errors",
                "Failed upstream attempts by replica and kind.",
                ["replica", "kind"],
                registry=registry,
            )
        )
        self.retries = Labelled(
            Counter("kvgate_retries", "Attempts retried on another replica.", ["model"], registry=registry)
        )
        self.decisions = Labelled(
            Counter(
                "kvgate_routing_decisions",
                "Routing decisions by policy and reason.",
                ["policy", "reason"],
                registry=registry,
            )
        )
        self.cancelled = Labelled(
            Counter(
                "kvgate_client_disconnects", "Requests whose client left before the end.", ["model"], registry=registry
            )
        )
        self.tokens = Labelled(
            Counter(
                "kvgate_tokens",
                "Tokens by kind (prompt, cached, completion), from engine usage.",
                ["model", "kind"],
                registry=registry,
            )
        )
