"""Prometheus metrics of the cache-aware state, all on the registry the gateway passes in (names `kvgate_...`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcommon.fastmetrics import FastCounter, FastHistogram

_TOKEN_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class _SizeCollector(Collector):
    """Index and session sizes, read when scraped (no per-replica gauge children to add and remove)."""

    def __init__(
        self,
        index_sizes: Callable[[], Mapping[str, int]],
        capacities: Callable[[], Mapping[str, tuple[int, bool, int]]],
        sessions: Callable[[], int],
        offloaded_sizes: Callable[[], Mapping[str, int]],
    ) -> None:
        self._index_sizes = index_sizes
        self._offloaded_sizes = offloaded_sizes
        self._capacities = capacities
        self._sessions = sessions

    def collect(self) -> Iterator[Metric]:
        sizes = self._index_sizes()
        per_replica = GaugeMetricFamily(
            "kvgate_prefix_index_blocks", "KV blocks kvgate believes each replica holds", labels=["replica"]
        )
        for rid, n in sorted(sizes.items()):
            per_replica.add_metric([rid], n)
        yield per_replica
        offloaded = GaugeMetricFamily(
            "kvgate_prefix_index_offloaded_blocks",
            "KV blocks kvgate believes each replica's offloading tier (CPU memory) holds, from its KV events",
            labels=["replica"],
        )
        for rid, n in sorted(self._offloaded_sizes().items()):
            offloaded.add_metric([rid], n)
        yield offloaded
        capacity = GaugeMetricFamily(
            "kvgate_prefix_index_capacity_blocks",
            "the index's bound per replica in blocks: the engine's num_gpu_blocks (source=engine) or the estimate "
            "learned from reported cached tokens (source=estimated); block_size: tokens per block",
            labels=["replica", "source", "block_size"],
        )
        for rid, (blocks, known, block_size) in sorted(self._capacities().items()):
            capacity.add_metric([rid, "engine" if known else "estimated", str(block_size)], blocks)
        yield capacity
        yield GaugeMetricFamily(
            "kvgate_prefix_index_entries", "entries in the prefix index, all replicas", value=sum(sizes.values())
        )
        yield GaugeMetricFamily("kvgate_sessions", "session bindings held", value=self._sessions())


class PrefixMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        index_sizes: Callable[[], Mapping[str, int]],
        capacities: Callable[[], Mapping[str, tuple[int, bool, int]]],
        sessions: Callable[[], int],
        offloaded_sizes: Callable[[], Mapping[str, int]],
    ) -> None:
        r = registry
        self.requests = FastCounter(
            "kvgate_prefix_requests",
            "requests tokenized and hashed for routing; approximate=true when pseudo tokens were used",
            ["tokenizer", "approximate"],
            r,
        )
        self.tokenize_errors = FastCounter(
            "kvgate_prefix_tokenize_errors",
            "requests the router could not tokenize (routed without prefix information)",
            ["tokenizer"],
            r,
        )
        self.tokenize_seconds = FastHistogram(
            "kvgate_prefix_tokenize_seconds",
            "time to tokenize and hash a prompt",
            ["tokenizer"],
            r,
            (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0),
        )
        self.predicted = FastCounter(
            "kvgate_prefix_predicted_cached_tokens",
            "prompt tokens kvgate predicted the chosen replica had cached (finished requests with a report)",
            ["model"],
            r,
        )
        self.reported = FastCounter(
            "kvgate_prefix_reported_cached_tokens",
            "cached prompt tokens the engine reported for the same requests",
            ["model"],
            r,
        )
        self.gap = FastHistogram(
            "kvgate_prefix_cached_tokens_gap",
            "|predicted - reported| cached prompt tokens per finished request",
            ["model"],
            r,
            _TOKEN_BUCKETS,
        )
        self.events = FastCounter("kvgate_kv_events", "KV events applied, by type", ["replica", "type"], r)
        self.events_skipped = FastCounter(
            "kvgate_kv_events_skipped",
            "KV events not applied (unknown-parent, medium, group, multimodal)",
            ["replica", "reason"],
            r,
        )
        self.events_resets = FastCounter(
            "kvgate_kv_events_resets",
            "times a replica's index was cleared because its event stream lost continuity",
            ["replica", "reason"],
            r,
        )
        self.chat_prefix = FastCounter(
            "kvgate_prefix_chat_cache",
            "chat prompts by incremental tokenization outcome: hit (a cached conversation prefix reused), miss, "
            "unsafe (a boundary the tokenizer could merge across), rewritten (the template changed earlier text), "
            "full (no generation prompt)",
            ["outcome"],
            r,
        )
        self.corrections = FastCounter(
            "kvgate_prefix_index_corrections",
            "index entries dropped because a replica reported fewer cached tokens than kvgate believed (no events)",
            ["replica"],
            r,
        )
        registry.register(_SizeCollector(index_sizes, capacities, sessions, offloaded_sizes))
