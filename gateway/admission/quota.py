"""Per-tenant quotas: the `QuotaStore` contract both stores implement, and the rate-limit headers: OpenAI's
`x-ratelimit-*` (resets as durations) and, on the Messages API's routes, Anthropic's `anthropic-ratelimit-*` beside
them (the same numbers; resets as RFC 3339 times).

Windows are fixed per clock minute (requests, tokens) and per UTC day (daily token budget), so every gateway
sharing a store agrees on them. A check atomically: drops expired concurrency leases, tests the concurrency,
request, token and daily limits (in that order; the first one exceeded is the reason), and when all pass takes a
concurrency lease, counts the request and charges the estimated tokens. `release` frees the lease and charges the
difference between the real token cost and the estimate to the current windows (never below zero).
Token cost = uncached prompt tokens + cached prompt tokens x `cached_token_weight` + completion tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from gateway.admission.config import LimitsConfig

MINUTE_S = 60.0
DAY_S = 86_400.0


@dataclass(slots=True)
class Lease:
    """A granted request: its concurrency slot and the tokens charged for it so far."""

    tenant: str
    lease_id: str
    charged_tokens: int
    store: str  # "local" or "redis": which store holds the slot (Redis may fail over to local)
    minute: int = -1  # the clock minute (by the store's clock) whose request count it is in; -1: not known


@dataclass(frozen=True, slots=True)
class QuotaResult:
    allowed: bool
    reason: str | None = None  # concurrency | requests | tokens | daily_tokens | store_unavailable | gone (a check
    # run after its own release: its client has left)
    retry_after_s: float = 0.0
    lease: Lease | None = None
    limit_requests: int | None = None
    remaining_requests: int = 0
    reset_requests_s: float = 0.0
    limit_tokens: int | None = None
    remaining_tokens: int = 0
    reset_tokens_s: float = 0.0

    def headers(self, *, anthropic: bool = False) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the limits that are configured (and, with `anthropic`, Anthropic's
        anthropic-ratelimit-* with the same numbers)."""
        out: dict[str, str] = {}
        now = time.time()
        for kind, limit, remaining, reset_s in (
            ("requests", self.limit_requests, self.remaining_requests, self.reset_requests_s),
            ("tokens", self.limit_tokens, self.remaining_tokens, self.reset_tokens_s),
        ):
            if limit is None:
                continue
            out[f"x-ratelimit-limit-{kind}"] = str(limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, remaining))
            out[f"x-ratelimit-reset-{kind}"] = format_reset(reset_s)
            if anthropic:
                out[f"anthropic-ratelimit-{kind}-limit"] = str(limit)
                out[f"anthropic-ratelimit-{kind}-remaining"] = str(max(0, remaining))
                out[f"anthropic-ratelimit-{kind}-reset"] = rfc3339(now + reset_s)
        return out


class QuotaStore(Protocol):
    name: str

    async def check(self, tenant: str, limits: LimitsConfig, tokens: int, lease_id: str) -> QuotaResult:
        """Test every limit and, when all pass, take a lease and charge `tokens` (the estimate)."""
        ...

    async def release(self, lease: Lease, tokens: int, *, admitted: bool = True) -> None:
        """Free the lease; `tokens` is the real cost, the difference to the estimate is charged now. A lease whose
        request was not admitted after all (a gate refused it, or its client left while it was queued) is taken
        out of its minute's request count too, while that minute is the current one: the limit counts requests
        admitted, so a client that retries as Retry-After tells it does not spend its minute on refusals."""
        ...

    async def close(self) -> None: ...


def token_window(
    tpm: int | None, minute_tokens: int, to_minute_s: float, tpd: int | None, day_tokens: int, to_day_s: float
) -> tuple[int | None, int, float]:
    """The token limit the rate-limit headers report: (limit, remaining, reset seconds) of the minute's limit, or,
    for a tenant limited by the day alone, of the day's (OpenAI's headers have no daily kind: a client reading them
    still learns its budget and when it resets)."""
    if tpm is not None:
        return tpm, tpm - minute_tokens, to_minute_s
    if tpd is not None:
        return tpd, tpd - day_tokens, to_day_s
    return None, 0, to_minute_s


def token_cost(prompt: int, cached: int, completion: int, cached_weight: float) -> int:
    cached = min(max(0, cached), max(0, prompt))
    return max(0, prompt - cached) + round(cached * cached_weight) + max(0, completion)


def format_reset(seconds: float) -> str:
    """OpenAI's duration format: '20ms', '1s', '6m0s', '1h2m3s'."""
    if seconds < 1.0:
        return f"{max(0, round(seconds * 1000))}ms"
    total = round(seconds)
    h, rem = divmod(total, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h{m}m{s}s"
    if m:
        return f"{m}m{s}s"
    return f"{s}s"


def rfc3339(epoch_s: float) -> str:
    """Anthropic's reset format: a UTC time to the second, '2026-01-02T03:04:05Z'."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(round(epoch_s)))


def limit_or_zero(value: int | None) -> int:
    return 0 if value is None else value
