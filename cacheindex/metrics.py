"""Prometheus metrics of the cache-aware state, all on the registry the gateway passes in (names `kvgate_...`), in
the product's one metric style (`kvcommon.fastmetrics`): counters and histograms updated in place, sizes read by
`CallbackGauge`s at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry

from kvcommon.fastmetrics import CallbackGauge, FastCounter, FastHistogram

_TOKEN_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class PrefixMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        index_sizes: Callable[[], Mapping[str, int]],
        capacities: Callable[[], Mapping[str, tuple[int, bool, int]]],
        sessions: Callable[[], int],
        awaited: Callable[[], int],
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
        self.new_turns = FastCounter(
            "kvgate_prefix_new_turns_after_routing",
            "conversations' new turns (the last answer and the messages after it) tokenized after the routing "
            "decision, beside the request (cache.deferred_turn_min_chars)",
            [],
            r,
        ).labels()
        self.corrections = FastCounter(
            "kvgate_prefix_index_corrections",
            "index entries dropped because a replica reported fewer cached tokens than kvgate believed (no events)",
            ["replica"],
            r,
        )
        # sizes, read when scraped (no per-replica gauge children to add and remove)
        CallbackGauge(
            "kvgate_prefix_index_blocks", "KV blocks kvgate believes each replica holds", ["replica"], r,
            lambda: [((rid,), n) for rid, n in sorted(index_sizes().items())],
        )  # fmt: skip
        CallbackGauge(
            "kvgate_prefix_index_offloaded_blocks",
            "KV blocks kvgate believes each replica's offloading tier (CPU memory) holds, from its KV events",
            ["replica"], r, lambda: [((rid,), n) for rid, n in sorted(offloaded_sizes().items())],
        )  # fmt: skip
        CallbackGauge(
            "kvgate_prefix_index_capacity_blocks",
            "the index's bound per replica in blocks: the engine's num_gpu_blocks (source=engine) or the estimate "
            "learned from reported cached tokens (source=estimated); block_size: tokens per block",
            ["replica", "source", "block_size"], r,
            lambda: [
                ((rid, "engine" if known else "estimated", str(block_size)), blocks)
                for rid, (blocks, known, block_size) in sorted(capacities().items())
            ],
        )  # fmt: skip
        CallbackGauge(
            "kvgate_prefix_index_entries", "entries in the prefix index, all replicas", [], r,
            lambda: [((), sum(index_sizes().values()))],
        )  # fmt: skip
        CallbackGauge("kvgate_sessions", "session bindings held", [], r, lambda: [((), sessions())])
        CallbackGauge(
            "kvgate_sessions_awaited",
            "sessions whose last answer was a tool call, expected back (placement avoids evicting their blocks)",
            [],
            r,
            lambda: [((), awaited())],
        )

    def forget_replica(self, replica_id: str) -> None:
        """A replica removed for good: its series go."""
        for family in (self.events, self.events_skipped, self.events_resets, self.corrections):
            family.forget("replica", replica_id)
