"""One access-log line per request, plain (logfmt: key=value, a value with a space, a quote, `=` or a backslash
quoted) or JSON (one object a line, with its own `time`), on the `kvgate.access` logger, which logs at INFO
whatever `--log-level` says (`server.access_log: off` is its switch). A request refused before any handler took it
(its head, an Expect, a repeated x-request-id, a loop, the admin key) gets its line and its count too (`refused`).
Cost: one f-string (plain) or one orjson dump (JSON) per request."""

from __future__ import annotations

import logging
import re
import time
from datetime import UTC, datetime

import orjson

from gateway.context import RequestContext
from kvcommon.fastmetrics import FastCounter

log = logging.getLogger("kvgate.access")
_BARE = re.compile(r'[^\s"=\\]+')  # a value written as it is; any other is quoted


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


def _v(value: str) -> str:
    """A client's string (a request id, a model name) as a logfmt value: quoted where it could read as more keys."""
    return value if _BARE.fullmatch(value) else orjson.dumps(value).decode()


def plain_line(ctx: RequestContext) -> str:
    """`access_record` as `key=value` pairs ('-' for none), built in one f-string (this runs for every request)."""
    ttft, duration, prediction = ctx.ttft_s if ctx.computed else None, ctx.duration_s, ctx.prediction
    prompt, cached, completion, error = ctx.prompt_tokens, ctx.cached_tokens, ctx.completion_shown(), ctx.error
    return (
        f"request_id={_v(ctx.request_id)} tenant={_v(ctx.tenant)} endpoint={ctx.endpoint} model={_v(ctx.model)} "
        f"replica={ctx.replica} route_reason={ctx.route_reason} status={ctx.status} stream={ctx.stream} "
        f"attempts={ctx.attempts} migrations={ctx.migrations} prompt_tokens={'-' if prompt is None else prompt} "
        f"cached_tokens={'-' if cached is None else cached} "
        f"completion_tokens={'-' if completion is None else completion} "
        f"ttft_ms={'-' if ttft is None else round(ttft * 1000, 2)} "
        f"predicted_ttft_ms={'-' if prediction is None else round(prediction.ttft_s * 1000, 2)} "
        f"queue_ms={round(ctx.queue_wait_s * 1000, 2)} "
        f"duration_ms={'-' if duration is None else round(duration * 1000, 2)} "
        f"error={'-' if error is None else _v(error)} client_disconnected={ctx.client_disconnected}"
    )


def log_access(ctx: RequestContext, fmt: str) -> None:
    if fmt == "off" or not log.isEnabledFor(logging.INFO):
        return
    if fmt == "json":  # the line is the object alone (`serve`'s formatter adds no prefix to it)
        stamp = datetime.now(UTC).isoformat(timespec="milliseconds")
        log.info(orjson.dumps({"time": stamp, **access_record(ctx)}).decode(), extra=_RAW)
    else:
        log.info(plain_line(ctx))


_RAW = {"raw": True}  # a record written as its message alone


def refused(
    fmt: str, requests: FastCounter, request_id: str, endpoint: str, status: int, error: str | None, started: float
) -> None:
    """A request refused before any handler took it: counted in kvgate_requests_total (model and replica '-', the
    route's endpoint or `unrouted`) and logged, as every request is."""
    requests.labels("-", "-", endpoint, str(status)).inc()
    ctx = RequestContext(request_id, endpoint, started=started, status=status, error=error)
    ctx.duration_s = time.monotonic() - started
    log_access(ctx, fmt)
