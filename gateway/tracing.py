"""Tracing along the request path: a W3C `traceparent` in, OpenTelemetry spans out through OTLP/HTTP.

Optional (`pip install "kvgate[tracing]"`, the OpenTelemetry SDK and its OTLP/HTTP exporter) and off unless
`tracing.otlp_endpoint` is set: then nothing is imported, a request carries no trace (`RequestContext.trace` is
None; the path checks that one field) and a valid client `traceparent` is passed on to the engine unchanged (on,
an unsampled one too: a request not traced here keeps the client's context; the client's `tracestate` goes with
either).

When on, a request is timed on its `RequestContext` as it goes (monotonic clock: admitted, routed, sent, first byte,
end) and `Tracer.finish` builds its spans when it ends, with explicit ids and times (the SDK's `ReadableSpan`),
handing them to a `BatchSpanProcessor` whose thread exports them: no span object lives during the request and no
exporter work runs on the event loop. The tree, one trace per request (the client's when it sent a sampled
`traceparent`, else a new one sampled at `sample_ratio`):

    kvgate.request     SERVER: endpoint, model, tenant, status, replica, tokens
      kvgate.admission   authentication, quota and the fair queue's wait; a refused request's ends at its refusal,
                         `kvgate.refused` its error code
      kvgate.route       the decision: replica, reason, predicted cached tokens
      kvgate.upstream    CLIENT: sent until the first byte; the engine gets `traceparent` naming this span, so
                         vLLM's own spans (`--otlp-traces-endpoint`) join the trace under it
      kvgate.relay       first byte until the end (the stream relayed)
Cost when on: 3 random ids per request and 5 small objects when it ends.
"""

from __future__ import annotations

import random
import re
import time
from typing import Any

from gateway.config import TracingConfig
from gateway.context import RequestContext, TraceIds

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def valid_traceparent(value: str) -> bool:
    """A W3C traceparent of version 00 with non-zero ids (what may be passed on to an engine)."""
    match = _TRACEPARENT.match(value)
    return match is not None and int(match.group(1), 16) != 0 and int(match.group(2), 16) != 0


class Tracer:
    """Draws the ids of sampled requests and exports their spans."""

    def __init__(self, config: TracingConfig) -> None:
        # imported here: the SDK is an optional extra, loaded only when tracing is configured
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        except ImportError as exc:
            raise RuntimeError(
                f"tracing.otlp_endpoint is set but the OpenTelemetry SDK is missing ({exc}): "
                'pip install "kvgate[tracing]"'
            ) from None

        self.config = config
        self._rng = random.Random()
        self._resource = Resource.create({"service.name": config.service_name})
        self._scope = InstrumentationScope("kvgate")
        exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint, headers=config.headers, timeout=config.timeout_s)
        self._processor = BatchSpanProcessor(exporter, max_queue_size=config.max_queue, schedule_delay_millis=1000)
        self._wall_offset_ns = time.time_ns() - time.monotonic_ns()

    def begin(self, traceparent: str | None) -> TraceIds | None:
        """The ids of a new request's trace, or None when it is not sampled."""
        rng = self._rng
        parent = _TRACEPARENT.match(traceparent) if traceparent and valid_traceparent(traceparent) else None
        if parent is not None:
            if not int(parent.group(3), 16) & 1:
                return None  # the client's trace is not sampled
            trace_id, parent_span = int(parent.group(1), 16), int(parent.group(2), 16)
        elif rng.random() < self.config.sample_ratio:
            trace_id, parent_span = rng.getrandbits(128) or 1, None
        else:
            return None
        return TraceIds(trace_id, parent_span, rng.getrandbits(64) or 1, rng.getrandbits(64) or 1)

    def _ns(self, monotonic_s: float) -> int:
        return self._wall_offset_ns + int(monotonic_s * 1e9)

    def finish(self, ctx: RequestContext) -> None:
        """Export the ended request's spans."""
        ids = ctx.trace
        if ids is None:
            return
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        sampled = TraceFlags(TraceFlags.SAMPLED)

        def context(span_id: int) -> SpanContext:
            return SpanContext(ids.trace_id, span_id, is_remote=False, trace_flags=sampled)

        rng = self._rng
        end = ctx.started + (ctx.duration_s or 0.0)
        root = context(ids.request_span_id)
        request_attrs: dict[str, Any] = {
            "kvgate.request_id": ctx.request_id, "kvgate.endpoint": ctx.endpoint, "kvgate.model": ctx.model,
            "kvgate.tenant": ctx.tenant, "http.response.status_code": ctx.status, "kvgate.replica": ctx.replica,
            "kvgate.attempts": ctx.attempts, "kvgate.stream": ctx.stream,
        }  # fmt: skip
        for key, value in (("prompt_tokens", ctx.prompt_tokens), ("cached_tokens", ctx.cached_tokens),
                           ("completion_tokens", ctx.completion_shown())):  # fmt: skip
            if value is not None:
                request_attrs[f"kvgate.{key}"] = value
        spans = [
            ("kvgate.request", root, context(ids.parent_span_id) if ids.parent_span_id else None, SpanKind.SERVER,
             ctx.started, end, request_attrs),
        ]  # fmt: skip
        first_byte = ctx.started + ctx.ttft_s if ctx.ttft_s is not None else None
        admission_end = ctx.admitted_at if ctx.admitted_at is not None else ctx.refused_at
        if admission_end is not None:
            admission_attrs: dict[str, Any] = {"kvgate.queue_wait_ms": ctx.queue_wait_s * 1000}
            if ctx.admitted_at is None:
                admission_attrs["kvgate.refused"] = ctx.error or ""
            spans.append(("kvgate.admission", context(rng.getrandbits(64) or 1), root, SpanKind.INTERNAL,
                          ctx.started, admission_end, admission_attrs))  # fmt: skip
        if ctx.routed_at is not None and ctx.route_started is not None:
            route_attrs: dict[str, Any] = {"kvgate.replica": ctx.replica, "kvgate.route_reason": ctx.route_reason}
            if ctx.predicted_cached_tokens is not None:
                route_attrs["kvgate.predicted_cached_tokens"] = ctx.predicted_cached_tokens
            spans.append(("kvgate.route", context(rng.getrandbits(64) or 1), root, SpanKind.INTERNAL,
                          ctx.route_started, ctx.routed_at, route_attrs))  # fmt: skip
        if ctx.sent_at is not None:
            spans.append(("kvgate.upstream", context(ids.upstream_span_id), root, SpanKind.CLIENT, ctx.sent_at,
                          first_byte if first_byte is not None else end, {"kvgate.replica": ctx.replica}))  # fmt: skip
        if first_byte is not None:
            spans.append(("kvgate.relay", context(rng.getrandbits(64) or 1), root, SpanKind.INTERNAL, first_byte,
                          end, {}))  # fmt: skip
        failed = ctx.status >= 500 or ctx.status == 0
        for name, span_context, parent, kind, start, stop, attrs in spans:
            status = Status(StatusCode.ERROR, ctx.error or "") if failed and name == "kvgate.request" else Status()
            self._processor.on_end(
                ReadableSpan(
                    name, context=span_context, parent=parent, resource=self._resource, attributes=attrs,
                    kind=kind, status=status, start_time=self._ns(start), end_time=self._ns(max(start, stop)),
                    instrumentation_scope=self._scope,
                )
            )  # fmt: skip

    def close(self) -> None:
        """Flush what is queued (bounded by the exporter's timeout) and stop the export thread."""
        self._processor.shutdown()
