"""Disaggregated serving: the prefill step a request of a split model takes before the proxy sends it to decode.

Per chat or completions request of a model some of whose replicas have role `prefill`:
1. `Router.split` decides (`policies.disagg`): split, or run the whole request on a decode replica, with why
   (short-prompt, prefill-saturated, no-prefill-replica). Counted (`kvgate_disagg_requests_total`) and told to the
   client in the `x-kvgate-disagg` header: `split; prefill=<replica>` or `aggregated; reason=<why>`.
2. Split: the prefill body is the request with `max_tokens` 1 (and `max_completion_tokens`), no stream, without
   `stream_options` / `min_tokens`, and vLLM's `kv_transfer_params` asking for a remote decode (NixlConnector's
   protocol; ExampleConnector and LMCache find the KV by the prompt and ignore it). It goes to the prefill replica
   the routing policy picks among the prefill replicas (cache-aware: prefix reuse matters most there), through the
   proxy's attempts (their `gateway.upstream_send.send`: same timeouts, connections and breaker accounting as any
   attempt). A connect error, timeout or 5xx is retried on another prefill replica (at most `retry.max_attempts` in
   all); a 4xx is the request's own error and is the client's answer. With no prefill replica left the request runs
   whole (reason prefill-failed).
3. The prefill answer's `kv_transfer_params` (NixlConnector: the remote engine, block ids, host, port) are added to
   the body the decode replica gets; the proxy then routes, retries and relays it as any request.
Cost: for a split request, two JSON round trips of the body and one extra engine round trip; nothing for a model
without prefill replicas (one `any` over its replicas).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from engine_pool.replica import Replica
from gateway.engines_config import DisaggregationConfig
from gateway.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.request_parse import ParsedRequest, encode, engine_fields
from gateway.router import Router

# the proxy's attempts at a prefill step: (the replica that ran it, its transfer params), or None when none could
Prefill = Callable[[Exchange], Awaitable[tuple[Replica, dict[str, Any]] | None]]

# vLLM's request for a prefill whose decode runs elsewhere (vllm/distributed/kv_transfer NixlConnector)
_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(parsed: ParsedRequest) -> bytes:
    body = engine_fields(parsed)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        body.pop(key, None)
    body["kv_transfer_params"] = dict(_REMOTE_DECODE)
    return encode(body, parsed)


def decode_body(ex: Exchange, kv_transfer_params: dict[str, Any]) -> bytes:
    if not kv_transfer_params:
        return ex.data
    body = engine_fields(ex.parsed, usage_stats=ex.relayed is not None)
    body["kv_transfer_params"] = kv_transfer_params
    return encode(body, ex.parsed)


def transfer_params(raw: bytes) -> dict[str, Any]:
    """The `kv_transfer_params` of a prefill step's answer ({} when it has none)."""
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    return params if isinstance(params, dict) else {}


class PrefillStep:
    def __init__(self, prefill: Prefill, router: Router, metrics: GatewayMetrics, config: DisaggregationConfig) -> None:
        self.prefill = prefill
        self.router = router
        self.metrics = metrics
        self.config = config

    async def run(self, ex: Exchange) -> None:
        """Give a split model's request (the caller asks `disaggregated`) its prefill step: `ex.data` then carries
        the prefill's transfer params."""
        parsed, ctx = ex.parsed, ex.ctx
        if parsed.kind not in ("chat", "completions"):
            return
        prompt_tokens = ex.info.prompt_tokens or len(ex.data) // 4
        decision = self.router.split(ex.info, prompt_tokens, self.config.min_prefill_tokens)
        mode = decision.reason
        if decision.split:
            started = time.monotonic()
            found = await self.prefill(self._step(ex, min(ex.deadline, started + self.config.prefill_timeout_s)))
            if found is not None:
                replica, params = found
                ctx.prefill_done_at = time.monotonic()
                self.metrics.prefill_step.labels(parsed.model).observe(ctx.prefill_done_at - started)
                self.metrics.disagg.labels(parsed.model, "split").inc()
                ctx.extra_headers["x-kvgate-disagg"] = f"split; prefill={replica.id}"
                ctx.split = True
                ex.data = decode_body(ex, params)
                return
            mode = "prefill-failed"
        self.metrics.disagg.labels(parsed.model, f"aggregated:{mode}").inc()
        ctx.extra_headers["x-kvgate-disagg"] = f"aggregated; reason={mode}"

    @staticmethod
    def _step(ex: Exchange, deadline: float) -> Exchange:
        """The prefill step's own exchange: its body, whole (not streamed), its own replicas tried."""
        parsed = dataclasses.replace(ex.parsed, stream=False)
        data = prefill_body(ex.parsed)
        return dataclasses.replace(ex, parsed=parsed, data=data, deadline=deadline, tried=[], refused=[], relayed=None)
