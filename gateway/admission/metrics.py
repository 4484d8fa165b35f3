"""Admission metrics, per tenant, on the app's own registry. The tenant label only takes configured tenant names
(plus the anonymous tenant), so its cardinality is bounded by the config."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry

from kvcommon.fastmetrics import CallbackGauge, FastCounter, FastGauge, FastHistogram, Value

WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class TenantMetrics:
    """One tenant's children, resolved once: a request updates them without a label lookup each."""

    __slots__ = ("_requests", "_tenant", "cached", "completion", "prompt")

    def __init__(self, metrics: AdmissionMetrics, tenant: str) -> None:
        self.prompt = metrics.tokens.labels(tenant, "prompt")
        self.cached = metrics.tokens.labels(tenant, "cached")
        self.completion = metrics.tokens.labels(tenant, "completion")
        self._requests = metrics.requests
        self._tenant = tenant

    def requests(self, status: str) -> Value:
        return self._requests.labels(self._tenant, status)


class AdmissionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = self.registry = registry
        self._tenants: dict[str, TenantMetrics] = {}  # bounded: tenant names come from the config
        self.requests = FastCounter(
            "kvgate_tenant_requests", "Requests by tenant and final status.", ["tenant", "status"], r
        )
        self.tokens = FastCounter(
            "kvgate_tenant_tokens", "Tokens by tenant and kind (prompt, cached, completion).", ["tenant", "kind"], r
        )
        self.rejections = FastCounter(
            "kvgate_admission_rejections",
            "Requests refused by admission, by tenant and reason.",
            ["tenant", "reason"],
            r,
        )
        self.queue_wait = FastHistogram(
            "kvgate_queue_wait_seconds",
            "Time admitted requests waited in the gateway queue.",
            ["tenant"],
            r,
            WAIT_BUCKETS,
        )
        self.store_up = FastGauge(
            "kvgate_quota_store_up", "1 while the shared quota store (Redis) answers.", ["store"], r
        )
        self.store_transitions = FastCounter(
            "kvgate_quota_store_transitions", "Quota store availability changes.", ["store", "state"], r
        )
        self.store_fallbacks = FastCounter(
            "kvgate_quota_store_fallbacks",
            "Checks answered by the failure policy while the store was down.",
            ["policy"],
            r,
        )

    def export(self, in_flight: Callable[[], Mapping[str, int]], queued: Callable[[], int]) -> None:
        """Gauges read from the admission controller's own state at scrape time."""
        CallbackGauge(
            "kvgate_tenant_concurrency",
            "Requests of the tenant admitted and not finished (this gateway).",
            ["tenant"],
            self.registry,
            lambda: [((tenant,), n) for tenant, n in in_flight().items()],
        )
        CallbackGauge(
            "kvgate_queue_depth", "Requests waiting in the gateway queue.", [], self.registry, lambda: [((), queued())]
        )

    def tenant(self, name: str) -> TenantMetrics:
        found = self._tenants.get(name)
        if found is None:
            found = self._tenants[name] = TenantMetrics(self, name)
        return found
