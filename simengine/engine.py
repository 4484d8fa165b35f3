"""The simulated engine's scheduler and cost model, without HTTP (the aiohttp layer: `simengine.server`, `generation`).

A request is admitted FCFS (a strict FIFO: the head blocks the queue, like vLLM's default scheduler) when a sequence
slot is free (``running < max_num_seqs``) and its blocks fit in the KV cache next to the pinned ones
(`PrefixCache.fits`). Then: time to first token = queueing + ``overhead_ms`` + uncached prompt tokens x
``prefill_us_per_token`` + tokens loaded from the CPU tier (``cpu_blocks``) x ``cpu_load_us_per_token``; each
further token after ``decode_ms + decode_ms_per_seq x running`` (+ with ``chunked_prefill_budget`` the step's share
of the prompts being computed meanwhile: min(their uncached tokens, budget) x ``prefill_us_per_token``). Every
request sleeps on its own timer (no global step loop), so the cost per token is one ``asyncio.sleep``. With
``instant`` nothing sleeps and all tokens are emitted in one call. Output is exactly ``max_tokens`` words
``" w<k>"``, autoregressive and deterministic as greedy decoding is: each word is chosen by the CRC-32 of the
whole text before it (the prompt's text, then the words so far), so a prompt that ends with part of an answer is
continued exactly as the answer went on (request migration re-sends it so). Cancellation (the client went away)
at any await stops the request, frees its slot and blocks and counts it as ``cancelled``. Bounded state: the
waiting queue (``max_waiting``), the cache, the words.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass

from simengine.cache import Allocation, PrefixCache
from simengine.config import Faults, SimConfig
from simengine.kv_events import KVEventPublisher
from simengine.kv_transfer import SharedKvStore
from simengine.metrics import SimMetrics
from simengine.tokenize import text_state

Emit = Callable[[Sequence[str], int], Awaitable[None]]  # (output words, cached prompt tokens)
_VOCAB = 1000


class SimFaultError(Exception):
    """An injected failure: the request must answer 500 before any byte."""


class OverloadedError(Exception):
    """The waiting queue is full (``max_waiting``): the request must answer 503."""


@dataclass
class SimStats:
    started: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0  # invalid requests, answered 4xx before starting
    generated_tokens: int = 0
    cached_tokens_total: int = 0
    prompt_tokens_total: int = 0
    lora_loads: int = 0  # adapters loaded and unloaded at run time (vLLM's /v1/load_lora_adapter)
    lora_unloads: int = 0
    realtime_sessions: int = 0  # /v1/realtime sessions opened


@dataclass(frozen=True, slots=True)
class GenResult:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class _Waiter:
    fut: asyncio.Future[Allocation]
    tokens: Sequence[int]
    hashes: Sequence[int]
    total: int


class SimEngine:
    def __init__(self, config: SimConfig, *, exit_fn: Callable[[int], object] = os._exit) -> None:
        self.config = config
        self.adapters = dict(config.lora_modules)  # LoRA adapter name -> path: the started ones and those loaded since
        self.faults: Faults = config.faults
        self.cache = PrefixCache(config.num_blocks, config.block_size, config.model, cpu_blocks=config.cpu_blocks)
        self.transfer = SharedKvStore(config.kv_transfer_dir) if config.kv_transfer_dir else None
        if self.transfer is not None:
            self.cache.external = self.transfer.lookup
        self.metrics = SimMetrics(
            config.model, config.block_size, config.num_blocks, cache_config=not config.hide_cache_config
        )
        self.stats = SimStats()
        self.publisher: KVEventPublisher | None = None
        self.traceparents: deque[str] = deque(maxlen=256)  # the W3C trace context of the last requests
        self.tracestates: deque[str] = deque(maxlen=256)  # and the tracestate of those that had one
        self.anthropic_headers: deque[tuple[str, str]] = deque(maxlen=256)  # anthropic-version, -beta of Messages
        self.request_ids: deque[str] = deque(maxlen=256)  # the X-Request-Id of the last requests
        self.in_flight = 0  # HTTP generation requests being handled (GET /load)
        self._exit_fn = exit_fn
        self._fault_rng = random.Random(config.seed)
        self._running = 0
        self._prefilling = 0  # uncached prompt tokens of the requests computing their prompt now
        self._waiters: deque[_Waiter] = deque()
        self._words = tuple(f" w{i}" for i in range(_VOCAB))
        self._changed: asyncio.Event | None = None

    # --- state -------------------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def stats_dict(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(asdict(self.stats))
        out |= {
            "running": self._running,
            "waiting": len(self._waiters),
            "kv_usage": self.cache.usage,
            "cached_blocks": self.cache.cached_blocks,
            "offloaded_blocks": self.cache.offloaded_blocks,
            "loaded_tokens": self.cache.loaded_tokens,
            "evictions": self.cache.evictions,
            "kv_event_batches": self.publisher.sent_batches if self.publisher else 0,
        }
        return out

    def new_id(self, prefix: str) -> str:
        """A fresh id, unique across engines as vLLM's (random UUIDs) are: two replicas started alike must not name
        their stored responses alike (the seed decides the tokens, not the ids)."""
        return f"{prefix}-{uuid.uuid4().hex[:24]}"

    def attach_publisher(self, publisher: KVEventPublisher) -> None:
        self.publisher = publisher
        self.cache.record_events = True

    def set_faults(self, faults: Faults) -> None:
        self.faults = faults

    def note_rejected(self) -> None:
        self.stats.rejected += 1
        self._notify()

    def reset_prefix_cache(self) -> bool:
        ok = self.cache.reset()
        self._publish()
        return ok

    def render_metrics(self) -> bytes:
        return self.metrics.render(self._running, len(self._waiters), self.cache.usage)

    async def wait_until(self, predicate: Callable[[SimEngine], bool]) -> None:
        """Wait until ``predicate(self)`` holds; re-checked at every state change (for tests and tools)."""
        while not predicate(self):
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()

    def _notify(self) -> None:
        event = self._changed
        if event is not None:
            self._changed = None
            event.set()

    def _publish(self) -> None:
        if self.publisher is not None:
            events = self.cache.drain_events()
            if events:
                self.publisher.publish(events)

    # --- cost model --------------------------------------------------------------------------------------
    def itl_s(self) -> float:
        cfg = self.config
        step = (cfg.decode_ms + cfg.decode_ms_per_seq * self._running) / 1e3
        if cfg.chunked_prefill_budget and self._prefilling:
            step += min(self._prefilling, cfg.chunked_prefill_budget) * cfg.prefill_us_per_token / 1e6
        return step

    def prefill_s(self, uncached_tokens: int, loaded_tokens: int = 0, handed_tokens: int = 0) -> float:
        cfg = self.config
        return (
            cfg.overhead_ms / 1e3
            + uncached_tokens * cfg.prefill_us_per_token / 1e6
            + loaded_tokens * cfg.cpu_load_us_per_token / 1e6
            + handed_tokens * cfg.handover_us_per_token / 1e6
        )

    def output_words(self, tokens: Sequence[int], n: int) -> list[str]:
        """`n` words after the prompt `tokens`: each one by the CRC-32 of the text so far. O(prompt + n) in C."""
        state, words, out = text_state(tokens), self._words, []
        for _ in range(n):
            word = words[state % _VOCAB]
            out.append(word)
            state = zlib.crc32(word.encode(), state)
        return out

    # --- admission ---------------------------------------------------------------------------------------
    def _can_start(self, hashes: Sequence[int], total: int) -> bool:
        return self._running < self.config.max_num_seqs and self.cache.fits(hashes, total)

    def _start(self, tokens: Sequence[int], hashes: Sequence[int], total: int) -> Allocation:
        alloc = self.cache.admit(tokens, hashes, total)
        self._running += 1
        self._publish()
        return alloc

    def _pump(self) -> None:
        waiters = self._waiters
        while waiters:
            head = waiters[0]
            if head.fut.done():  # cancelled, its task has not run its handler yet
                waiters.popleft()
                continue
            if not self._can_start(head.hashes, head.total):
                break
            waiters.popleft()
            head.fut.set_result(self._start(head.tokens, head.hashes, head.total))

    def _finish(self, alloc: Allocation) -> None:
        self.cache.release(alloc)
        self._running -= 1
        self._pump()
        self._notify()

    async def _acquire(self, tokens: Sequence[int], hashes: Sequence[int], total: int) -> Allocation:
        if not self._waiters and self._can_start(hashes, total):
            return self._start(tokens, hashes, total)
        if len(self._waiters) >= self.config.max_waiting:
            raise OverloadedError(f"waiting queue full ({self.config.max_waiting} requests)")
        waiter = _Waiter(asyncio.get_running_loop().create_future(), tokens, hashes, total)
        self._waiters.append(waiter)
        self._notify()
        try:
            return await waiter.fut
        except asyncio.CancelledError:
            if waiter.fut.done() and not waiter.fut.cancelled():
                self._finish(waiter.fut.result())  # admitted and cancelled in the same loop iteration
            else:
                try:
                    self._waiters.remove(waiter)
                except ValueError:
                    pass
                self._pump()
            raise

    # --- one request -------------------------------------------------------------------------------------
    async def generate(
        self, tokens: Sequence[int], hashes: Sequence[int], max_tokens: int, emit: Emit, *, save_kv: bool = False
    ) -> GenResult:
        """Run one request: faults, queueing, prefill, decode; ``emit`` receives the output words in order
        (and the cached prompt token count). ``save_kv``: a prefill step, its KV stored for a decode replica.

        Raises `SimFaultError` / `OverloadedError` before any emit; cancellation and connection errors from
        ``emit`` propagate after the request is counted as cancelled.
        """
        cfg, stats, faults = self.config, self.stats, self.faults
        arrival = time.monotonic()
        stats.started += 1
        self._notify()
        if faults.crash_after is not None and stats.started > faults.crash_after:
            self._exit_fn(1)
            stats.failed += 1  # only reached when exit_fn returns (tests)
            raise SimFaultError("injected crash")
        if faults.error_rate > 0 and self._fault_rng.random() < faults.error_rate:
            stats.failed += 1
            self._notify()
            raise SimFaultError("injected error")
        prompt_len = len(tokens)
        try:
            if faults.stall_rate > 0 and faults.stall_s > 0 and self._fault_rng.random() < faults.stall_rate:
                await asyncio.sleep(faults.stall_s)
            alloc = await self._acquire(tokens, hashes, prompt_len + max_tokens)
        except asyncio.CancelledError:
            stats.cancelled += 1
            self._notify()
            raise
        except OverloadedError:
            stats.failed += 1
            self._notify()
            raise
        m = self.metrics
        admitted = first_token = time.monotonic()
        m.queue_time.observe(admitted - arrival)
        m.prefix_queries.inc(prompt_len)
        bs = self.cache.block_size
        loaded, handed = alloc.loaded_blocks * bs, alloc.handed_blocks * bs
        m.prefix_hits.inc(alloc.cached_tokens - loaded - handed)
        if self.cache.cpu_blocks or self.transfer is not None:
            m.external_queries.inc(prompt_len - (alloc.cached_tokens - loaded - handed))
            m.external_hits.inc(loaded + handed)
        m.prompt_tokens.inc(prompt_len)
        stats.prompt_tokens_total += prompt_len
        stats.cached_tokens_total += alloc.cached_tokens
        self._notify()
        try:
            words = self.output_words(tokens, max_tokens)
            if save_kv and self.transfer is not None:
                self.transfer.save(hashes)
            if cfg.instant:
                m.ttft.observe(first_token - arrival)
                stats.generated_tokens += max_tokens
                m.generation_tokens.inc(max_tokens)
                await emit(words, alloc.cached_tokens)
            else:
                computed = prompt_len - alloc.cached_tokens
                self._prefilling += computed
                try:
                    await asyncio.sleep(self.prefill_s(computed, loaded, handed))
                finally:
                    self._prefilling -= computed
                last = first_token = time.monotonic()
                m.ttft.observe(last - arrival)
                for i, word in enumerate(words):
                    if i:
                        await asyncio.sleep(self.itl_s())
                        now = time.monotonic()
                        m.itl.observe(now - last)
                        last = now
                    stats.generated_tokens += 1
                    m.generation_tokens.inc()
                    self._notify()
                    await emit((word,), alloc.cached_tokens)
            stats.completed += 1
            m.success_length.inc()
            m.prefill_time.observe(first_token - admitted)  # vLLM observes these when a request finishes
            m.prefill_computed.observe(prompt_len - alloc.cached_tokens)
            m.generation_length.observe(max_tokens)
            m.e2e.observe(time.monotonic() - arrival)
            return GenResult(prompt_len, max_tokens, alloc.cached_tokens)
        except (asyncio.CancelledError, ConnectionError):
            stats.cancelled += 1
            raise
        finally:
            self._finish(alloc)
