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
from dataclasses import dataclass
from typing import Any

import orjson

from engine_pool.http_client import UpstreamClient, UpstreamConnectionError, UpstreamResponse
from engine_pool.replica import Replica
from engine_pool.replica_set import ReplicaSet
from gateway.config import RetryConfig, TimeoutConfig
from gateway.context import RequestContext
from gateway.errors import GatewayError, UpstreamError, UpstreamTimeout, UpstreamUnavailable
from gateway.metrics import GatewayMetrics
from gateway.request_parse import ParsedRequest, upstream_body
from gateway.responder import Responder
from gateway.router import Router
from policies.base import Decision, RequestInfo

_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_DONE = b"data: [DONE]"


class _Retryable(Exception):
    def __init__(self, kind: str, error: GatewayError) -> None:
        super().__init__(kind)
        self.kind = kind
        self.error = error


@dataclass(slots=True)
class ProxySettings:
    timeouts: TimeoutConfig
    retry: RetryConfig
    route_headers: bool = True


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

    def _route(
        self, parsed: ParsedRequest, info: RequestInfo, ctx: RequestContext, tried: Collection[str], attempt: int
    ) -> tuple[Replica, Decision]:
        replica, decision = self.router.choose(info, tried)
        if attempt:
            self.metrics.model(parsed.model).retries.value += 1
        ctx.attempts = attempt + 1
        ctx.replica, ctx.route_reason = replica.id, decision.reason
        return replica, decision

    async def forward(
        self,
        out: Responder,
        parsed: ParsedRequest,
        info: RequestInfo,
        ctx: RequestContext,
        raw_body: bytes,
        salted: bool = False,
    ) -> int:
        """Relay the request and write the engine's answer to `out`; returns the HTTP status sent."""
        data = upstream_body(parsed, raw_body, salted)
        deadline = time.monotonic() + self.settings.timeouts.total_s
        tried: list[str] = []
        last_error: GatewayError | None = None
        for attempt in range(self.settings.retry.max_attempts):
            try:
                replica, decision = self._route(parsed, info, ctx, tried, attempt)
            except GatewayError:
                if last_error is not None:
                    raise last_error from None
                raise
            tried.append(replica.id)
            try:
                return await self._attempt(out, parsed, replica, decision, ctx, data, deadline)
            except _Retryable as exc:
                self.metrics.upstream_errors.labels(replica.id, exc.kind).inc()
                if replica.record_failure(
                    threshold=self.settings.retry.breaker_failures, cooldown_s=self.settings.retry.breaker_cooldown_s
                ):
                    self.replicas.breaker_changed()
                last_error = exc.error
        assert last_error is not None
        raise last_error

    def _headers(self, ctx: RequestContext, replica: Replica, decision: Decision) -> dict[str, str]:
        headers = {"x-request-id": ctx.request_id, **ctx.extra_headers}
        if self.settings.route_headers:
            headers["x-kvgate-replica"] = replica.id
            headers["x-kvgate-route-reason"] = decision.reason
        return headers

    @staticmethod
    def _ask_headers(ctx: RequestContext) -> dict[str, str]:
        return {"Content-Type": "application/json", "x-request-id": ctx.request_id}

    async def _send(
        self, replica: Replica, path: str, data: bytes, ctx: RequestContext, deadline: float
    ) -> UpstreamResponse:
        """POST and wait for the response headers; a kept-alive connection that turns out stale is replaced once."""
        timeouts = self.settings.timeouts
        pool = self.client.pool(replica.host, replica.port, replica.use_tls)
        headers = self._ask_headers(ctx)
        url = replica.base_path + path
        for fresh_retry in (False, True):
            upstream: UpstreamResponse | None = None
            budget = min(timeouts.first_byte_s, deadline - time.monotonic())
            try:
                started = time.monotonic()  # on an idle kept-alive connection (the common case) nothing waits
                upstream = await pool.request(
                    "POST", url, data, headers, connect_timeout_s=min(timeouts.connect_s, budget)
                )
                # one timer on the response (the client's DeadlineWatch), not a task timeout around the wait
                upstream.set_timeout(budget - (time.monotonic() - started))
                await upstream.headers_ready
                return upstream
            except TimeoutError:
                if upstream is not None:
                    upstream.close()
                raise _Retryable("timeout", UpstreamTimeout(f"replica {replica.id} did not answer in time")) from None
            except UpstreamConnectionError as exc:
                if upstream is not None:
                    upstream.close()
                    if upstream.reused and not fresh_retry:
                        continue
                raise _Retryable("connect", UpstreamUnavailable(f"replica {replica.id} unreachable: {exc}")) from None
            except BaseException:  # cancelled (the client left) while the engine works: abort the engine request
                if upstream is not None:
                    upstream.close()
                raise
        raise AssertionError("unreachable")

    async def _attempt(
        self,
        out: Responder,
        parsed: ParsedRequest,
        replica: Replica,
        decision: Decision,
        ctx: RequestContext,
        data: bytes,
        deadline: float,
    ) -> int:
        started = replica.begin()  # the in-flight gauge is read from the replicas at scrape time
        try:
            upstream = await self._send(replica, _PATHS[parsed.endpoint], data, ctx, deadline)
            try:
                if upstream.status >= 500:
                    raise _Retryable(f"http_{upstream.status}", await self._upstream_error(upstream)) from None
                if upstream.status >= 400:
                    replica.record_success()  # the engine works; the request was bad
                    err = await self._upstream_error(upstream)
                    err.headers.update(self._headers(ctx, replica, decision))
                    raise err
                if parsed.stream:
                    await self._relay_stream(out, parsed, upstream, replica, decision, ctx, deadline)
                else:
                    await self._relay_whole(out, upstream, replica, decision, ctx, deadline)
                return upstream.status
            except BaseException:
                upstream.close()  # never reuse a connection mid-response: closing it aborts the engine request
                raise
            finally:
                upstream.release()
        finally:
            replica.end(started)

    async def _upstream_error(self, upstream: UpstreamResponse) -> UpstreamError:
        upstream.set_timeout(5.0)
        try:
            raw = await upstream.read()
            body: Any = json.loads(raw)
        except (ValueError, TimeoutError, ConnectionError):
            body = None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            msg = str(body["error"].get("message", "upstream error"))
            return UpstreamError(msg, status=upstream.status, upstream_body=body)
        if isinstance(body, dict) and "message" in body:  # vLLM's older flat error shape
            wrapped: dict[str, object] = {
                "error": {
                    "message": str(body["message"]),
                    "type": str(body.get("type", "upstream_error")),
                    "param": body.get("param"),
                    "code": body.get("code", upstream.status),
                }
            }
            return UpstreamError(str(body["message"]), status=upstream.status, upstream_body=wrapped)
        return UpstreamError(f"engine answered HTTP {upstream.status}", status=upstream.status)

    async def _relay_whole(
        self,
        out: Responder,
        upstream: UpstreamResponse,
        replica: Replica,
        decision: Decision,
        ctx: RequestContext,
        deadline: float,
    ) -> None:
        if not upstream.complete:  # usually the whole body came with the headers
            upstream.set_timeout(deadline - time.monotonic())
        try:
            raw = await upstream.read()
        except TimeoutError:
            raise _Retryable("timeout", UpstreamTimeout(f"replica {replica.id} timed out")) from None
        except ConnectionError as exc:
            raise _Retryable("reset", UpstreamUnavailable(f"replica {replica.id} failed mid-response: {exc}")) from None
        replica.record_success()
        ctx.ttft_s = time.monotonic() - ctx.started
        headers = self._headers(ctx, replica, decision)
        headers["Content-Type"] = "application/json"
        try:
            await out.send(upstream.status, headers, raw)
        finally:
            ctx.set_usage(usage_of(raw))  # the engine did the work, whether or not the client is still there
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
    ) -> None:
        first_byte_s = self.settings.timeouts.first_byte_s
        started = False
        strip_usage = not parsed.include_usage
        buf = b""
        last_write = 0.0
        itl = self.metrics.model(parsed.model).itl
        upstream.clear_timeout()  # the stream's own windows below also bound the writes to the client
        try:
            async with asyncio.timeout(min(first_byte_s, deadline - time.monotonic())) as window:
                async for chunk in upstream.iter_chunks():
                    buf += chunk
                    events = []
                    while (end := buf.find(b"\n\n")) >= 0:
                        event, buf = buf[: end + 2], buf[end + 2 :]
                        if b'"usage"' in event and not event.startswith(_DONE):
                            event = self._usage_event(event, ctx, strip_usage)
                        if event:
                            events.append(event)
                    if not events:
                        continue
                    now = time.monotonic()
                    if not started:
                        headers = self._headers(ctx, replica, decision)
                        headers["Content-Type"] = "text/event-stream"
                        headers["Cache-Control"] = "no-cache"
                        await out.start_stream(upstream.status, headers)
                        started = True
                        ctx.ttft_s = now - ctx.started
                        window.reschedule(deadline)  # past the first byte, only the total deadline applies
                        replica.record_success()
                    else:
                        itl.observe(now - last_write)
                    last_write = now
                    await out.write(b"".join(events))
                    if events[-1].startswith(_DONE):
                        ctx.delivered = True  # the client has everything; it may close before the terminator
        except TimeoutError:
            if not started:
                raise _Retryable("timeout", UpstreamTimeout(f"replica {replica.id} sent no token in time")) from None
            ctx.error = "total_timeout"
        except UpstreamConnectionError as exc:  # the engine failed mid-stream
            if not started:
                raise _Retryable("reset", UpstreamUnavailable(f"replica {replica.id} failed: {exc}")) from None
            ctx.error = f"upstream_reset: {exc}"
            self.metrics.upstream_errors.labels(replica.id, "reset_mid_stream").inc()
        if not started:
            raise _Retryable("empty", UpstreamUnavailable(f"replica {replica.id} closed the stream empty")) from None
        ctx.delivered = ctx.delivered or ctx.error is None
        await out.end()

    @staticmethod
    def _usage_event(event: bytes, ctx: RequestContext, strip_usage: bool) -> bytes:
        """Record usage from a usage-carrying event; drop the final usage-only event unless the client asked."""
        try:
            payload = json.loads(event[event.index(b"{") :])
        except ValueError:
            return event
        if not isinstance(payload, dict) or not isinstance(payload.get("usage"), dict):
            return event
        ctx.set_usage(payload["usage"])
        if strip_usage and not payload.get("choices"):
            return b""
        return event


_DECODER = json.JSONDecoder()


def usage_of(raw: bytes) -> object:
    """The `usage` object of a completion response, parsing only that object rather than the whole body: its end
    is the brace that closes it (usage holds numbers and nested objects of numbers; anything else is read by the
    standard library's decoder from the object's start)."""
    idx = raw.rfind(b'"usage"')
    if idx < 0:
        return None
    start = raw.find(b"{", idx)
    if start < 0:
        return None
    end = raw.find(b"}", start)
    nested = raw.find(b"{", start + 1, end)
    while nested >= 0 and end >= 0:  # a nested object closes first: the usage object ends at a later brace
        nested = raw.find(b"{", nested + 1, end)
        end = raw.find(b"}", end + 1)
    try:
        return orjson.loads(raw[start : end + 1])
    except orjson.JSONDecodeError:
        pass
    try:
        usage, _ = _DECODER.raw_decode(raw[start:].decode("utf-8", "replace"))
    except ValueError:
        return None
    return usage
