"""Typed admission configuration: tenants, API keys (stored as sha256 hashes), limits, priority classes, queue
bounds, the quota store (memory or Redis) and its failure policy, and per-tenant KV-cache isolation.

Keys are never stored in clear: `hash_key("sk-...")` (or `python -m gateway.admission.config sk-...`) gives the
`sha256:<hex>` string to put under `tenants.<name>.keys`.
"""

from __future__ import annotations

import hashlib
import sys
from functools import cached_property
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ANONYMOUS = "anonymous"


def hash_key(key: str) -> str:
    """The stored form of an API key: `sha256:` + hex digest of its UTF-8 bytes."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LimitsConfig(_Strict):
    """Per-tenant quotas; None = unlimited."""

    max_concurrency: int | None = Field(None, ge=1)  # concurrent requests (queued ones included)
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)  # prompt + completion, reconciled at the end
    tokens_per_day: int | None = Field(None, ge=1)  # optional daily budget
    cached_token_weight: float = Field(1.0, ge=0.0, le=1.0)  # charge for a prompt token that hit the cache

    @cached_property
    def unlimited(self) -> bool:
        """No limit to check: admission takes no lease and leaves the quota store alone."""
        return (
            self.max_concurrency is None
            and self.requests_per_minute is None
            and self.tokens_per_minute is None
            and self.tokens_per_day is None
        )


class TenantConfig(_Strict):
    keys: list[str] = Field(default_factory=list)  # "sha256:<hex>" (see hash_key)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    weight: float = Field(1.0, gt=0.0)  # share in the weighted fair queue
    priority: str | None = None  # highest priority class this tenant may use; None = the first class
    max_queued: int | None = Field(None, ge=0)  # per-tenant queue bound; None = queue.max_queued_per_tenant
    cache_isolation: bool = False  # inject a tenant-specific cache_salt
    cache_salt: str | None = None  # explicit salt (implies isolation); default derived from the tenant name

    @field_validator("keys")
    @classmethod
    def _hashed(cls, keys: list[str]) -> list[str]:
        for k in keys:
            digest = k.removeprefix("sha256:")
            if not k.startswith("sha256:") or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError("keys must be 'sha256:<64 lowercase hex>' (use gateway.admission.config.hash_key)")
        return keys


class QueueConfig(_Strict):
    max_queued: int = Field(1024, ge=0)  # global bound across tenants and models
    max_queued_per_tenant: int = Field(256, ge=0)
    max_wait_s: float = Field(30.0, gt=0)
    tick_s: float = Field(0.05, gt=0)  # re-check capacity at least this often (engine metrics change unannounced)


class RedisConfig(_Strict):
    url: str
    key_prefix: str = "kvgate"
    failure_policy: Literal["open", "closed"] = "open"  # open: local limits while Redis is down; closed: 503
    timeout_s: float = Field(0.25, gt=0)  # per command; a slow Redis counts as down
    reconnect_min_s: float = Field(0.1, gt=0)
    reconnect_max_s: float = Field(5.0, gt=0)
    lease_s: float = Field(120.0, gt=0)  # concurrency slot lease, renewed while the request runs


class AdmissionConfig(_Strict):
    auth: bool = False  # True: every request needs a known `Authorization: Bearer` key
    anonymous_tenant: str = ANONYMOUS  # the tenant of every request when auth is off
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    priority_classes: list[str] = Field(default_factory=lambda: ["interactive", "batch"])  # highest first
    queue: QueueConfig = Field(default_factory=QueueConfig)
    enabled: bool = True  # False: no capacity gate and no queue (quotas and auth still apply)
    redis: RedisConfig | None = None  # None: quotas in process memory
    replica_max_concurrency: int | None = Field(None, ge=1)  # default gate for replicas configured without one
    expected_context_tokens: int | None = Field(None, ge=1)  # derive a gate from KV capacity / this length
    saturation_kv_usage: float = Field(0.95, gt=0.0, le=1.0)  # waiting > 0 and kv usage above this = saturated
    max_tenants: int = Field(10_000, ge=1)  # bound on per-tenant state
    cache_salt_secret: str | None = None  # HMAC key for derived tenant salts; required by cache_isolation

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
        if len(self.tenants) > self.max_tenants:
            raise ValueError("more tenants than max_tenants")
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


if __name__ == "__main__":  # print the stored form of the keys given on the command line
    for arg in sys.argv[1:]:
        print(hash_key(arg))
