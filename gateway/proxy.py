"""Relay one request to a replica, retrying on another replica while nothing has reached the client yet.

Everything the request carries is one `Exchange` (gateway.exchange); every try is one `_attempt`: route -> send
-> relay -> classify the failure. The first try, the retries, the continuation of a stream whose engine failed
(gateway.migration) and the prefill step of a split model (gateway.disagg) all go through it; what differs is only
the loop around it and what is done with the engine's answer (the relay).
1. Route (excluding the replicas already tried); 503 when there is none.
2. Send the body (gateway.upstream_send: the request's headers, the send, a whole answer's read, the client's
   response headers); wait for the response headers within `first_byte_s` for a stream, the total deadline
   otherwise (connect within `connect_s`).
3. Connection refused / reset, timeout, or a 5xx before any byte went to the client: count the failure on the
   replica (its breaker may open; a 5xx only once another replica answered the same request: two replicas refusing
   it means the request is at fault) and try another replica, at most `max_attempts` attempts in all. A 4xx is the
   client's error: relayed as is, no retry.
4. Streaming (gateway.stream_relay over gateway.relay): SSE events are relayed as they arrive; the client's response
   starts with the first event of the answer, so an engine that dies before it is still retried. The gateway always
   asks the engine for the usage chunk and drops it again when the client did not ask; on a stream that may migrate
   it also asks for the running usage (the engine's own token count at the seam) and moves it out of the events.
5. The client leaving cancels the handler task, which aborts the upstream connection; vLLM then aborts the request.
Cost per streamed event: see gateway.relay; per attempt: one routing decision and one engine round trip.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine_pool.http_client import UpstreamClient, UpstreamResponse
from engine_pool.replica import Replica
from engine_pool.replica_set import ReplicaSet
from gateway.admission.targets import place
from gateway.answers import answer_id, ends_in_tool_call, upstream_error, usage_of
from gateway.config import RetryConfig, TimeoutConfig
from gateway.disagg import PrefillStep, transfer_params
from gateway.engines_config import DisaggregationConfig
from gateway.errors import (
    Exhausted,
    GatewayError,
    Migration,
    Retryable,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.migration import CHAT_PATH, Relayed, closing, context_full, continuation
from gateway.router import Router
from gateway.stream_relay import StreamRelay, end_stream, may_migrate
from gateway.upstream_send import content_type, framed_as_json, read_answer, response_headers, send
from policies.base import Decision

T = TypeVar("T")
Relay = Callable[[Exchange, UpstreamResponse, Replica, Decision], Awaitable[T]]


@dataclass(slots=True)
class ProxySettings:
    timeouts: TimeoutConfig
    retry: RetryConfig
    route_headers: bool = True
    disagg: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    max_answer_bytes: int = 256 * 1024 * 1024


class UpstreamProxy:
    def __init__(
        self,
        client: UpstreamClient,
        router: Router,
        replicas: ReplicaSet,
        metrics: GatewayMetrics,
        settings: ProxySettings,
    ) -> None:
        self.client = client
        self.router = router
        self.replicas = replicas
        self.metrics = metrics
        self.settings = settings
        self.prefill = PrefillStep(self._prefill, router, metrics, settings.disagg)
        self.streams = StreamRelay(settings.timeouts, metrics, self.count_failure)

    async def forward(self, ex: Exchange) -> int:
        """Answer `ex` from a replica (its pinned one: that one only); returns the HTTP status recorded."""
        if ex.pinned is None and self.replicas.disaggregated(ex.parsed.model):
            await self.prefill.run(ex)  # a split model's request first takes its prefill step (gateway.disagg)
        attempts = 1 if ex.pinned is not None else self.settings.retry.max_attempts
        try:
            return await self.retrying(ex, self._relay, attempts)
        except Exhausted as exhausted:
            raise exhausted.error from None
        except Migration as cut:  # the engine failed mid-stream: the answer continues elsewhere
            return await self._migrate(ex, cut.failure)

    async def retrying(self, ex: Exchange, relay: Relay[T], attempts: int, *, prefill: bool = False) -> T:
        """Up to `attempts` attempts on distinct replicas; `Exhausted` when none answered."""
        last: GatewayError | None = None
        for attempt in range(attempts):
            try:
                replica, decision = await self._route(ex, prefill=prefill, retry=attempt > 0)
            except GatewayError as none_left:
                raise Exhausted(last or none_left) from None
            try:
                result = await self._attempt(ex, replica, decision, relay)
            except Retryable as exc:
                last = exc.error
                if self._failed(ex, replica, exc, prefill=prefill):
                    raise last from None
                continue
            self._count_refused(ex)
            return result
        self._count_refused(ex)
        assert last is not None
        raise Exhausted(last)

    async def _route(
        self, ex: Exchange, *, prefill: bool = False, retry: bool = False, migrated: bool = False
    ) -> tuple[Replica, Decision]:
        ctx = ex.ctx
        if ex.pinned is not None:
            replica, decision = ex.pinned, Decision(ex.pinned.id, "holds-response")
        else:
            started = time.monotonic()
            replica, decision = await self._choose(ex, prefill, over_gate=migrated or not ex.gated)
            if not prefill:
                ctx.route_started, ctx.routed_at = started, time.monotonic()
                if ctx.trace is not None:  # the route span's: what the index predicted the replica holds
                    ctx.predicted_cached_tokens = self.router.cached_tokens(ex.info, [replica.id]).get(replica.id, 0)
        ex.tried.append(replica.id)
        if prefill:
            return replica, decision
        place(ctx, replica, self.replicas)
        if retry:
            self.metrics.model(ex.parsed.model).retries.value += 1
        if not migrated:
            ctx.attempts += 1
        ctx.replica, ctx.route_reason = replica.id, "migrated" if migrated else decision.reason
        return replica, decision

    async def _choose(self, ex: Exchange, prefill: bool, *, over_gate: bool = False) -> tuple[Replica, Decision]:
        """The router's choice; a first try among the replicas admission prefers (those with KV room when some have
        none; else, unless the request waited in the queue since, those its verdict weighed: the same candidates,
        not drawn again), any replica if none of those can take it; a stream's continuation, and a request that
        computes no KV, past the replicas' gates."""
        ctx = ex.ctx
        prefer = ctx.prefer
        if not prefer and not over_gate and ctx.queue_wait_s == 0.0:
            prefer = tuple([p.replica for p in ctx.predictions])
        if not prefill and not ex.tried and prefer:
            try:
                return await self.router.choose(ex.info, hold=ctx.hold, only=prefer, tentative=True)
            except GatewayError:
                pass
        return await self.router.choose(ex.info, ex.tried, prefill=prefill, hold=ctx.hold, over_gate=over_gate)

    async def _attempt(self, ex: Exchange, replica: Replica, decision: Decision, relay: Relay[T]) -> T:
        """Send `ex` to `replica` and hand its answer to `relay`; a 5xx or a failure before any byte reached the
        client is `Retryable`, as is a 429 (the replica is busy: another may not be), any other 4xx the client's error
        (raised as it is)."""
        started = replica.begin()  # the in-flight gauge is read from the replicas at scrape time
        ex.ctx.batch_mark = replica.batch_mark()
        try:
            try:
                upstream = await send(self.client, self.settings.timeouts, replica, ex)
            except UpstreamTimeout:  # past the total deadline: not retried; a whole answer's is the replica's doing
                self.metrics.upstream_errors.labels(replica.id, "timeout_total").inc()
                if not ex.stream:
                    self.count_failure(replica)
                raise
            try:
                if not 200 <= upstream.status <= 599 or 300 <= upstream.status < 400:  # no answer of an engine's API
                    raise Retryable("bad_status", UpstreamError(
                        f"replica {replica.id} answered HTTP {upstream.status}, not an answer of the API"
                    )) from None  # fmt: skip
                if upstream.status >= 400:  # the engine's error, with its headers (Retry-After) and the route's
                    err = await upstream_error(upstream)
                    err.headers.update(self._headers(ex, replica, decision, upstream))
                    if upstream.status >= 500 or upstream.status == 429:  # 429: this replica is busy, not the request
                        raise Retryable(f"http_{upstream.status}", err) from None
                    replica.record_success()  # the engine works; the request was bad
                    raise err
                return await relay(ex, upstream, replica, decision)
            except BaseException:
                upstream.close()  # never reuse a connection mid-response: closing it aborts the engine request
                raise
            finally:
                upstream.release()
        finally:
            replica.end(started)

    def _failed(self, ex: Exchange, replica: Replica, exc: Retryable, *, prefill: bool = False) -> bool:
        """Count a failed attempt; True when the request itself is at fault (a second replica refused it)."""
        self.metrics.upstream_errors.labels(replica.id, f"prefill_{exc.kind}" if prefill else exc.kind).inc()
        if not exc.kind.startswith("http_"):
            self.count_failure(replica)  # connect, reset, timeout: the replica's fault
            return False
        if exc.kind == "http_429":  # busy: neither the replica's failure nor the request's fault
            return False
        if ex.refused:
            ex.refused.clear()
            return True
        ex.refused.append(replica)  # counted against it only if another replica answers the request
        return False

    def _count_refused(self, ex: Exchange) -> None:
        for bad in ex.refused:
            self.count_failure(bad)
        ex.refused.clear()

    def count_failure(self, replica: Replica) -> None:
        retry = self.settings.retry
        if replica.record_failure(threshold=retry.breaker_failures, cooldown_s=retry.breaker_cooldown_s):
            self.replicas.breaker_changed()

    def _headers(
        self, ex: Exchange, replica: Replica, decision: Decision, upstream: UpstreamResponse
    ) -> dict[str, str]:
        """The client's response headers (gateway.upstream_send), with the route headers when configured."""
        return response_headers(ex, replica, decision, upstream, route_headers=self.settings.route_headers)

    async def _relay(self, ex: Exchange, upstream: UpstreamResponse, replica: Replica, decision: Decision) -> int:
        """The engine's answer to the client: as a stream when the request asked for one and the engine streams
        (an answer that names another content type than SSE is whole: `"stream": true` on a route that does not
        stream, embeddings or tokenizing, is an extra field its engine ignores)."""
        said = content_type(upstream)
        if ex.stream and (said is None or said.startswith("text/event-stream")):
            return await self.streams.relay(ex, upstream, replica, lambda up: self._headers(ex, replica, decision, up))
        ex.ctx.stream = False
        raw = await read_answer(upstream, replica, ex.deadline, self.settings.max_answer_bytes)
        # chat's and completions' answers are JSON whatever the engine says; another route's when it says so
        json_answer = ex.parsed.kind in ("chat", "completions") or (said or "").startswith("application/json")
        if json_answer and not framed_as_json(raw):  # an HTML page, SSE text, a body cut short
            raise Retryable("not_json", UpstreamError(f"replica {replica.id}'s answer is not the JSON it must be"))
        kind = said or "application/json"  # what vLLM's answers are
        ctx = ex.ctx
        ctx.ttft_s = time.monotonic() - ctx.started
        try:
            await ex.out.send(
                upstream.status, {**self._headers(ex, replica, decision, upstream), "Content-Type": kind}, raw
            )
        finally:
            ctx.set_usage(usage_of(raw))  # the engine did the work, whether or not the client is still there
            ctx.tool_call = ex.info.session_key is not None and ends_in_tool_call(raw)
            if ex.parsed.stores_answer:
                ctx.answer_id = answer_id(raw)
        ctx.answered = True
        return upstream.status

    async def _migrate(self, ex: Exchange, failure: GatewayError) -> int:
        """Continue a stream whose engine failed on other replicas (`gateway.migration`), at most
        `retry.max_migrations` times; the client's stream ends with the last failure's error event otherwise. An
        answer that needs no continuation (its finish reason delivered, its max_tokens reached, or a continuation
        refused because the answer fills the context) ends as its engine would have ended it."""
        relayed = ex.relayed
        assert relayed is not None
        model = self.metrics.model(ex.parsed.model)
        while may_migrate(ex):
            data = continuation(ex.parsed, relayed)
            if data is None:
                if relayed.ended is not None:
                    return await self._close(ex, relayed, failure)
                break
            if relayed.migrations >= self.settings.retry.max_migrations:
                break
            relayed.migrations += 1
            ex.data = data
            if relayed.seam is not None:  # a Messages stream continues through chat (gateway.migration)
                ex.path = CHAT_PATH
            try:
                replica, decision = await self._route(ex, migrated=True)
            except GatewayError:
                break
            ex.ctx.migrations = relayed.migrations
            try:
                status = await self._attempt(ex, replica, decision, self._relay)
            except Retryable as exc:  # the continuation failed before its first event
                self.metrics.upstream_errors.labels(replica.id, exc.kind).inc()
                if exc.kind == "http_429":  # busy is not broken (`_failed`), and ran nothing: no migration spent
                    relayed.migrations -= 1  # (each replica is tried once: `_route` excludes those tried)
                else:
                    self.count_failure(replica)
                failure = exc.error
                continue
            except Migration as again:
                failure = again.failure
                continue
            except GatewayError as refused:  # the engine refused the continuation (4xx): the stream ends with it
                if context_full(refused.status, refused.message):  # unless its prompt alone fills the context
                    relayed.ended = "length"
                    return await self._close(ex, relayed, refused)
                failure = refused
                break
            model.migrated.value += 1
            ex.ctx.error = None
            return status
        model.migration_failed.value += 1
        ex.ctx.error = failure.code
        return await end_stream(ex, failure)

    async def _close(self, ex: Exchange, relayed: Relayed, failure: GatewayError) -> int:
        """End the client's stream as its engine would have (`gateway.migration.closing`), or with `failure`'s
        error event where the gateway cannot."""
        ended = closing(ex.parsed, relayed, ex.ctx.prompt_tokens)
        model = self.metrics.model(ex.parsed.model)
        ex.ctx.migrations = max(1, relayed.migrations)  # the engine failed: its timings teach no latency model
        if ended is None:
            model.migration_failed.value += 1
            ex.ctx.error = failure.code
            return await end_stream(ex, failure)
        events, usage = ended
        await ex.out.write(events)
        model.migration_closed.value += 1
        ex.ctx.set_usage(usage)
        ex.ctx.error, ex.ctx.answered = None, True
        return await end_stream(ex, None)

    async def _prefill(self, step: Exchange) -> tuple[Replica, dict[str, Any]] | None:
        """A prefill step (gateway.disagg) through the same attempts, on prefill replicas; None when none ran it
        (each failed, refused it or ran past the step's deadline): the request then runs whole."""
        try:
            return await self.retrying(step, self._prefill_answer, self.settings.retry.max_attempts, prefill=True)
        except (Exhausted, GatewayError):
            return None

    async def _prefill_answer(
        self, step: Exchange, upstream: UpstreamResponse, replica: Replica, decision: Decision
    ) -> tuple[Replica, dict[str, Any]]:
        return replica, transfer_params(
            await read_answer(upstream, replica, step.deadline, self.settings.max_answer_bytes)
        )
