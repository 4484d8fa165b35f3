"""Disaggregated serving: the prefill step a request of a split model takes before the proxy sends it to decode.

Per chat or completions request of a model some of whose replicas have role `prefill`:
1. `Router.split` decides (`policies.disagg`): split, or run the whole request on a decode replica, with why
   (short-prompt, prefill-saturated, no-prefill-replica). Counted (`kvgate_disagg_requests_total`) and told to the
   client in the `x-kvgate-disagg` header: `split; prefill=<replica>` or `aggregated; reason=<why>`.
2. Split: the prefill body is the request with `max_tokens` 1 (and `max_completion_tokens`), no stream, without
   `stream_options` / `min_tokens`, and vLLM's `kv_transfer_params` asking for a remote decode (NixlConnector's
   protocol; ExampleConnector and LMCache find the KV by the prompt and ignore it). It goes to the prefill replica
   the routing policy picks among the prefill replicas (cache-aware: prefix reuse matters most there), through the
   proxy's `send` (same timeouts, connections and breaker accounting as any attempt). A connect error, timeout or
   5xx is retried on another prefill replica (at most `retry.max_attempts` in all); a 4xx is the request's own
   error and is the client's answer. With no prefill replica left the request runs whole (reason prefill-failed).
3. The prefill answer's `kv_transfer_params` (NixlConnector: the remote engine, block ids, host, port) are added to
   the body the decode replica gets; the proxy then routes, retries and relays it as any request.
Cost: for a split request, two JSON round trips of the body and one extra engine round trip; nothing for a model
without prefill replicas (one `any` over its replicas).
"""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

import orjson

from engine_pool.http_client import UpstreamResponse
from engine_pool.replica import Replica
from gateway.answers import upstream_error
from gateway.config import DisaggregationConfig, RetryConfig
from gateway.context import RequestContext
from gateway.errors import GatewayError, Retryable, UpstreamTimeout, UpstreamUnavailable
from gateway.metrics import GatewayMetrics
from gateway.request_parse import ParsedRequest
from gateway.router import Router
from policies.base import RequestInfo

# vLLM's request for a prefill whose decode runs elsewhere (vllm/distributed/kv_transfer NixlConnector)
_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class Sender(Protocol):
    """What the prefill step uses of the proxy (`gateway.proxy.UpstreamProxy`)."""

    async def send(
        self,
        replica: Replica,
        method: str,
        path: str,
        data: bytes,
        ctx: RequestContext,
        deadline: float,
        stream: bool,
        content_type: str = ...,
    ) -> UpstreamResponse: ...

    def count_failure(self, replica: Replica) -> None: ...


def prefill_body(data: bytes) -> bytes:
    body: dict[str, Any] = json.loads(data)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        body.pop(key, None)
    body["kv_transfer_params"] = dict(_REMOTE_DECODE)
    return json.dumps(body, separators=(",", ":")).encode()


def decode_body(data: bytes, kv_transfer_params: dict[str, Any]) -> bytes:
    if not kv_transfer_params:
        return data
    body: dict[str, Any] = json.loads(data)
    body["kv_transfer_params"] = kv_transfer_params
    return json.dumps(body, separators=(",", ":")).encode()


class PrefillStep:
    def __init__(
        self, sender: Sender, router: Router, metrics: GatewayMetrics, config: DisaggregationConfig, retry: RetryConfig
    ) -> None:
        self.sender = sender
        self.router = router
        self.metrics = metrics
        self.config = config
        self.retry = retry

    async def run(
        self, path: str, parsed: ParsedRequest, info: RequestInfo, ctx: RequestContext, data: bytes, deadline: float
    ) -> bytes:
        """The body the decode replica gets: `data`, or after a prefill step `data` with its transfer params."""
        if parsed.endpoint not in ("chat", "completions") or not self.router.replicas.disaggregated(parsed.model):
            return data
        decision = self.router.split(info, info.prompt_tokens or len(data) // 4, self.config.min_prefill_tokens)
        mode = decision.reason
        if decision.split:
            started = time.monotonic()
            found = await self._prefill(path, info, ctx, prefill_body(data), deadline)
            if found is not None:
                replica, params = found
                ctx.prefill_done_at = time.monotonic()
                self.metrics.prefill_step.labels(parsed.model).observe(ctx.prefill_done_at - started)
                self.metrics.disagg.labels(parsed.model, "split").inc()
                ctx.extra_headers["x-kvgate-disagg"] = f"split; prefill={replica.id}"
                ctx.split = True
                return decode_body(data, params)
            mode = "prefill-failed"
        self.metrics.disagg.labels(parsed.model, f"aggregated:{mode}").inc()
        ctx.extra_headers["x-kvgate-disagg"] = f"aggregated; reason={mode}"
        return data

    async def _prefill(
        self, path: str, info: RequestInfo, ctx: RequestContext, body: bytes, deadline: float
    ) -> tuple[Replica, dict[str, Any]] | None:
        """Run the prefill step on a prefill replica; (the replica, its answer's kv_transfer_params), or None when
        every prefill replica tried failed (or none could take it)."""
        tried: list[str] = []
        for _ in range(self.retry.max_attempts):
            try:
                replica, _decision = await self.router.choose(info, tried, prefill=True)
            except GatewayError:
                return None
            tried.append(replica.id)
            try:
                answer = await self._attempt(replica, path, body, ctx, deadline)
            except Retryable as exc:
                self.metrics.upstream_errors.labels(replica.id, f"prefill_{exc.kind}").inc()
                self.sender.count_failure(replica)
                continue
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            return replica, params if isinstance(params, dict) else {}
        return None

    async def _attempt(self, replica: Replica, path: str, body: bytes, ctx: RequestContext, deadline: float) -> Any:
        step_deadline = min(deadline, time.monotonic() + self.config.prefill_timeout_s)
        started = replica.begin()
        try:
            try:
                upstream = await self.sender.send(replica, "POST", path, body, ctx, step_deadline, False)
            except UpstreamTimeout as exc:
                raise Retryable("timeout", exc) from None
            try:
                if upstream.status >= 500:
                    raise Retryable(f"http_{upstream.status}", await upstream_error(upstream))
                if upstream.status >= 400:
                    replica.record_success()  # the engine works; the request was bad: the client's answer
                    raise await upstream_error(upstream)
                try:
                    raw = await upstream.read()
                except (ConnectionError, TimeoutError) as exc:
                    raise Retryable("reset", UpstreamUnavailable(f"prefill on {replica.id} failed: {exc}")) from None
            except BaseException:
                upstream.close()
                raise
            finally:
                upstream.release()
        finally:
            replica.end(started)
        replica.record_success()
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
