"""Who is calling: `Authorization: Bearer <key>` (on the Messages API's routes also `x-api-key: <key>`, which the
Anthropic SDKs and Claude Code send) -> tenant, and the admin bearer check.

Keys are stored as sha256 digests; the presented key is hashed and looked up by digest (O(1)), so the time taken
never depends on how much of a stored clear key matched (there is none to match). The admin key is compared with
`hmac.compare_digest`. When auth is off every request belongs to the anonymous tenant; with auth on, the tenant
comes only from the key (no client header can choose it). A key is compared as the bytes the client sent: a header
that is not UTF-8 (aiohttp keeps its bytes as surrogates) is a key like any other, one that matches nothing (401).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from multidict import MultiMapping

from gateway.admission.config import AdmissionConfig, hash_key
from gateway.errors import NotFound, Unauthorized


@dataclass(frozen=True, slots=True)
class Identity:
    tenant: str
    priority: int  # rank of the request's priority class (0 = highest)
    priority_name: str


def bearer(headers: Mapping[str, str]) -> str | None:
    """The bearer token; `headers` is looked up by lower-case name (see `CompletionService.handle`)."""
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _one_key(headers: MultiMapping[str], x_api_key: bool) -> None:
    keys = [k for k in headers.getall("authorization", []) if k.strip()]
    if x_api_key:
        sent = [k for k in headers.getall("x-api-key", []) if k]
        keys = keys + sent
        if len(sent) == 1 and len(keys) == 2 and bearer(headers) == sent[0]:  # the same key in both: one key
            return
    if len(keys) > 1:
        raise Unauthorized("more than one API key sent: send one (Authorization or x-api-key), once")


class Authenticator:
    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._by_hash = {k: name for name, tenant in config.tenants.items() for k in tenant.keys}
        self._ranks = {name: i for i, name in enumerate(config.priority_classes)}
        self._plain: dict[str, Identity] = {}  # tenant -> identity without a requested class (bounded by tenants)

    def identify(self, headers: MultiMapping[str], *, x_api_key: bool = False) -> Identity:
        """The caller's tenant and priority class; raises Unauthorized (401) when auth is on and the key is bad.
        `x_api_key`: the key may come in `x-api-key` (Anthropic's header; it wins over a bearer token). A key sent
        twice (two headers, or two different keys in both) is refused: a proxy before the gateway may have read the
        other one."""
        if not self.config.auth:
            tenant = self.config.anonymous_tenant
        else:
            _one_key(headers, x_api_key)
            token = (headers.get("x-api-key") or None) if x_api_key else None
            token = token or bearer(headers)
            if token is None:
                send = (
                    "'x-api-key: <key>' or 'Authorization: Bearer <key>'"
                    if x_api_key
                    else "'Authorization: Bearer <key>'"
                )
                raise Unauthorized(f"missing API key: send {send}")
            digest = hash_key(token)
            found = self._by_hash.get(digest)  # keyed by digest: timing reveals nothing about the clear key
            if found is None:
                raise Unauthorized("incorrect API key provided")
            tenant = found
        requested = headers.get("x-kvgate-priority")
        if requested:
            return self._priority(tenant, requested)
        identity = self._plain.get(tenant)
        if identity is None:
            identity = self._plain[tenant] = self._priority(tenant, None)
        return identity

    def _priority(self, tenant: str, requested: str | None) -> Identity:
        """The request may ask for a class at or below its tenant's ceiling; a higher or unknown one is clamped."""
        classes = self.config.priority_classes
        ceiling = self._ranks.get(self.config.tenant(tenant).priority or classes[0], 0)
        rank = self._ranks.get(requested, ceiling) if requested else ceiling
        rank = max(rank, ceiling)
        return Identity(tenant, rank, classes[rank])


def check_admin(headers: Mapping[str, str], admin_key: str | None) -> None:
    """The one admin check, for every /admin route: 404 while `admin.key` is unset (the routes are off), 401 unless
    the bearer equals it (constant-time comparison)."""
    if not admin_key:
        raise NotFound("admin endpoints are disabled (set admin.key)", code="not_found")
    token = bearer(headers)
    if token is None or not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), admin_key.encode()):
        raise Unauthorized("admin endpoint: missing or incorrect admin key", code="invalid_admin_key")
