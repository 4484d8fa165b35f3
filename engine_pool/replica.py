"""One engine replica as the gateway sees it: identity, health, circuit breaker, in-flight count, engine metrics.

Breaker: `breaker_failures` consecutive request failures open it for `breaker_cooldown_s`; after that the replica
is routable again on a trial basis (half-open): one more failure re-opens it at once, one success closes it. A
failed health probe takes the replica out of routing immediately; a passing one brings it back.

Data parallelism: an engine started with `--data-parallel-size N` serves N engine cores, each with its own KV cache,
behind one URL. It is N replicas here: the one configured (rank 0, or the engine's lowest rank) and one per other
rank (`<id>@dp<rank>`, in `ranks`), each with its own index, load, admission and metrics, sent the rank it was
chosen for in vLLM's `X-data-parallel-rank` header. The replica set makes them when the engine's metrics show the
ranks (engine_pool.replica_set).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from engine_pool.latency import LatencyLearner
from policies.base import ReplicaState, Role
from policies.latency import Held, ReplicaLatency
from policies.queue_price import EngineCounters, QueuePrice


@dataclass(slots=True)
class EngineMetrics:
    """What the replica's own /metrics said at the last scrape (vLLM's metric names)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_blocks: int | None = None
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    ttft_sum: float = 0.0  # vllm:time_to_first_token_seconds_sum (cumulative)
    ttft_count: float = 0.0
    ranks: tuple[int, ...] = ()  # the data-parallel ranks the page reported (its `engine` labels)
    counters: EngineCounters = field(default_factory=EngineCounters)  # decode and prefill timing (QueuePrice)
    scraped_at: float = -math.inf  # time.monotonic()


@dataclass(frozen=True, slots=True)
class ReplicaSettings:
    """What a configuration entry says about the replicas it gives: an attached `engines[]` entry, a pool model, a
    DNS-discovered name (the same fields, one type)."""

    model: str | None = None
    tokenizer: str | None = None
    max_concurrency: int | None = None
    max_num_seqs: int | None = None
    role: Role = "both"
    pooling: bool = False
    block_size: int | None = None  # tokens per KV block, as launched; None: known from the engine's metrics


def tcp_endpoint(host: str, port: int | None) -> str | None:
    """A KV-events endpoint on the engine's host (None without a port)."""
    return f"tcp://{host}:{port}" if port else None


def build_replica(
    replica_id: str,
    url: str,
    settings: ReplicaSettings,
    *,
    managed: bool,
    kv_events_endpoint: str | None = None,
    kv_events_replay_endpoint: str | None = None,
    metrics_url: str | None = None,
) -> Replica:
    """The one way the product makes a replica (attached, pool-launched, discovered): an id, where it answers, and
    its entry's settings. A managed one (the pool's) is warm only after its warm-up."""
    return Replica(
        replica_id,
        url,
        settings.model,
        metrics_url=metrics_url,
        kv_events_endpoint=kv_events_endpoint,
        kv_events_replay_endpoint=kv_events_replay_endpoint,
        tokenizer=settings.tokenizer,
        max_concurrency=settings.max_concurrency,
        max_num_seqs=settings.max_num_seqs,
        managed=managed,
        role=settings.role,
        pooling=settings.pooling,
        block_size=settings.block_size,
    )


def rank_headers(replica: Replica, headers: dict[str, str]) -> dict[str, str]:
    """`headers` with vLLM's `X-data-parallel-rank` when the replica is one rank of a data-parallel engine."""
    return headers if replica.dp_rank is None else {**headers, "X-data-parallel-rank": str(replica.dp_rank)}


class Replica:
    def __init__(
        self,
        replica_id: str,
        url: str,
        model: str | None,
        *,
        metrics_url: str | None = None,
        kv_events_endpoint: str | None = None,
        kv_events_replay_endpoint: str | None = None,
        tokenizer: str | None = None,
        max_concurrency: int | None = None,
        max_num_seqs: int | None = None,
        managed: bool = False,
        role: Role = "both",
        pooling: bool = False,
        block_size: int | None = None,
    ) -> None:
        self.id = replica_id
        self.block_size = block_size  # as launched (the pool's spec); the engine's metrics say it otherwise
        self.url = url.rstrip("/")
        parts = urlsplit(self.url)
        self.use_tls = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.use_tls else 80)
        self.base_path = parts.path  # engines served under a path prefix
        self.model = model
        self.metrics_url = metrics_url or f"{self.url}/metrics"
        self.kv_events_endpoint = kv_events_endpoint
        self.kv_events_replay_endpoint = kv_events_replay_endpoint
        self.kv_events_topic: str | None = None  # the publisher's own (discovered); None: the configured one
        # no endpoint given: asked of the engine (GET /kv_event_sources) each time it comes up
        self.discovers_kv_events = kv_events_endpoint is None
        self.tokenizer = tokenizer
        self.max_concurrency = max_concurrency
        self.max_num_seqs = max_num_seqs  # the engine's batch slots, when configured
        self.managed = managed  # started by kvgate's engine pool (restartable) or attached
        self.role: Role = role  # both, or one side of disaggregated serving (prefill / decode)
        self.pooling = pooling  # a pooling model (embeddings, classification): answers no chat or completions
        self.max_model_len: int | None = None
        self.adapters: dict[str, str] = {}  # LoRA adapter name -> root (its path), from the engine's /v1/models
        self.healthy = False  # last health probe passed
        self.warm = not managed  # managed replicas become warm after a real warm-up inference
        self.draining = False
        self.in_flight = 0
        # sequence-seconds run here (the in-flight count, up to the engine's batch slots, integrated over time) and
        # when it was last advanced: the mean batch over any span of a request's life (`batch_mark`, `mean_batch`)
        self._seq_s = 0.0
        self._seq_at = time.monotonic()
        # requests that were running when the engine metrics were scraped and have finished since: the scraped
        # running count still includes them until the next scrape (vLLM's gauges are only read every interval)
        self.finished_since_scrape = 0
        self.consecutive_failures = 0
        self.breaker_open_until = 0.0
        # cumulative attempts on this replica that it answered (any status below 500) or failed (connect, reset,
        # timeout, 5xx): the breaker's and the degradation watcher's error rate, counted by the proxy
        self.answered = 0
        self.failed = 0
        self.metrics = EngineMetrics()
        self.queue_price = QueuePrice()  # learned from the scrapes: what one more request here costs
        self.latency = LatencyLearner()  # learned from the gateway's answers: policies.latency's terms
        self.held: dict[int, Held] = {}  # admitted requests placed here (by id): the KV each holds, its predicted end
        self._held_changes = 0
        self._view: tuple[object, tuple[int, int], ReplicaLatency | None] = (None, (-1, -1), None)  # its memo
        self.dp_rank: int | None = None  # the data-parallel rank this replica is (None: the engine has one)
        self.ranks: list[Replica] = []  # on the first rank: the engine's other ranks
        self._idle = asyncio.Event()
        self._idle.set()

    def set_metrics(self, metrics: EngineMetrics) -> None:
        """A new scrape: its running count is current again."""
        self.metrics = metrics
        self.finished_since_scrape = 0
        self.queue_price.observe(metrics.counters)

    # --- routing state -------------------------------------------------------------------------------------
    def breaker_open(self, now: float) -> bool:
        return now < self.breaker_open_until

    def routable(self, now: float) -> bool:
        return self.healthy and self.warm and not self.draining and now >= self.breaker_open_until

    def snapshot(self, now: float) -> ReplicaState:
        m, stale = self.metrics, self.finished_since_scrape
        running, waiting = m.running, m.waiting
        if stale:
            running, waiting = max(0, running - stale), max(0, waiting - max(0, stale - running))
        return ReplicaState(  # positional: the fields in ReplicaState's order (the cheapest construction)
            self.id,
            self.model or "",
            self.healthy and self.warm and now >= self.breaker_open_until,
            self.in_flight,
            running,
            waiting,
            m.kv_usage,
            self.max_concurrency,
            self.max_num_seqs,
            now - m.scraped_at,
            self.draining,
            self.queue_price.value,
        )

    # --- request accounting ----------------------------------------------------------------------------------
    def begin(self) -> float:
        """Count a request sent to the replica; returns its start time, for `end`."""
        now = time.monotonic()
        self._advance(now)
        self.in_flight += 1
        if self.in_flight == 1:
            self._idle.clear()
        return now

    def end(self, started: float) -> None:
        if started <= self.metrics.scraped_at:  # the last scrape saw it running: do not count it any more
            self.finished_since_scrape += 1
        self._advance(time.monotonic())
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.in_flight = 0
            self._idle.set()

    def _running(self) -> int:
        """The gateway's requests in the engine's batch here: in flight, up to its batch slots when known."""
        return self.in_flight if self.max_num_seqs is None else min(self.in_flight, self.max_num_seqs)

    def _advance(self, now: float) -> None:
        self._seq_s += self._running() * (now - self._seq_at)
        self._seq_at = now

    def batch_mark(self) -> tuple[float, float]:
        """The start of a span (now, the sequence-seconds so far) whose mean batch `mean_batch` tells."""
        now = time.monotonic()
        self._advance(now)
        return now, self._seq_s

    def mean_batch(self, mark: tuple[float, float]) -> float:
        """The mean number of the gateway's requests running here (up to the engine's batch slots) since `mark`:
        the batch a request that ran over that span decoded in, itself included (O(1))."""
        now, seq_s = self.batch_mark()
        span = now - mark[0]
        return max(1.0, (seq_s - mark[1]) / span if span > 0 else self._running())

    def output_bound(self, prompt_tokens: int, max_tokens: int | None) -> int | None:
        """The most a request may produce here: its max_tokens capped by the context its prompt leaves (vLLM caps it
        so), or None when it names none."""
        if max_tokens is None or self.max_model_len is None:
            return max_tokens
        return min(max_tokens, max(1, self.max_model_len - prompt_tokens))

    def hold(self, held: Held) -> None:
        """An admitted request placed here: its KV and predicted end count in this replica's latency view."""
        self.held[id(held)] = held
        self._held_changes += 1

    def release(self, held: Held) -> None:
        if self.held.pop(id(held), None) is not None:
            self._held_changes += 1

    def latency_view(self, without: Held | None = None) -> ReplicaLatency:
        """What the latency model knows of this replica now (`policies.latency.predict`); `without`: a hold not to
        count (the request being routed, held where admission predicted it best). Read per request and candidate
        (admission's verdict, then the route): kept until a scrape, an answer or a hold changes it, O(1) until
        then, O(holds) to build."""
        if without is not None and id(without) in self.held:
            return self._latency_view(without)
        metrics, changes, view = self._view
        now = (self.latency.changes, self._held_changes)
        if view is None or metrics is not self.metrics or changes != now:
            view = self._latency_view(None)
            self._view = (self.metrics, now, view)
        return view

    def _latency_view(self, without: Held | None) -> ReplicaLatency:
        m, price, learner = self.metrics, self.queue_price, self.latency
        kv = m.num_blocks * m.block_size if m.num_blocks and m.block_size else None
        itl = m.counters.itl_sum / m.counters.itl_count if m.counters.itl_count else None
        overhead, prefill, step, per_seq = learner.terms(price.prefill_s_per_token, price.slope(), itl)
        held = tuple([h for h in self.held.values() if h is not without])
        return ReplicaLatency(
            self.id, kv, held, overhead, prefill, step, per_seq, learner.margin(), learner.decode_learned,
            learner.mean_output if learner.output_learned else price.output_tokens or 0.0,
        )  # fmt: skip

    def for_rank(self, rank: int) -> Replica:
        """The replica of another data-parallel rank of this engine: the same URL and settings, its KV events
        asked of the engine (`/kv_event_sources` lists each rank's publisher), warm when this one is."""
        other = Replica(
            f"{self.id}@dp{rank}", self.url, self.model, metrics_url=self.metrics_url, tokenizer=self.tokenizer,
            max_concurrency=self.max_concurrency, max_num_seqs=self.max_num_seqs, role=self.role,
            pooling=self.pooling, block_size=self.block_size,
        )  # fmt: skip
        other.dp_rank, other.warm, other.draining, other.managed = rank, self.warm, self.draining, self.managed
        return other

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when no request is in flight here and on the engine's other ranks (drain finished) within
        timeout_s."""
        try:
            async with asyncio.timeout(timeout_s):
                for replica in (self, *self.ranks):
                    await replica._idle.wait()
        except TimeoutError:
            return False
        return True

    def record_success(self) -> None:
        self.answered += 1
        self.consecutive_failures = 0
        self.breaker_open_until = 0.0

    def record_failure(self, *, threshold: int, cooldown_s: float, now: float | None = None) -> bool:
        """Count a failure; returns True when this failure opened the breaker."""
        now = time.monotonic() if now is None else now
        self.failed += 1
        self.consecutive_failures += 1
        half_open = self.breaker_open_until > 0.0 and not self.breaker_open(now)
        if self.consecutive_failures >= threshold or half_open:
            self.breaker_open_until = now + cooldown_s
            return True
        return False

    def __repr__(self) -> str:
        return f"Replica({self.id!r}, {self.url!r}, model={self.model!r}, healthy={self.healthy}, warm={self.warm})"
