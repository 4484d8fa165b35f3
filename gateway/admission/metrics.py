"""Admission metrics, per tenant, on the app's own registry. The tenant label only takes configured tenant names
(plus the anonymous tenant), so its cardinality is bounded by the config."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.metrics import Labelled

WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class AdmissionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Labelled(
            Counter(
                "kvgate_tenant_requests",
                "Requests by tenant and final status.",
                ["tenant", "status"],
                registry=registry,
            )
        )
        self.tokens = Labelled(
            Counter(
                "kvgate_tenant_tokens",
                "Tokens by tenant and kind (prompt, cached, completion).",
                ["tenant", "kind"],
                registry=registry,
            )
        )
        self.rejections = Labelled(
            Counter(
                "kvgate_admission_rejections",
                "Requests refused by admission, by tenant and reason.",
                ["tenant", "reason"],
                registry=registry,
            )
        )
        self.queue_wait = Labelled(
            Histogram(
                "kvgate_queue_wait_seconds",
                "Time admitted requests waited in the gateway queue.",
                ["tenant"],
                buckets=WAIT_BUCKETS,
                registry=registry,
            )
        )
        self.concurrency = Labelled(
            Gauge(
                "kvgate_tenant_concurrency",
                "Requests of the tenant admitted and not finished (this gateway).",
                ["tenant"],
                registry=registry,
            )
        )
        self.queued = Gauge("kvgate_queue_depth", "Requests waiting in the gateway queue.", registry=registry)
        self.store_up = Labelled(
            Gauge(
                "kvgate_quota_store_up", "1 while the shared quota store (Redis) answers.", ["store"], registry=registry
            )
        )
        self.store_transitions = Labelled(
            Counter(
                "kvgate_quota_store_transitions",
                "Quota store availability changes.",
                ["store", "state"],
                registry=registry,
            )
        )
        self.store_fallbacks = Labelled(
            Counter(
                "kvgate_quota_store_fallbacks",
                "Checks answered by the failure policy while the store was down.",
                ["policy"],
                registry=registry,
            )
        )
