"""The `engines[]` entries (attached engines, or DNS names of engines) and disaggregated serving's settings: the
sections of the configuration that say where the engines kvgate did not start are (see gateway/config.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway import engine_urls
from policies.base import Role


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class DnsConfig(StrictModel):
    """Engines found by DNS (engine_pool.discovery): every address of the name is an attached engine; new ones join
    after a warm-up completion, vanished ones drain."""

    name: str = Field(
        min_length=1,
        description="the DNS name: its A/AAAA records at `port` (a Kubernetes headless Service, a compose service), "
        "or with `srv` an SRV name such as _http._tcp.engines.ns.svc.cluster.local",
    )
    port: int | None = Field(None, ge=1, le=65535, description="engine port of A/AAAA records (required without srv)")
    srv: bool = Field(False, description="resolve SRV records: each target at its own port")
    scheme: Literal["http", "https"] = Field("http", description="scheme of the engine URLs")
    nameserver: str | None = Field(
        None, description='"host" or "host:port" of the DNS server to ask; None = the system resolver (resolv.conf)'
    )
    interval_s: float = Field(5.0, gt=0, description="re-resolve period")
    timeout_s: float = Field(
        2.0, gt=0, description="deadline of one resolution; a failed one (timeout, SERVFAIL) keeps the known engines"
    )
    kv_events_port: int | None = Field(
        None, ge=1, le=65535, description="each engine's vLLM KV-events port: subscribed at tcp://ADDRESS:PORT"
    )
    kv_events_replay_port: int | None = Field(
        None, ge=1, le=65535, description="each engine's KV-events replay port (vLLM's replay_endpoint), if it has one"
    )
    drain_timeout_s: float = Field(
        60.0, gt=0, description="a vanished engine's in-flight requests get this long before it is removed"
    )
    warmup_timeout_s: float = Field(
        60.0, gt=0, description="deadline of the completion a new engine must answer before it is routed to"
    )
    max_endpoints: int = Field(256, ge=1, description="engines per name at most (further records are logged, ignored)")

    @model_validator(mode="after")
    def _port(self) -> DnsConfig:
        if not self.srv and self.port is None:
            raise ValueError("port is required unless srv is true (SRV records carry the ports)")
        return self


class EngineConfig(StrictModel):
    """An engine kvgate did not start (attached): probed and routed to, never restarted; or, with `dns`, every
    engine a DNS name resolves to."""

    url: str | None = Field(
        None,
        description="base URL of an engine speaking vLLM's OpenAI API (or give dns); kept in one spelling (scheme "
        "and host in lower case, no default port, no trailing slash): an engine listed twice is a config error",
    )
    dns: DnsConfig | None = Field(None, description="find the engines by DNS instead of one url")
    model: str | None = Field(None, description="served model name; discovered from /v1/models when omitted")
    name: str | None = Field(None, description="replica id; defaults to host:port (with dns: the id prefix)")
    metrics_url: str | None = Field(None, description="Prometheus endpoint; defaults to URL/metrics")
    kv_events_endpoint: str | None = Field(
        None,
        description="vLLM KV-events ZMQ endpoint, e.g. tcp://10.0.0.5:5557; omitted: the publisher the engine lists "
        "at GET /kv_event_sources (vLLM 0.32), each time it comes up",
    )
    kv_events_replay_endpoint: str | None = Field(
        None,
        description="the engine's KV-events replay ROUTER (vLLM's replay_endpoint, e.g. tcp://10.0.0.5:5558): the "
        "index is rebuilt from its buffer on start and gaps are filled from it",
    )
    tokenizer: str | None = Field(None, description='for prefix hashing: a local HF dir, "sim" or "chars"')
    max_concurrency: int | None = Field(None, ge=1, description="gateway-side concurrency gate for this replica")
    max_num_seqs: int | None = Field(
        None, ge=1, description="the engine's batch slots (its --max-num-seqs), for routing's queueing estimate"
    )
    role: Role = Field(
        "both",
        description="both = answers whole requests; prefill / decode = one side of disaggregated serving (the engine "
        "runs a KV connector that hands a prompt's KV from prefill to decode replicas)",
    )

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return engine_urls.normalize(v) if v is not None else None

    @model_validator(mode="after")
    def _one_source(self) -> EngineConfig:
        if (self.url is None) == (self.dns is None):
            raise ValueError("give exactly one of url and dns")
        if self.dns is not None and (self.metrics_url or self.kv_events_endpoint or self.kv_events_replay_endpoint):
            raise ValueError("with dns, metrics are at each engine's /metrics and KV events at dns.kv_events_port")
        return self


class DisaggregationConfig(StrictModel):
    """Disaggregated serving: used for a model when some of its replicas have role prefill."""

    min_prefill_tokens: int = Field(
        512,
        ge=0,
        description="a prompt whose uncached part (on the decode replica best placed for it) is shorter runs whole "
        "on a decode replica: computing it costs less than handing its KV over; 0 = split every request",
    )
    prefill_timeout_s: float = Field(
        60.0, gt=0, description="the prefill step's answer must come this soon, else it is tried elsewhere"
    )
