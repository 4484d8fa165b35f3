"""Prometheus scrapes around a load setting: prefix-cache hit rate from engine counters, per-replica load.

`parse_metrics` reads a text exposition with the project's one Prometheus text reader (`kvcommon.promtext`) and keeps
the sum over label sets of every sample whose name is in `PREFIX_COUNTERS`, vLLM's preemption counter, or a
kvgate counter (`kvgate*_total`), so the result is bounded by the page. `fetch_text` is the one fetch of a page
(predicted.py reads capacities through it too). Hit rate over a setting = delta(hits) /
delta(queries) of `vllm:prefix_cache_{hits,queries}_total` (older vLLM: `vllm:gpu_prefix_cache_*`), summed over
the scraped URLs; None when no query was counted. A counter that went down (engine restarted) contributes its
after-value.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvcommon.promtext import samples

HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_COUNTERS = HITS + QUERIES
PREEMPTIONS = "vllm:num_preemptions_total"  # sequences the engine evicted to make room (KV ran out)


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name -> sum over label sets, for the counters this module reads (lines that do not parse skipped)."""
    out: dict[str, float] = {}
    for name, _, value in samples(text, (*PREFIX_COUNTERS, PREEMPTIONS, "kvgate")):
        if name in PREFIX_COUNTERS or name == PREEMPTIONS or (name.startswith("kvgate") and name.endswith("_total")):
            out[name] = out.get(name, 0.0) + value
    return out


@dataclass(frozen=True, slots=True)
class Scrape:
    url: str
    values: dict[str, float] = field(default_factory=dict)
    error: str | None = None


async def fetch_text(http: aiohttp.ClientSession, url: str, timeout_s: float = 10.0) -> str:
    """The page at `url`; ValueError naming why there is none (HTTP status, connection error, timeout)."""
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}")
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from exc


async def scrape(http: aiohttp.ClientSession, url: str, timeout_s: float = 10.0) -> Scrape:
    try:
        text = await fetch_text(http, url, timeout_s)
    except ValueError as exc:
        return Scrape(url, error=str(exc))
    return Scrape(url, parse_metrics(text))


async def scrape_all(http: aiohttp.ClientSession, urls: Sequence[str]) -> list[Scrape]:
    return list(await asyncio.gather(*(scrape(http, u) for u in urls)))


def _delta(before: Mapping[str, float], after: Mapping[str, float], names: Iterable[str]) -> float:
    total = 0.0
    for name in names:
        if name in after:
            b, a = before.get(name, 0.0), after[name]
            total += a - b if a >= b else a
    return total


def prefix_cache_report(before: Sequence[Scrape], after: Sequence[Scrape]) -> dict[str, Any]:
    """Per URL and overall hits / queries deltas and hit rate between two scrape rounds of the same URLs."""
    per_url: dict[str, Any] = {}
    hits = queries = 0.0
    for b, a in zip(before, after, strict=True):
        if b.error or a.error:
            per_url[a.url] = {"error": a.error or b.error}
            continue
        h, q = _delta(b.values, a.values, HITS), _delta(b.values, a.values, QUERIES)
        hits += h
        queries += q
        counters = {k: _delta(b.values, a.values, (k,)) for k in sorted(a.values) if k not in PREFIX_COUNTERS}
        per_url[a.url] = {"hits": h, "queries": q, "hit_rate": h / q if q else None, "counters": counters}
    return {"hits": hits, "queries": queries, "hit_rate": hits / queries if queries else None, "per_url": per_url}


def replica_load(replicas: Iterable[str | None]) -> dict[str, int]:
    """Requests per `x-kvgate-replica` value ("-" when the header was absent), sorted by replica."""
    counts: dict[str, int] = {}
    for r in replicas:
        key = r or "-"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))
