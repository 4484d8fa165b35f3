"""Typed configuration: the model of the whole file (`GatewayConfig`) and of its sections kept here; the other
sections' models live with what they configure (server, engines, admission, cache, pool). Every model forbids
unknown keys. Loading (file, environment, flags) and its errors: `gateway.config_load`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from cacheindex.config import CacheConfig
from engine_pool.spec import PoolConfig
from gateway import engine_urls
from gateway.admission.config import AdmissionConfig, RedisUrl
from gateway.engines_config import DisaggregationConfig, EngineConfig, StrictModel
from gateway.server_config import ServerConfig
from policies.registry import params_model, policy_names


class TimeoutConfig(StrictModel):
    connect_s: float = Field(5.0, gt=0, description="TCP connect to an engine")
    first_byte_s: float = Field(
        120.0,
        gt=0,
        description="a stream's first event must come this soon, else it is retried on another replica (a whole "
        "answer is waited for until total_s and not retried: its headers come only when it is done)",
    )
    total_s: float = Field(1800.0, gt=0, description="whole request")
    stream_idle_s: float = Field(
        60.0,
        gt=0,
        description="a stream that started and then sends nothing for this long is ended with an error event (found "
        "within a tenth of this, at most 1 s, after it); a client that takes none of its stream for this long is "
        "disconnected (499), its engine not blamed",
    )


class RetryConfig(StrictModel):
    max_attempts: int = Field(
        3, ge=1, le=10, description="attempts on distinct replicas while nothing reached the client"
    )
    breaker_failures: int = Field(3, ge=1, description="consecutive failures that open a replica's circuit breaker")
    breaker_cooldown_s: float = Field(5.0, gt=0, description="open time before trial traffic may close the breaker")
    migrate_streams: bool = Field(
        True,
        description="a chat, completions or Messages stream whose engine fails after the first token (reset, stalled "
        "past timeouts.stream_idle_s, cut short) continues on another replica in the same client stream: the request "
        "is re-sent with the answer so far (completions: appended to the prompt; chat, and Messages through chat: the "
        "assistant message continued) and max_tokens less what was delivered; counted in "
        "kvgate_stream_migrations_total",
    )
    max_migrations: int = Field(2, ge=1, le=10, description="continuations of one stream at most")
    migration_buffer_bytes: int = Field(
        1024 * 1024,
        ge=1024,
        description="bytes of relayed events kept per stream for a migration; a longer answer is not migrated",
    )


class HealthConfig(StrictModel):
    interval_s: float = Field(2.0, gt=0, description="health probe period per replica (GET /health)")
    timeout_s: float = Field(2.0, gt=0, description="probe and scrape deadline")
    metrics_interval_s: float = Field(
        1.0, gt=0, description="engine /metrics scrape period (running, waiting, KV usage)"
    )


_MIN_CANDIDATES = 9  # the sample (8) and one holder


class RoutingConfig(StrictModel):
    policy: str = Field("cache-aware", description="routing policy: cache-aware (the default), least-load, round-robin")
    max_candidates: int = Field(
        16,
        ge=_MIN_CANDIDATES,
        description="with more replicas of a model than this, cache-aware routing (and admission's verdict on "
        "latency targets) weighs only the replicas that hold the prompt's first block, the session's, and a random "
        "sample of the others (at least 8: the power of d choices), so its cost per request does not grow with the "
        "pool",
    )
    max_weighed: int = Field(
        4,
        ge=2,
        description="of the candidates, cache-aware routing (and admission's verdict on latency targets) weighs "
        "at most this many with its full cost model (predictions, placement): the session's replica and the deepest "
        "holders of the prompt (up to half), then by turns the least loaded and those with the most KV room; the "
        "others are only snapshotted and looked up in the prefix index, so the cost per request grows little with "
        "the pool",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="the policy's parameters, validated by its model at load time (below: `routing.params` per policy)",
    )
    disaggregation: DisaggregationConfig = Field(
        default_factory=DisaggregationConfig,
        description="when a request's prompt is computed on a prefill replica and its KV handed to a decode replica",
    )

    @field_validator("policy")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in policy_names():
            raise ValueError(f"unknown routing policy {v!r}; known: {', '.join(policy_names())}")
        return v

    @field_validator("params")
    @classmethod
    def _params_fit_the_policy(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """Bad parameters fail at load time with their path (`routing.params.imbalance_cost: ...`): pydantic
        prefixes the nested model's errors with this field's location."""
        policy = info.data.get("policy")
        if policy is not None:  # None: the policy name was invalid, and that error is reported
            params_model(policy).model_validate(v)
        return v


class FleetConfig(StrictModel):
    """Routing state shared by several gateways through Redis (gateway.fleet)."""

    share_routing: bool = Field(
        True,
        description="with a Redis (redis_url, else admission.redis.url) and the cache-aware policy: publish every "
        "routing decision (prompt blocks, session binding) on a Redis stream and apply the other gateways' ones, "
        "and keep session bindings in Redis with their TTL, so every gateway routes as one would",
    )
    redis_url: RedisUrl | None = Field(
        None, description="Redis of the shared routing state; None = admission.redis.url"
    )
    channel: str = Field("kvgate:routing", description="Redis stream of the routing decisions")
    history: int = Field(
        20_000,
        ge=1,
        description="decisions kept in the stream: a gateway that starts rebuilds its approximate index "
        "from them, and one that lost Redis for a while catches up",
    )
    key_prefix: str = Field("kvgate", description="session bindings are stored at <prefix>:session:<digest>")
    flush_ms: float = Field(
        2.0, ge=0, description="decisions are published in batches, at most this long after the first of a batch"
    )
    max_pending: int = Field(
        4096, ge=1, description="decisions waiting to be published at most; older ones are dropped (and counted)"
    )
    timeout_s: float = Field(
        0.1, gt=0, description="seconds per Redis command; a session lookup never holds a request longer"
    )
    response_ttl_s: float = Field(
        86_400.0,
        ge=1,
        description="which replica holds a stored response (/v1/responses/{id}) is kept in Redis this long",
    )
    reconnect_max_s: float = Field(5.0, gt=0, description="longest delay between reconnect attempts")
    claim_ms: float = Field(
        1000.0,
        ge=0,
        description="a cold prefix (no replica holds its first block) placed by one gateway is claimed in Redis this "
        "long: another gateway placing the same prefix meanwhile sends it to the same replica (a burst of one new "
        "prefix through several gateways lands on one replica, as through one gateway); costs one Redis round trip "
        "per cold placement; 0 = off",
    )


class AdapterSpec(StrictModel):
    """A LoRA adapter the gateway may load on an engine at run time (vLLM's /v1/load_lora_adapter)."""

    base: str = Field(description="the served model it was trained for: only that model's replicas load it")
    path: str = Field(description="what the engine loads it from (a folder on the engine's machine)")


class ModelsConfig(StrictModel):
    """Names clients may use beyond the served ones, and where a model's requests go when it has no capacity."""

    aliases: dict[str, str] = Field(
        default_factory=dict,
        description="requested name -> served model or adapter, e.g. {gpt-4o-mini: tiny-llama}; listed by "
        "/v1/models; the response's `model` is what the engine served",
    )
    fallbacks: dict[str, list[str]] = Field(
        default_factory=dict,
        description="model -> models to try in order when it has no capacity now (a 503 for no ready replica, its "
        "queue full, a queue wait predicted or found past the request's budget, or its latency targets out of reach "
        "on every replica), e.g. {big: [small]}; counted in kvgate_model_fallbacks_total and named in "
        "the x-kvgate-fallback response header; the last one's 503 (with Retry-After) is the answer",
    )
    dynamic_lora: bool = Field(
        False,
        description="a request for an adapter of `adapters` that no ready replica holds loads it first on the best "
        "replica of its base model (free adapter slot, then least load), unloading that replica's least recently "
        "requested adapter when its `lora_slots` are full; concurrent requests wait for that one load; the engines "
        "need vLLM's runtime LoRA API (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1: pool `dynamic_lora: true`)",
    )
    adapters: dict[str, AdapterSpec] = Field(
        default_factory=dict,
        description="adapter name -> {base, path}: the adapters `dynamic_lora` may load, e.g. "
        "{sql: {base: tiny, path: /adapters/sql}}",
    )
    lora_slots: int = Field(
        1,
        ge=1,
        description="adapters a replica holds at most when kvgate loads them (set it to the engines' --max-loras)",
    )
    lora_replicate_load: int | None = Field(
        8,
        ge=1,
        description="a dynamic adapter whose every holder has this many requests outstanding (in flight or queued "
        "at the engine) is loaded on one more replica of its base model that has a free slot and less load, in the "
        "background; None = one replica per adapter unless it is lost",
    )
    lora_load_timeout_s: float = Field(
        120.0, gt=0, description="longest wait for one adapter load (or unload); then the requests waiting get 504"
    )

    @model_validator(mode="after")
    def _no_chains(self) -> ModelsConfig:
        for alias, target in self.aliases.items():
            if target in self.aliases:
                raise ValueError(f"aliases.{alias}: {target!r} is an alias itself (aliases resolve once)")
        for model, chain in self.fallbacks.items():
            if model in chain or len(set(chain)) != len(chain):
                raise ValueError(f"fallbacks.{model}: a model appears twice in its chain")
            if model in self.aliases or any(m in self.aliases for m in chain):
                raise ValueError(f"fallbacks.{model}: name served models, not aliases")
        if self.dynamic_lora and not self.adapters:
            raise ValueError("dynamic_lora: name the adapters it may load in `adapters`")
        for name, spec in self.adapters.items():
            if spec.base in self.adapters:
                raise ValueError(f"adapters.{name}: the base must be a served model, not the adapter or another one")
        return self


class TracingConfig(StrictModel):
    """OpenTelemetry spans of every request's stages (gateway.tracing; needs `pip install "kvgate[tracing]"`)."""

    otlp_endpoint: str | None = Field(
        None, description="OTLP/HTTP traces endpoint, e.g. http://otel-collector:4318/v1/traces; None = tracing off"
    )
    service_name: str = Field("kvgate", description="the spans' service.name")
    sample_ratio: float = Field(
        1.0,
        ge=0,
        le=1,
        description="share of requests traced that came without a traceparent (a client's sampled "
        "one is always continued, its unsampled one never traced; either is passed on to the engine, with its "
        "tracestate)",
    )
    headers: dict[str, str] = Field(default_factory=dict, description="headers of the OTLP requests (auth)")
    timeout_s: float = Field(5.0, gt=0, description="deadline of one export")
    max_queue: int = Field(8192, ge=1, description="spans waiting for export at most; more are dropped")


class AdminConfig(StrictModel):
    key: str | None = Field(None, description="bearer key for /admin/*; admin endpoints are off when unset")


class GatewayConfig(StrictModel):
    server: ServerConfig = Field(
        default_factory=ServerConfig, description="the HTTP listener: address, request and connection limits, logging"
    )
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig, description="deadlines of requests sent to engines")
    retry: RetryConfig = Field(
        default_factory=RetryConfig, description="retries on other replicas and per-replica circuit breakers"
    )
    health: HealthConfig = Field(
        default_factory=HealthConfig, description="health probes and /metrics scrapes of every engine"
    )
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="routing policy and its parameters")
    admin: AdminConfig = Field(default_factory=AdminConfig, description="the /admin/* API and its bearer key")
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig, description="tenants, API keys, quotas, capacity gate and fair queue"
    )
    cache: CacheConfig = Field(
        default_factory=CacheConfig,
        description="prefix hashing, KV block index, KV events and sessions; used only by the cache-aware routing "
        "policy",
    )
    models: ModelsConfig = Field(
        default_factory=ModelsConfig, description="model aliases and ordered fallbacks when a model has no capacity"
    )
    tracing: TracingConfig = Field(
        default_factory=TracingConfig, description="OpenTelemetry spans along the request path (OTLP/HTTP)"
    )
    fleet: FleetConfig = Field(
        default_factory=FleetConfig,
        description="several gateways behind one load balancer: the routing state they share through Redis",
    )
    engines: list[EngineConfig] = Field(
        default_factory=list,
        description="engines kvgate did not start (attached): probed and routed to, never restarted",
    )
    pool: PoolConfig | None = Field(
        None, description="engines kvgate launches and supervises (engine_pool.spec); None = none"
    )

    @model_validator(mode="after")
    def _engines_once(self) -> GatewayConfig:
        problems = engine_urls.duplicates([(e.url, e.name) for e in self.engines])
        if problems:
            raise ValueError("; ".join(problems))
        return self
