"""`CacheAwareState`: the one object the gateway holds for cache-aware routing.

Per request: `request_info` chooses the tokenizer per model (config, else the replica's, else `chars`) and the
model's block size; `tokenize_pool` (cacheindex.tokenize_pool: the tokenizers and their thread pool) tokenizes the
prompt as the target engine will, cuts it into full blocks and hashes them in the cache context (model or LoRA
adapter name + `cache_salt`).
`overlap` / `session_replica` fill the `RoutingView`; `on_routed` records the speculative insert and binds the
session, and hands both to `shared` (the other gateways, gateway.fleet, given at construction) when any;
`apply_shared` learns theirs. A prompt whose new turn is hashed after routing (`PrefixRequestInfo.rest`) is
recorded, predicted and checked with its whole blocks once they are known (`_whole`), in call order.
`on_finished` compares the predicted cached tokens with the engine's `cached_tokens` (live parity).

Replicas: `add_replica` registers a replica's block size and capacity and, when KV events are enabled and its
tokenizer is exact, a ZMQ subscriber (started by `start`, or at once when already started). Events are re-hashed
into kvgate's chain (kv_index). Every structure is bounded: index by replica capacity, sessions by config, pending
predictions by `_MAX_PENDING`, tokenizers by tokenize_pool's LRU.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import zmq.asyncio
from prometheus_client import CollectorRegistry

from cacheindex.config import CacheConfig
from cacheindex.event_sink import KvEventApplier
from cacheindex.kv_events import KvEvent, KvEventSubscriber
from cacheindex.kv_index import KvIndex
from cacheindex.metrics import PrefixMetrics
from cacheindex.routed import ParityWindows, Routed, RoutedRequests
from cacheindex.sessions import AwaitedSessions, SessionTable, session_digest
from cacheindex.shared import EarlyDecisions, SharedRouting
from cacheindex.tokenize_pool import TokenizePool
from cacheindex.tokenizers import PromptTokenizer
from policies.base import Decision, Footprint, RequestInfo

log = logging.getLogger(__name__)

_MAX_PENDING = 65_536  # routed requests awaiting on_finished (parity); oldest forgotten first


@dataclass(frozen=True, slots=True)
class PrefixRequestInfo(RequestInfo):
    tokenizer_kind: str = ""
    approximate: bool = False  # pseudo tokens: overlaps are estimates
    # a conversation's new turn being encoded after routing: then `prompt_tokens` is an estimate, `block_hashes` the
    # blocks before it, and this the whole prompt's count and hashes (tokenize_pool.Tokenized)
    rest: asyncio.Future[tuple[int, tuple[int, ...]] | None] | None = field(default=None, compare=False)


@dataclass(slots=True)
class _Replica:
    model: str
    block_size: int
    tokenizer: str
    events_endpoint: str | None
    replay_endpoint: str | None
    topic: str
    subscriber: KvEventSubscriber | None = None


class CacheAwareState:
    def __init__(
        self, config: CacheConfig, registry: CollectorRegistry, *, shared: SharedRouting | None = None
    ) -> None:
        """`shared`: the other gateways (gateway.fleet), when several share their routing."""
        self.config = config
        self.registry = registry
        self.index = KvIndex(speculative_ttl_s=config.speculative_ttl_s, hot_window_s=config.hot_window_s)
        self.sessions = SessionTable(ttl_s=config.session_ttl_s, max_entries=config.session_max_entries)
        self.awaited = (
            AwaitedSessions(ttl_s=config.awaited_ttl_s, max_entries=config.session_max_entries)
            if config.awaited_ttl_s > 0
            else None
        )
        self.metrics = PrefixMetrics(
            registry,
            index_sizes=self.index.sizes,
            capacities=self._capacities,
            offloaded_sizes=self.index.offloaded_sizes,
            sessions=lambda: len(self.sessions),
            awaited=lambda: len(self.awaited) if self.awaited is not None else 0,
        )
        self._replicas: dict[str, _Replica] = {}
        self.tokenize_pool = TokenizePool(config, self.metrics)
        self._started = False  # between start and stop: KV event subscribers run, tokenizers preload
        self._ids = itertools.count(1)
        self.routed = RoutedRequests(_MAX_PENDING)
        self._last_overlap: tuple[int, dict[str, int]] = (0, {})
        self._overlap_memo: tuple[int, int, dict[str, int]] = (0, -1, {})  # request, index version, overlaps
        self.parity = ParityWindows(config.parity_window, config.parity_warn_fraction)
        self._zmq: zmq.asyncio.Context | None = None
        self._stopping: set[asyncio.Task[None]] = set()
        self._events = KvEventApplier(self.index, self.metrics)
        self.shared = shared
        self._early = EarlyDecisions()  # the others' decisions for replicas not registered here yet

    # --- lifecycle --------------------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._started

    async def start(self) -> None:
        """Subscribe to the registered replicas' KV events and preload their tokenizers. Registering replicas and
        learning other gateways' decisions work before (and after) it; `start` after `stop` starts again."""
        self.tokenize_pool.reopen()
        self._started = True
        if self._zmq is None:
            self._zmq = zmq.asyncio.Context()
        for rid, r in self._replicas.items():
            self._start_subscriber(rid, r)
        for spec in {*self.config.tokenizers.values(), *(r.tokenizer for r in self._replicas.values())}:
            self._preload(spec)

    async def stop(self) -> None:
        self._started = False
        await self.tokenize_pool.cancel_preloads()
        for r in self._replicas.values():
            if r.subscriber is not None:
                task = r.subscriber.cancel()
                if task is not None:
                    self._stopping.add(task)
                r.subscriber = None
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)
            self._stopping.clear()
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None
        self.tokenize_pool.close()

    # --- replicas ---------------------------------------------------------------------------------------------
    def _capacities(self) -> dict[str, tuple[int, bool, int]]:
        """Per replica the index's bound in blocks, whether the engine reported it, and the block size."""
        return {
            rid: (blocks, known, self._replicas[rid].block_size)
            for rid, (blocks, known) in self.index.capacities().items()
            if rid in self._replicas
        }

    def add_replica(
        self,
        replica_id: str,
        *,
        model: str,
        block_size: int | None,
        num_blocks: int | None,
        kv_events_endpoint: str | None,
        tokenizer: str | None,
        kv_events_replay_endpoint: str | None = None,
        kv_events_topic: str | None = None,
    ) -> None:
        """Register a replica (re-registering one forgets what was known of its cache). `tokenizer`: a local HF
        dir, "sim" or "chars" (config.tokenizers[model] wins); `kv_events_topic`: its publisher's topic when known
        (None: config.kv_events_topic)."""
        if replica_id in self._replicas:
            self.remove_replica(replica_id)
        spec = self.config.tokenizers.get(model) or tokenizer or "chars"
        r = _Replica(
            model=model,
            block_size=block_size or self.config.default_block_size,
            tokenizer=spec,
            events_endpoint=kv_events_endpoint if self.config.kv_events and spec != "chars" else None,
            replay_endpoint=kv_events_replay_endpoint,
            topic=self.config.kv_events_topic if kv_events_topic is None else kv_events_topic,
        )
        self._replicas[replica_id] = r
        if num_blocks is not None and num_blocks > 0:
            capacity, known = num_blocks, True
        else:  # a starting bound, lowered online from what the replica reports cached
            capacity, known = self.config.max_blocks_per_replica, False
        self.index.add_replica(
            replica_id, capacity_blocks=capacity, precise=r.events_endpoint is not None, capacity_known=known
        )
        if self._zmq is not None:
            self._start_subscriber(replica_id, r)
        self._preload(spec)
        for hashes, session, past in self._early.registered(replica_id):
            self.apply_shared(replica_id, hashes, session, past=past)

    def _preload(self, spec: str) -> None:
        """Load a tokenizer (and chat template) now, in the background, while started (tokenize_pool)."""
        if self._started:
            self.tokenize_pool.preload(spec)

    def tokenizers_loading(self) -> list[str]:
        """The tokenizer specs being loaded now (a request for their models would wait)."""
        return self.tokenize_pool.loading()

    def remove_replica(self, replica_id: str, *, keep_sessions: bool = False) -> None:
        """Forget the replica; `keep_sessions`: its session bindings stay (it is being registered again)."""
        r = self._replicas.pop(replica_id, None)
        self.index.remove_replica(replica_id)
        self.routed.drop_replica(replica_id)
        if not keep_sessions:
            self.sessions.drop_replica(replica_id)
            if self.awaited is not None:
                self.awaited.drop_replica(replica_id)
        if r is not None and r.subscriber is not None:
            task = r.subscriber.cancel()
            if task is not None:
                self._stopping.add(task)
                task.add_done_callback(self._stopping.discard)

    def _start_subscriber(self, replica_id: str, r: _Replica) -> None:
        if r.events_endpoint is None or r.subscriber is not None or self._zmq is None:
            return
        r.subscriber = KvEventSubscriber(
            self._zmq,
            replica_id,
            r.events_endpoint,
            self,
            topic=r.topic,
            replay_endpoint=r.replay_endpoint,
            replay_timeout_s=self.config.kv_events_replay_timeout_s,
        )
        r.subscriber.start()

    # --- per request ------------------------------------------------------------------------------------------
    def _block_size(self, model: str) -> int:
        for r in self._replicas.values():
            if r.model == model:
                return r.block_size
        return self.config.default_block_size

    def _tokenizer_spec(self, model: str) -> str:
        spec = self.config.tokenizers.get(model)
        if spec:
            return spec
        for r in self._replicas.values():
            if r.model == model:
                return r.tokenizer
        return "chars"

    async def tokenizer(self, spec: str) -> PromptTokenizer:
        """The tokenizer for `spec`, loaded once (tokenize_pool); `chars` when it fails to load."""
        return await self.tokenize_pool.tokenizer(spec)

    async def request_info(
        self,
        *,
        model: str,
        endpoint: Literal["chat", "completions"],
        body: Mapping[str, Any],
        tenant: str,
        session_key: str | None,
        base_model: str | None = None,
    ) -> PrefixRequestInfo:
        """Tokenize and hash the request's prompt. Never raises on a prompt the router cannot tokenize: it then
        carries no blocks (routing falls back to load) and `kvgate_prefix_tokenize_errors_total` counts it.
        `base_model`: for a LoRA adapter, the model whose tokenizer and block size it uses; the hashes are seeded
        with the adapter's own name (`model`), as vLLM's KV events are."""
        tok = await self.tokenizer(self._tokenizer_spec(base_model or model))
        block_size = self._block_size(base_model or model)
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        tokenized = await self.tokenize_pool.tokens_and_hashes(
            tok, model=model, endpoint=endpoint, body=body, block_size=block_size, salt=salt
        )
        if session_key is None and self.config.session_from_user:
            user = body.get("user")
            session_key = user if isinstance(user, str) and user else None
        if session_key is not None and self.shared is not None:
            digest = session_digest(f"{tenant}\x00{session_key}")
            if self.sessions.get_digest(digest) is None:
                replica = await self.shared.session_replica(digest)
                if replica is not None and replica in self._replicas:
                    self.sessions.bind_digest(digest, replica)
        return PrefixRequestInfo(
            model=model,
            prompt_tokens=tokenized.tokens,
            block_hashes=tokenized.hashes,
            block_size=block_size,
            session_key=session_key,
            tenant=tenant,
            request_id=next(self._ids),
            tokenizer_kind=tok.kind,
            approximate=tok.approximate,
            rest=tokenized.rest,
        )

    def holders(self, info: RequestInfo) -> list[str]:
        """The replicas holding the prompt's first block (O(those replicas), not O(pool))."""
        return self.index.holders(info.block_hashes[0]) if info.block_hashes else []

    def footprint(self, info: RequestInfo, replica_ids: Iterable[str]) -> dict[str, Footprint]:
        """The index's footprints, each with the blocks of the other sessions awaited on its replica."""
        result = self.index.footprint(info.block_hashes, replica_ids)
        awaited = self.awaited
        if awaited is not None and awaited.by_replica:
            own = self._session_digest(info)
            for rid, fp in result.items():
                if blocks := awaited.blocks(rid, own):
                    result[rid] = fp._replace(awaited_blocks=blocks)
        return result

    def room(self, replica_ids: Iterable[str]) -> dict[str, int]:
        """The index's room per replica (`KvIndex.room`)."""
        return self.index.room(replica_ids)

    def overlap(self, info: RequestInfo, replica_ids: Iterable[str]) -> dict[str, int]:
        """Per replica, the prompt's leading blocks it holds. Admission's latency check and the router both ask
        for a request: the second gets the first's answer when the index has not changed since (a long prompt's
        walk is milliseconds)."""
        if not isinstance(info, PrefixRequestInfo):
            return self.index.overlap(info.block_hashes, replica_ids)
        ids = list(replica_ids)
        memo_id, version, memo = self._overlap_memo
        if memo_id == info.request_id and version == self.index.version and all(r in memo for r in ids):
            result = {r: memo[r] for r in ids}
        else:
            result = self.index.overlap(info.block_hashes, ids)
            self._overlap_memo = (info.request_id, self.index.version, result)
        self._last_overlap = (info.request_id, result)  # on_routed's prediction reuses it (same instant)
        return result

    def offloaded(self, info: RequestInfo, overlap: Mapping[str, int]) -> dict[str, int]:
        """Per replica, the blocks after its GPU overlap that its offloading tier holds (absent: none)."""
        result = self.index.offloaded(info.block_hashes, overlap)
        if result and isinstance(info, PrefixRequestInfo) and self._last_overlap[0] == info.request_id:
            # the engine reports loaded blocks as cached: the prediction on_routed keeps counts them too
            self._last_overlap = (info.request_id, {rid: n + result.get(rid, 0) for rid, n in overlap.items()})
        return result

    @staticmethod
    def _session_digest(info: RequestInfo) -> bytes | None:
        return None if info.session_key is None else session_digest(f"{info.tenant}\x00{info.session_key}")

    def session_replica(self, info: RequestInfo) -> str | None:
        digest = self._session_digest(info)
        replica = self.sessions.get_digest(digest) if digest is not None else None
        return replica if replica in self._replicas else None

    async def claim_cold(self, info: RequestInfo, replica: str) -> str:
        """The replica for a request placed cold (no replica holds its first block): `replica`, or, with other
        gateways, the one that placed the same prefix first."""
        if self.shared is None or not info.block_hashes:
            return replica
        return await self.shared.claim(info.block_hashes[0], replica)

    def on_routed(self, info: RequestInfo, decision: Decision) -> None:
        rid = decision.replica
        digest = self._session_digest(info)
        if digest is not None and rid in self._replicas:
            self.sessions.bind_digest(digest, rid)
            if self.awaited is not None:
                self.awaited.back(digest)
        self._whole(info, lambda whole: self._record_routed(whole, rid, digest, predict=whole is info))

    def _record_routed(self, info: RequestInfo, rid: str, digest: bytes | None, *, predict: bool) -> None:
        """Record the routed prompt's blocks on `rid` (and the prediction live parity checks); `predict`: the
        overlap the decision just computed is the prediction (the prompt was whole when routed)."""
        if isinstance(info, PrefixRequestInfo):
            last_id, last = self._last_overlap
            predicted = last[rid] if predict and last_id == info.request_id and rid in last else None
            if predicted is None:
                predicted = self.index.overlap(info.block_hashes, (rid,))[rid]
            if rid in self._replicas:
                ages = self.index.ages(rid, info.block_hashes, predicted, self.routed.settled_before(rid))
                self.routed.add(info.request_id, Routed(rid, predicted, ages, self.index.inserts(rid)))
        self.index.record_routed(rid, info.block_hashes)
        if self.shared is not None and (info.block_hashes or digest is not None):
            self.shared.publish(rid, info.block_hashes, digest)

    @staticmethod
    def _whole(info: RequestInfo, then: Callable[[RequestInfo], None]) -> None:
        """`then(info)` now, or, for a prompt whose new turn is still being encoded (`PrefixRequestInfo.rest`),
        with the whole prompt once it is (in call order: what `on_routed` deferred runs before `on_finished`)."""
        if not isinstance(info, PrefixRequestInfo) or info.rest is None:
            then(info)
            return
        prompt, rest = info, info.rest

        def whole(_: object) -> None:
            done = None if rest.cancelled() or rest.exception() is not None else rest.result()
            then(prompt if done is None else replace(prompt, prompt_tokens=done[0], block_hashes=done[1], rest=None))

        rest.add_done_callback(whole)

    def apply_shared(self, replica: str, hashes: Sequence[int], session: bytes | None, *, past: bool = False) -> None:
        """Another gateway sent a request with these blocks (and session) to `replica`: learn it as if this one
        had. For a replica not registered here yet, the newest decisions wait for it (bounded); for one that was
        and is away (down, removed), they are ignored. `past`: a decision from before this gateway was reading
        (its history): a replica with KV events then learns nothing from it (its events, replayed, say what it
        holds; the decision's speculative insert expired long ago)."""
        if replica not in self._replicas:
            self._early.keep(replica, (hashes, session, past))
            return
        if hashes and not (past and self._replicas[replica].events_endpoint is not None):
            self.index.record_routed(replica, hashes)
        if session is not None:
            self.sessions.bind_digest(session, replica)
            if self.awaited is not None:
                self.awaited.back(session)

    def apply_awaited(self, replica: str, session: bytes, blocks: int) -> None:
        """Another gateway's answer for the session on `replica` ended in a tool call: expected back there."""
        if self.awaited is not None and replica in self._replicas:
            self.awaited.mark(session, replica, blocks)

    def on_finished(
        self, info: RequestInfo, replica_id: str | None, reported_cached_tokens: int | None, tool_call: bool = False
    ) -> None:
        """A routed request ended (`reported_cached_tokens` None: it failed or reported none). With a report, the
        index learns from it and live parity compares it with the prediction. `tool_call`: its answer ended in a
        tool call, so its session is expected back (`awaited`)."""
        self._whole(info, lambda whole: self._finished(whole, replica_id, reported_cached_tokens, tool_call))

    def _finished(
        self, info: RequestInfo, replica_id: str | None, reported_cached_tokens: int | None, tool_call: bool
    ) -> None:
        if tool_call and self.awaited is not None and replica_id is not None and replica_id in self._replicas:
            digest = self._session_digest(info)
            if digest is not None:
                self.awaited.mark(digest, replica_id, len(info.block_hashes))
                if self.shared is not None:
                    self.shared.publish_awaited(replica_id, digest, len(info.block_hashes))
        if not isinstance(info, PrefixRequestInfo):
            return
        routed = self.routed.pop(info.request_id)
        if routed is None or routed.replica != replica_id or reported_cached_tokens is None:
            return
        predicted_blocks = routed.predicted_blocks
        bs = info.block_size
        # vLLM always computes the last prompt token, so a fully cached prompt reports one block less
        max_blocks = max(info.prompt_tokens - 1, 0) // bs if bs else 0
        predicted = min(predicted_blocks, max_blocks) * bs
        if bs and not info.approximate:
            reported_blocks = reported_cached_tokens // bs
            dropped = self.index.observe(replica_id, predicted // bs, reported_blocks, routed.ages, routed.inserts_at)
            if dropped:
                self.metrics.corrections.labels(replica_id).inc(dropped)
        self.metrics.predicted.labels(info.model).inc(predicted)
        self.metrics.reported.labels(info.model).inc(reported_cached_tokens)
        gap = abs(predicted - reported_cached_tokens)
        self.metrics.gap.labels(info.model).observe(gap)
        if info.approximate:
            return
        self.parity.add(info.model, gap, info.prompt_tokens)

    # --- KV event sink (the subscriber calls these) -----------------------------------------------------------
    def on_kv_events(self, replica_id: str, events: Iterable[KvEvent]) -> None:
        r = self._replicas.get(replica_id)
        if r is not None:
            self._events.apply(replica_id, r, events)

    def on_kv_reset(self, replica_id: str, reason: str) -> None:
        self.index.clear(replica_id)
        self.metrics.events_resets.labels(replica_id, reason).inc()
