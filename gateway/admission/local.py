"""In-process quota store (the default): the same fixed-window semantics as the Redis store, in memory.

State per tenant: the set of live lease ids, request and token counts of the current minute and the token count of
the current day. O(1) per check and release. Bounded: at most `max_tenants` tenants are kept; the least recently
used idle tenant is dropped first (its windows restart, which only errs in the tenant's favour).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.admission.config import LimitsConfig
from gateway.admission.quota import DAY_S, MINUTE_S, Lease, QuotaResult, token_window


@dataclass(slots=True)
class _TenantState:
    leases: set[str] = field(default_factory=set)
    minute: int = -1
    requests: int = 0
    tokens: int = 0
    day: int = -1
    day_tokens: int = 0

    def roll(self, now: float) -> None:
        minute, day = math.floor(now / MINUTE_S), math.floor(now / DAY_S)
        if minute != self.minute:
            self.minute, self.requests, self.tokens = minute, 0, 0
        if day != self.day:
            self.day, self.day_tokens = day, 0


class LocalQuotaStore:
    name = "local"

    def __init__(self, *, max_tenants: int = 10_000, clock: Callable[[], float] = time.time) -> None:
        self.max_tenants = max_tenants
        self.clock = clock
        self._tenants: OrderedDict[str, _TenantState] = OrderedDict()

    def _state(self, tenant: str) -> _TenantState:
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _TenantState()
            if len(self._tenants) > self.max_tenants:
                for name, other in list(self._tenants.items()):
                    if not other.leases and name != tenant:
                        del self._tenants[name]
                        break
        else:
            self._tenants.move_to_end(tenant)
        return state

    def hold(self, tenant: str, lease_id: str) -> None:
        """Count a slot held elsewhere (a lease of the shared store that failed) as in flight here."""
        self._state(tenant).leases.add(lease_id)

    def unhold(self, tenant: str, lease_id: str) -> None:
        state = self._tenants.get(tenant)
        if state is not None:
            state.leases.discard(lease_id)

    def in_flight(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return len(state.leases) if state else 0

    async def check(self, tenant: str, limits: LimitsConfig, tokens: int, lease_id: str) -> QuotaResult:
        now = self.clock()
        state = self._state(tenant)
        state.roll(now)
        to_minute = MINUTE_S - now % MINUTE_S
        to_day = DAY_S - now % DAY_S
        rpm, tpm, tpd = limits.requests_per_minute, limits.tokens_per_minute, limits.tokens_per_day
        reason, retry = None, 0.0
        if limits.max_concurrency is not None and len(state.leases) >= limits.max_concurrency:
            reason, retry = "concurrency", 1.0
        elif rpm is not None and state.requests + 1 > rpm:
            reason, retry = "requests", to_minute
        elif tpm is not None and state.tokens > 0 and state.tokens + tokens > tpm:
            reason, retry = "tokens", to_minute
        elif tpd is not None and state.day_tokens > 0 and state.day_tokens + tokens > tpd:
            reason, retry = "daily_tokens", to_day
        lease = None
        if reason is None:
            state.leases.add(lease_id)
            state.requests += 1
            state.tokens += tokens
            state.day_tokens += tokens
            lease = Lease(tenant, lease_id, tokens, self.name, state.minute)
        limit_tokens, remaining_tokens, reset_tokens = token_window(
            tpm, state.tokens, to_minute, tpd, state.day_tokens, to_day
        )
        return QuotaResult(
            allowed=reason is None,
            reason=reason,
            retry_after_s=retry,
            lease=lease,
            limit_requests=rpm,
            remaining_requests=(rpm - state.requests) if rpm else 0,
            reset_requests_s=to_minute,
            limit_tokens=limit_tokens,
            remaining_tokens=remaining_tokens,
            reset_tokens_s=reset_tokens,
        )

    async def release(self, lease: Lease, tokens: int, *, admitted: bool = True) -> None:
        state = self._tenants.get(lease.tenant)
        if state is None:
            return
        state.leases.discard(lease.lease_id)
        state.roll(self.clock())
        if not admitted and state.minute == lease.minute:
            state.requests = max(0, state.requests - 1)
        delta = tokens - lease.charged_tokens
        state.tokens = max(0, state.tokens + delta)
        state.day_tokens = max(0, state.day_tokens + delta)
        lease.charged_tokens = tokens

    async def close(self) -> None:
        self._tenants.clear()
