"""One access-log line per request, plain (key=value) or JSON, on the `kvgate.access` logger."""

from __future__ import annotations

import logging

import orjson

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
        "migrations": ctx.migrations,
        "prompt_tokens": ctx.prompt_tokens,
        "cached_tokens": ctx.cached_tokens,
        "completion_tokens": ctx.completion_shown(),
        "ttft_ms": _ms(ctx.ttft_s) if ctx.computed else None,
        "predicted_ttft_ms": _ms(ctx.prediction.ttft_s) if ctx.prediction is not None else None,
        "queue_ms": _ms(ctx.queue_wait_s),
        "duration_ms": _ms(ctx.duration_s),
        "error": ctx.error,
        "client_disconnected": ctx.client_disconnected,
    }


def plain_line(ctx: RequestContext) -> str:
    """`access_record` as `key=value` pairs ('-' for none), built in one f-string (this runs for every request)."""
    ttft, duration, prediction = ctx.ttft_s if ctx.computed else None, ctx.duration_s, ctx.prediction
    prompt, cached, completion, error = ctx.prompt_tokens, ctx.cached_tokens, ctx.completion_shown(), ctx.error
    return (
        f"request_id={ctx.request_id} tenant={ctx.tenant} endpoint={ctx.endpoint} model={ctx.model} "
        f"replica={ctx.replica} route_reason={ctx.route_reason} status={ctx.status} stream={ctx.stream} "
        f"attempts={ctx.attempts} migrations={ctx.migrations} prompt_tokens={'-' if prompt is None else prompt} "
        f"cached_tokens={'-' if cached is None else cached} "
        f"completion_tokens={'-' if completion is None else completion} "
        f"ttft_ms={'-' if ttft is None else round(ttft * 1000, 2)} "
        f"predicted_ttft_ms={'-' if prediction is None else round(prediction.ttft_s * 1000, 2)} "
        f"queue_ms={round(ctx.queue_wait_s * 1000, 2)} "
        f"duration_ms={'-' if duration is None else round(duration * 1000, 2)} "
        f"error={'-' if error is None else error} client_disconnected={ctx.client_disconnected}"
    )


def log_access(ctx: RequestContext, fmt: str) -> None:
    if fmt == "off" or not log.isEnabledFor(logging.INFO):
        return
    if fmt == "json":
        log.info(orjson.dumps(access_record(ctx)).decode())
    else:
        log.info(plain_line(ctx))
