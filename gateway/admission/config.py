"""Typed admission configuration: tenants, API keys (stored as sha256 hashes), limits, priority classes, queue
bounds, the quota store (memory or Redis) and its failure policy, and per-tenant KV-cache isolation.

Keys are never stored in clear: `hash_key("sk-...")` (or `kvgate hash-key sk-...`) gives the
`sha256:<hex>` string to put under `tenants.<name>.keys`.
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

ANONYMOUS = "anonymous"


def hash_key(key: str) -> str:
    """The stored form of an API key: `sha256:` + hex digest of its UTF-8 bytes. A key read from a header that was
    not UTF-8 (aiohttp keeps such bytes as surrogates) is hashed as the bytes sent: it matches no stored key."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LimitsConfig(_Strict):
    """Per-tenant quotas; None = unlimited."""

    max_concurrency: int | None = Field(
        None, ge=1, description="the tenant's requests at once, queued ones included (429 beyond); None = unlimited"
    )
    requests_per_minute: int | None = Field(
        None, ge=1, description="requests admitted per clock minute (fixed window; 429 beyond); None = unlimited"
    )
    tokens_per_minute: int | None = Field(
        None,
        ge=1,
        description="tokens charged per clock minute: prompt estimate up front, reconciled to prompt + completion "
        "at the end; None = unlimited",
    )
    tokens_per_day: int | None = Field(
        None, ge=1, description="tokens charged per UTC day (same accounting as tokens_per_minute); None = unlimited"
    )
    cached_token_weight: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="fraction of a token charged for each prompt token the engine served from cache",
    )

    @cached_property
    def unlimited(self) -> bool:
        """No limit to check: admission takes no lease and leaves the quota store alone."""
        return (
            self.max_concurrency is None
            and self.requests_per_minute is None
            and self.tokens_per_minute is None
            and self.tokens_per_day is None
        )


class LatencyTargets(_Strict):
    ttft_s: float | None = Field(
        None,
        gt=0,
        description="time to first token, from arrival at the gateway (seconds; .inf: none; unset: inherited)",
    )
    tpot_s: float | None = Field(
        None, gt=0, description="time per output token after the first (seconds; .inf: none; unset: inherited)"
    )


# The shipped targets: a file's `default` or `classes.batch` that sets one field keeps the other's shipped value.
_SHIPPED_DEFAULT = {"ttft_s": 2.0, "tpot_s": 0.1}
_SHIPPED_CLASSES = {"batch": {"ttft_s": 600.0, "tpot_s": float("inf")}}


def _over(shipped: dict[str, float], given: object) -> object:
    """`given`'s fields over `shipped`'s (None or absent: shipped)."""
    if isinstance(given, LatencyTargets):
        given = given.model_dump()
    if not isinstance(given, dict):
        return given  # pydantic says what is wrong with it
    return {**shipped, **{k: v for k, v in given.items() if v is not None}}


class TargetsConfig(_Strict):
    enabled: bool = Field(
        True,
        description="admit a request only where some replica is predicted to meet its latency targets (or to start "
        "it at once); refuse the rest at once with 503 and Retry-After (the predicted drain); false = gates only",
    )
    default: LatencyTargets = Field(
        default_factory=lambda: LatencyTargets(ttft_s=2.0, tpot_s=0.1),
        description="targets of every request: 2 s to the first token and 100 ms per token protect a pool nobody "
        "has measured (past its knee time to first token jumps to tens of seconds: docs/admission.md); a field not "
        "given keeps its shipped value",
    )
    models: dict[str, LatencyTargets] = Field(
        default_factory=dict, description="per model (or alias target), over the default"
    )
    classes: dict[str, LatencyTargets] = Field(
        default_factory=lambda: {name: LatencyTargets(**t) for name, t in _SHIPPED_CLASSES.items()},
        description="per priority class, over the model's; a batch request may wait minutes (shipped: batch, TTFT "
        "600 s and no TPOT target, kept for the fields and classes a file does not give)",
    )

    @field_validator("default", mode="before")
    @classmethod
    def _default_over_shipped(cls, value: object) -> object:
        return _over(_SHIPPED_DEFAULT, value)

    @field_validator("classes", mode="before")
    @classmethod
    def _classes_over_shipped(cls, value: object) -> object:
        if not isinstance(value, dict):
            return value
        return {**_SHIPPED_CLASSES, **{name: _over(_SHIPPED_CLASSES.get(name, {}), t) for name, t in value.items()}}


class TenantConfig(_Strict):
    keys: list[str] = Field(
        default_factory=list,
        description='the tenant\'s API keys as "sha256:<hex>" (`kvgate hash-key KEY`); a key belongs to one tenant',
    )
    limits: LimitsConfig = Field(
        default_factory=LimitsConfig, description="the tenant's quotas; unset ones are unlimited"
    )
    weight: float = Field(
        1.0, gt=0.0, description="share of queue dispatches against other queued tenants of the same priority class"
    )
    priority: str | None = Field(
        None,
        description="highest priority class the tenant's requests get (also their default); None = the first class",
    )
    max_queued: int | None = Field(
        None, ge=0, description="most queued requests of this tenant (all models); None = queue.max_queued_per_tenant"
    )
    cache_isolation: bool = Field(
        False,
        description="inject a tenant-specific cache_salt (HMAC of the tenant name with cache_salt_secret) so its "
        "prompts never share KV blocks with other tenants'",
    )
    targets: LatencyTargets | None = Field(
        None, description="the tenant's latency targets, over its class's (admission.targets)"
    )
    cache_salt: str | None = Field(
        None, description="explicit salt for the tenant (implies isolation); None = derived as for cache_isolation"
    )

    @field_validator("keys")
    @classmethod
    def _hashed(cls, keys: list[str]) -> list[str]:
        for k in keys:
            digest = k.removeprefix("sha256:")
            if not k.startswith("sha256:") or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(
                    "keys must be 'sha256:<64 lowercase hex>': `kvgate hash-key KEY` prints a key's hash in that form"
                )
        return keys


class QueueConfig(_Strict):
    max_queued: int = Field(
        1024, ge=0, description="most queued requests across tenants and models; a full queue answers 503; 0 = no queue"
    )
    max_queued_per_tenant: int = Field(
        256, ge=0, description="most queued requests of one tenant (across models) unless its max_queued says otherwise"
    )
    max_wait_s: float = Field(
        30.0,
        gt=0,
        description="seconds a request may wait in the queue before 503 queue_timeout (one whose wait is predicted "
        "longer is refused at once: queue_wait); with a time-to-first-token target (admission.targets, on by default: "
        "2 s) at most what the target leaves after the predicted TTFT",
    )
    tick_s: float = Field(
        0.05,
        gt=0,
        description="seconds between re-checks of capacity for queued requests (engine metrics change unannounced)",
    )
    order: Literal["least-attained", "arrival"] = Field(
        "least-attained",
        description="within a tenant's fair share: least-attained = the request whose program (session) has had the "
        "least service so far first, then arrival (agent programs: a short one is not stuck behind a long one's "
        "next turn); arrival = first come, first served",
    )


def _redis_url(url: str) -> str:
    """A URL redis-py connects to: redis://, rediss:// (TLS) or unix:// (a socket path)."""
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or parts.port > 0
    except ValueError as exc:
        raise ValueError(f"not a Redis URL: {exc}") from None
    if parts.scheme not in ("redis", "rediss", "unix") or not (parts.hostname or parts.path) or not port_ok:
        raise ValueError("a Redis URL is redis://host[:port][/db], rediss://... (TLS) or unix:///path/to.sock")
    return url


RedisUrl = Annotated[str, AfterValidator(_redis_url)]


class RedisConfig(_Strict):
    url: RedisUrl = Field(description="Redis URL of the quota store shared by gateways, e.g. redis://127.0.0.1:6379/0")
    key_prefix: str = Field("kvgate", description="prefix of every Redis key: <prefix>:{<tenant>}:...")
    failure_policy: Literal["open", "closed"] = Field(
        "open",
        description="while Redis is down: open = each gateway enforces the limits from memory; closed = 503 "
        "quota_store_unavailable",
    )
    timeout_s: float = Field(
        0.25, gt=0, description="seconds per Redis connect or command; a slower Redis is marked down"
    )
    reconnect_min_s: float = Field(
        0.1, gt=0, description="first delay (seconds) between PINGs while Redis is down; doubles up to reconnect_max_s"
    )
    reconnect_max_s: float = Field(
        5.0, gt=0, description="longest delay (seconds) between reconnect PINGs; also Retry-After of fail-closed 503s"
    )
    lease_s: float = Field(
        120.0,
        gt=0,
        description="expiry (seconds) of a concurrency slot in Redis, renewed every lease_s/3 while the request runs; "
        "bounds how long a crashed gateway's slots stay taken; a gateway puts its live slots back within lease_s/3 "
        "when Redis lost them (restarted without persistence)",
    )


class AdmissionConfig(_Strict):
    auth: bool = Field(
        False,
        description="every request needs a configured tenant key (else 401): `Authorization: Bearer`, or "
        "Anthropic's `x-api-key` on the Messages routes and GET /v1/models (the two SDKs' headers); off = every "
        "request is anonymous_tenant",
    )
    anonymous_tenant: str = Field(
        ANONYMOUS, description="tenant of every request while auth is off (its limits come from tenants.<name>)"
    )
    tenants: dict[str, TenantConfig] = Field(
        default_factory=dict, description="tenant name -> its keys, quotas, queue weight, priority and cache isolation"
    )
    priority_classes: list[str] = Field(
        default_factory=lambda: ["interactive", "batch"],
        description="priority class names, highest first; a request may pick a lower one with x-kvgate-priority",
    )
    queue: QueueConfig = Field(
        default_factory=QueueConfig, description="bounds and timing of the per-model weighted fair queue"
    )
    targets: TargetsConfig = Field(
        default_factory=TargetsConfig,
        description="latency targets per model, priority class and tenant, and admission by predicted latency; a "
        "request may ask for looser ones with x-kvgate-slo-ttft-ms / x-kvgate-slo-tpot-ms (or llm-d's "
        "x-llm-d-slo-ttft-ms / x-llm-d-slo-tpot-ms)",
    )
    enabled: bool = Field(
        True, description="capacity gate and fair queue; false = neither (auth and quotas still apply)"
    )
    redis: RedisConfig | None = Field(
        None, description="quota store shared by gateways; None = quotas in this process's memory"
    )
    replica_max_concurrency: int | None = Field(
        None, ge=1, description="gate (requests in flight) for replicas configured without max_concurrency; None = none"
    )
    expected_context_tokens: int | None = Field(
        None,
        ge=1,
        description="for replicas without a gate: gate = engine KV capacity in tokens / this, once the engine reports "
        "it (overrides replica_max_concurrency)",
    )
    saturation_kv_usage: float = Field(
        0.95,
        gt=0.0,
        le=1.0,
        description="a replica with waiting requests and KV usage at or above this fraction is saturated: no capacity",
    )
    max_tenants: int = Field(
        10_000, ge=1, description="most configured tenants, and most tenants whose quota state is kept in memory"
    )
    cache_salt_secret: str | None = Field(
        None,
        description="HMAC key of derived tenant salts; required by cache_isolation without cache_salt; same on every "
        "gateway",
    )

    @model_validator(mode="after")
    def _consistent(self) -> AdmissionConfig:
        if not self.priority_classes or len(set(self.priority_classes)) != len(self.priority_classes):
            raise ValueError("priority_classes must be a non-empty list of distinct names")
        seen: dict[str, str] = {}
        for name, tenant in self.tenants.items():
            if tenant.priority is not None and tenant.priority not in self.priority_classes:
                raise ValueError(f"tenants.{name}.priority: unknown class {tenant.priority!r}")
            for k in tenant.keys:
                if k in seen:
                    raise ValueError(f"tenants.{name}.keys: key also belongs to tenant {seen[k]!r}")
                seen[k] = name
        for name in self.targets.classes:
            if name not in self.priority_classes and name not in _SHIPPED_CLASSES:
                raise ValueError(f"targets.classes.{name}: unknown class (priority_classes: {self.priority_classes})")
        if len(self.tenants) > self.max_tenants:
            raise ValueError(f"{len(self.tenants)} tenants, more than max_tenants ({self.max_tenants})")
        derived = [n for n, t in self.tenants.items() if t.cache_isolation and not t.cache_salt]
        if derived and not self.cache_salt_secret:
            raise ValueError(
                f"cache_salt_secret: required for cache_isolation without an explicit cache_salt (tenants "
                f"{', '.join(sorted(derived))}): without it their salts are an HMAC anyone can compute; set the same "
                "secret on every gateway"
            )
        return self

    def tenant(self, name: str) -> TenantConfig:
        return self.tenants.get(name) or _DEFAULT_TENANT


_DEFAULT_TENANT = TenantConfig()
