"""One access-log line per request, plain (key=value) or JSON, on the `kvgate.access` logger."""

from __future__ import annotations

import json
import logging

from gateway.context import RequestContext

log = logging.getLogger("kvgate.access")


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


def access_record(ctx: RequestContext) -> dict[str, object]:
    return {
        "request_id": ctx.request_id,
        "tenant": ctx.tenant,
        "endpoint": ctx.endpoint,
        "model": ctx.model,
        "replica": ctx.replica,
        "route_reason": ctx.route_reason,
        "status": ctx.status,
        "stream": ctx.stream,
        "attempts": ctx.attempts,
        "prompt_tokens": ctx.prompt_tokens,
        "cached_tokens": ctx.cached_tokens,
        "completion_tokens": ctx.completion_tokens,
        "ttft_ms": _ms(ctx.ttft_s),
        "queue_ms": _ms(ctx.queue_wait_s),
        "duration_ms": _ms(ctx.duration_s),
        "error": ctx.error,
        "client_disconnected": ctx.client_disconnected,
    }


def log_access(ctx: RequestContext, fmt: str) -> None:
    if fmt == "off" or not log.isEnabledFor(logging.INFO):
        return
    record = access_record(ctx)
    if fmt == "json":
        log.info(json.dumps(record, separators=(",", ":")))
    else:
        log.info(" ".join(f"{k}={'-' if v is None else v}" for k, v in record.items()))
