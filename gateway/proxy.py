"""Relay one request to a replica, retrying on another replica while nothing has reached the client yet.

Algorithm per request:
1. Ask the router for a replica (excluding those already tried); 503 when there is none.
2. POST the body; wait for the response headers within `first_byte_s` (connect within `connect_s`).
3. Connection refused / reset, timeout, or a 5xx before any byte went to the client: count the failure on the
   replica (its breaker may open), and retry on another replica, at most `max_attempts` attempts in all.
   A 4xx is the client's error: relayed as is, no retry.
4. Streaming: SSE events are relayed one by one as they arrive (no buffering beyond one partial event); the client's
   response is only started when the first event arrives, so an engine that dies before its first event is still
   retried. The gateway always asks the engine for the usage chunk and drops it again when the client did not ask.
5. The client leaving cancels the handler task (aiohttp does), which aborts the upstream connection, and vLLM
   aborts a request whose connection closed: the engine stops generating at once.
Everything reaches the client through the request's `Responder` (gateway.responder).
Cost per streamed event: one bytes.find for the event boundary plus a substring check for usage.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from engine_pool.http_client import UpstreamClient, UpstreamConnectionError, UpstreamResponse
from engine_pool.replica import Replica
from engine_pool.replica_set import ReplicaSet
from gateway.answers import answer_id, upstream_error, usage_event, usage_of
from gateway.config import DisaggregationConfig, RetryConfig, TimeoutConfig
from gateway.context import RequestContext
from gateway.disagg import PrefillStep
from gateway.errors import GatewayError, Retryable, UpstreamTimeout, UpstreamUnavailable
from gateway.metrics import GatewayMetrics
from gateway.migration import Delivered, continuation, migratable
from gateway.request_parse import ParsedRequest, upstream_body
from gateway.responder import Responder
from gateway.router import Router
from policies.base import Decision, RequestInfo

_DONE = b"data: [DONE]"


class Migration(Exception):
    """A stream's engine failed after the client got its first events, and the answer can continue elsewhere."""

    def __init__(self, failure: GatewayError) -> None:
        self.failure = failure


@dataclass(slots=True)
class ProxySettings:
    timeouts: TimeoutConfig
    retry: RetryConfig
    route_headers: bool = True
    disagg: DisaggregationConfig = field(default_factory=DisaggregationConfig)


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
        self.prefill = PrefillStep(self, router, metrics, settings.disagg, settings.retry)

    async def _route(
        self, parsed: ParsedRequest, info: RequestInfo, ctx: RequestContext, tried: Collection[str], attempt: int
    ) -> tuple[Replica, Decision]:
        ctx.route_started = time.monotonic()
        replica, decision = await self.router.choose(info, tried)
        ctx.routed_at = time.monotonic()
        if attempt:
            self.metrics.model(parsed.model).retries.value += 1
        ctx.attempts = attempt + 1
        ctx.replica, ctx.route_reason = replica.id, decision.reason
        return replica, decision

    async def forward(
        self,
        out: Responder,
        path: str,
        parsed: ParsedRequest,
        info: RequestInfo,
        ctx: RequestContext,
        raw_body: bytes,
        salted: bool = False,
        *,
        method: str = "POST",
        pinned: Replica | None = None,
    ) -> int:
        """Relay the request to `path` on a replica (`pinned`: that one, no retry elsewhere) and write the engine's
        answer to `out`; returns the HTTP status recorded."""
        data = upstream_body(parsed, raw_body, salted)
        deadline = time.monotonic() + self.settings.timeouts.total_s
        if pinned is None:  # a split model's request first takes its prefill step (gateway.disagg)
            data = await self.prefill.run(path, parsed, info, ctx, data, deadline)
        retry = self.settings.retry
        delivered = None
        if retry.migrate_streams and parsed.stream and migratable(parsed.endpoint, parsed.body):
            delivered = Delivered(retry.migration_buffer_bytes)
        tried: list[str] = []
        refused: list[Replica] = []  # replicas that answered this request with a 5xx (see below)
        last_error: GatewayError | None = None
        for attempt in range(1 if pinned is not None else self.settings.retry.max_attempts):
            try:
                if pinned is not None:
                    replica, decision = pinned, Decision(pinned.id, "holds-response")
                    ctx.attempts, ctx.replica, ctx.route_reason = 1, pinned.id, decision.reason
                else:
                    replica, decision = await self._route(parsed, info, ctx, tried, attempt)
            except GatewayError:
                if last_error is not None:
                    raise last_error from None
                raise
            tried.append(replica.id)
            try:
                status = await self._attempt(
                    out, method, path, parsed, replica, decision, ctx, data, deadline, delivered
                )
            except Migration as cut:  # the engine failed mid-stream: the answer continues elsewhere
                assert delivered is not None
                status = await self._migrate(
                    out, method, path, parsed, info, ctx, data, deadline, delivered, tried, cut.failure
                )
            except Retryable as exc:
                self.metrics.upstream_errors.labels(replica.id, exc.kind).inc()
                last_error = exc.error
                if not exc.kind.startswith("http_"):
                    self.count_failure(replica)  # connect, reset, timeout: the replica's fault
                elif refused:  # a second replica refused the same request: the request is at fault, not them
                    raise exc.error from None
                else:
                    refused.append(replica)  # counted against it only if another replica answers the request
                continue
            for bad in refused:
                self.count_failure(bad)
            return status
        for bad in refused:
            self.count_failure(bad)
        assert last_error is not None
        raise last_error

    def count_failure(self, replica: Replica) -> None:
        retry = self.settings.retry
        if replica.record_failure(threshold=retry.breaker_failures, cooldown_s=retry.breaker_cooldown_s):
            self.replicas.breaker_changed()

    def _headers(self, ctx: RequestContext, replica: Replica, decision: Decision) -> dict[str, str]:
        headers = {"x-request-id": ctx.request_id, **ctx.extra_headers}
        if self.settings.route_headers:
            headers["x-kvgate-replica"] = replica.id
            headers["x-kvgate-route-reason"] = decision.reason
        return headers

    @staticmethod
    def _ask_headers(ctx: RequestContext, content_type: str) -> dict[str, str]:
        headers = {"Content-Type": content_type, "x-request-id": ctx.request_id}
        if ctx.trace is not None:  # the engine's spans join the request's trace under kvgate.upstream
            headers["traceparent"] = ctx.trace.upstream_traceparent()
            ctx.sent_at = time.monotonic()
        elif ctx.client_traceparent is not None:
            headers["traceparent"] = ctx.client_traceparent
        return headers

    async def send(
        self,
        replica: Replica,
        method: str,
        path: str,
        data: bytes,
        ctx: RequestContext,
        deadline: float,
        stream: bool,
        content_type: str = "application/json",
    ) -> UpstreamResponse:
        """POST and wait for the response headers; a kept-alive connection that turns out stale is replaced once.
        A stream's headers come with its first event: waited for `first_byte_s`, then retried elsewhere. A whole
        answer's headers come only when the generation is done: waited for until the total deadline, and a timeout
        then is not retried (the engine took the request; running it again elsewhere would only repeat the work)."""
        timeouts = self.settings.timeouts
        pool = self.client.pool(replica.host, replica.port, replica.use_tls)
        headers = self._ask_headers(ctx, content_type)
        url = replica.base_path + path
        for fresh_retry in (False, True):
            upstream: UpstreamResponse | None = None
            left = deadline - time.monotonic()
            budget = min(timeouts.first_byte_s, left) if stream else left
            try:
                started = time.monotonic()  # on an idle kept-alive connection (the common case) nothing waits
                upstream = await pool.request(
                    method, url, data, headers, connect_timeout_s=min(timeouts.connect_s, budget)
                )
                # one timer on the response (the client's DeadlineWatch), not a task timeout around the wait
                upstream.set_timeout(budget - (time.monotonic() - started))
                await upstream.headers_ready
                return upstream
            except TimeoutError:
                if upstream is not None:
                    upstream.close()
                if not stream:
                    raise UpstreamTimeout(f"replica {replica.id} did not finish within timeouts.total_s") from None
                raise Retryable("timeout", UpstreamTimeout(f"replica {replica.id} did not answer in time")) from None
            except UpstreamConnectionError as exc:
                if upstream is not None:
                    upstream.close()
                    if upstream.reused and not fresh_retry:
                        continue
                raise Retryable("connect", UpstreamUnavailable(f"replica {replica.id} unreachable: {exc}")) from None
            except BaseException:  # cancelled (the client left) while the engine works: abort the engine request
                if upstream is not None:
                    upstream.close()
                raise
        raise AssertionError("unreachable")

    async def _attempt(
        self,
        out: Responder,
        method: str,
        path: str,
        parsed: ParsedRequest,
        replica: Replica,
        decision: Decision,
        ctx: RequestContext,
        data: bytes,
        deadline: float,
        delivered: Delivered | None = None,
    ) -> int:
        started = replica.begin()  # the in-flight gauge is read from the replicas at scrape time
        try:
            upstream = await self.send(replica, method, path, data, ctx, deadline, parsed.stream, parsed.content_type)
            try:
                if upstream.status >= 500:
                    raise Retryable(f"http_{upstream.status}", await upstream_error(upstream)) from None
                if upstream.status >= 400:
                    replica.record_success()  # the engine works; the request was bad
                    err = await upstream_error(upstream)
                    err.headers.update(self._headers(ctx, replica, decision))
                    raise err
                if parsed.stream:
                    return await self._relay_stream(out, parsed, upstream, replica, decision, ctx, deadline, delivered)
                await self._relay_whole(out, upstream, replica, decision, ctx, deadline, parsed.records_id)
                return upstream.status
            except BaseException:
                upstream.close()  # never reuse a connection mid-response: closing it aborts the engine request
                raise
            finally:
                upstream.release()
        finally:
            replica.end(started)

    async def _relay_whole(
        self,
        out: Responder,
        upstream: UpstreamResponse,
        replica: Replica,
        decision: Decision,
        ctx: RequestContext,
        deadline: float,
        records_id: bool = False,
    ) -> None:
        if not upstream.complete:  # usually the whole body came with the headers
            upstream.set_timeout(deadline - time.monotonic())
        try:
            raw = await upstream.read()
        except TimeoutError:  # the total deadline: nothing left to retry with
            raise UpstreamTimeout(f"replica {replica.id} did not finish within timeouts.total_s") from None
        except ConnectionError as exc:
            raise Retryable("reset", UpstreamUnavailable(f"replica {replica.id} failed mid-response: {exc}")) from None
        replica.record_success()
        ctx.ttft_s = time.monotonic() - ctx.started
        headers = self._headers(ctx, replica, decision)
        headers["Content-Type"] = "application/json"
        try:
            await out.send(upstream.status, headers, raw)
        finally:
            ctx.set_usage(usage_of(raw))  # the engine did the work, whether or not the client is still there
            if records_id:
                ctx.answer_id = answer_id(raw)
        ctx.delivered = True

    async def _relay_stream(
        self,
        out: Responder,
        parsed: ParsedRequest,
        upstream: UpstreamResponse,
        replica: Replica,
        decision: Decision,
        ctx: RequestContext,
        deadline: float,
        delivered: Delivered | None = None,
    ) -> int:
        """Relay the SSE events; returns the status to record: 200, or 502/504 for a stream that was cut or
        stalled after it started (the client then gets an OpenAI-shaped error event before the end, never a
        clean end that looks complete), unless it can continue on another replica: then `Migration` is raised
        (`delivered` keeps what the client got). A continuation's events go into the client's started stream,
        without its first (role) event, its usage told as the whole answer's."""
        timeouts = self.settings.timeouts
        started = done = False
        skip_role = out.started  # a continuation (gateway.migration): the client has the role event already
        before = delivered.tokens_before if delivered is not None else 0
        strip_usage = not parsed.include_usage
        buf = b""
        last_write = 0.0
        itl = self.metrics.model(parsed.model).itl
        loop = asyncio.get_running_loop()
        end_at = loop.time() + (deadline - time.monotonic())
        upstream.clear_timeout()  # the stream's own windows below also bound the writes to the client
        failure: GatewayError | None = None
        try:
            async with asyncio.timeout(min(timeouts.first_byte_s, deadline - time.monotonic())) as window:
                async for chunk in upstream.iter_chunks():
                    if started:  # past the first event: at most stream_idle_s between chunks, within the total
                        window.reschedule(min(end_at, loop.time() + timeouts.stream_idle_s))
                    buf += chunk
                    events = []
                    while (end := buf.find(b"\n\n")) >= 0:
                        event, buf = buf[: end + 2], buf[end + 2 :]
                        if b'"usage"' in event and not event.startswith(_DONE):
                            event = usage_event(event, ctx, strip_usage, before)
                        if parsed.records_id and ctx.answer_id is None and b'"response"' in event:
                            ctx.answer_id = answer_id(event[event.find(b"{") :])
                        if event:
                            events.append(event)
                    if skip_role and events:
                        events, skip_role = [e for e in events if b'"role"' not in e], False
                    if not events:
                        continue
                    now = time.monotonic()
                    if not started:
                        if not out.started:
                            headers = self._headers(ctx, replica, decision)
                            headers["Content-Type"] = "text/event-stream"
                            headers["Cache-Control"] = "no-cache"
                            await out.start_stream(upstream.status, headers)
                            ctx.ttft_s = now - ctx.started
                        started = True
                        window.reschedule(min(end_at, loop.time() + timeouts.stream_idle_s))
                        replica.record_success()
                    else:
                        itl.observe(now - last_write)
                    last_write = now
                    data = b"".join(events)
                    if delivered is not None:
                        delivered.add(events, len(data))
                    await out.write(data)
                    if events[-1].startswith(_DONE):
                        done = ctx.delivered = True  # the client has everything; it may close before the terminator
        except TimeoutError:
            if not started:
                raise Retryable("timeout", UpstreamTimeout(f"replica {replica.id} sent no token in time")) from None
            idle = loop.time() < end_at
            ctx.error = "stream_idle_timeout" if idle else "total_timeout"
            failure = UpstreamTimeout(
                f"replica {replica.id} sent nothing for {timeouts.stream_idle_s:g} s"
                if idle
                else "the stream did not finish within timeouts.total_s",
                code=ctx.error,
            )
            if idle:
                self.count_failure(replica)
        except UpstreamConnectionError as exc:  # the engine failed mid-stream
            if not started:
                raise Retryable("reset", UpstreamUnavailable(f"replica {replica.id} failed: {exc}")) from None
            ctx.error = "upstream_reset"
            failure = UpstreamUnavailable(f"replica {replica.id} failed mid-stream: {exc}", code="upstream_reset")
            self.metrics.upstream_errors.labels(replica.id, "reset_mid_stream").inc()
            self.count_failure(replica)
        if not started:
            raise Retryable("empty", UpstreamUnavailable(f"replica {replica.id} closed the stream empty")) from None
        if failure is None and parsed.endpoint in ("json", "multipart"):  # others' streams end with the body
            ctx.delivered = True
        elif failure is None and not done:  # chat and completions end with [DONE]: cut short without it
            ctx.error = "upstream_truncated"
            failure = UpstreamUnavailable(f"replica {replica.id} ended the stream early", code="upstream_truncated")
        if failure is not None and not done and delivered is not None and self._may_migrate(delivered, deadline):
            raise Migration(failure)
        return await self._end_stream(out, failure)

    @staticmethod
    async def _end_stream(out: Responder, failure: GatewayError | None) -> int:
        if failure is not None:
            await out.write(b"data: " + json.dumps(failure.body()).encode() + b"\n\n")
        await out.end()
        return 200 if failure is None else failure.status

    def _may_migrate(self, delivered: Delivered, deadline: float) -> bool:
        retry = self.settings.retry
        return delivered.within_bound and delivered.migrations < retry.max_migrations and time.monotonic() < deadline

    async def _migrate(
        self,
        out: Responder,
        method: str,
        path: str,
        parsed: ParsedRequest,
        info: RequestInfo,
        ctx: RequestContext,
        data: bytes,
        deadline: float,
        delivered: Delivered,
        failed: list[str],
        failure: GatewayError,
    ) -> int:
        """Continue a stream whose engine failed on other replicas (`gateway.migration`), at most
        `retry.max_migrations` times; the client's stream ends with the last failure's error event otherwise."""
        model = self.metrics.model(parsed.model)
        while self._may_migrate(delivered, deadline):
            delivered.migrations += 1
            cont = continuation(parsed.endpoint, data, delivered)
            if cont is None:
                break
            data, tokens = cont
            delivered.tokens_before += tokens
            try:
                replica, decision = await self.router.choose(info, failed)
            except GatewayError:
                break
            failed.append(replica.id)
            ctx.replica, ctx.route_reason, ctx.migrations = replica.id, "migrated", delivered.migrations
            try:
                status = await self._attempt(
                    out, method, path, parsed, replica, decision, ctx, data, deadline, delivered
                )
            except Retryable as exc:  # the continuation failed before its first event
                self.metrics.upstream_errors.labels(replica.id, exc.kind).inc()
                self.count_failure(replica)
                failure = exc.error
                continue
            except Migration as again:
                failure = again.failure
                continue
            except GatewayError as refused:  # the engine refused the continuation (4xx): the stream ends with it
                failure = refused
                break
            model.migrated.value += 1
            ctx.error = None
            return status
        model.migration_failed.value += 1
        ctx.error = failure.code
        return await self._end_stream(out, failure)
