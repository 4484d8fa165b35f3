"""One exception hierarchy for everything the gateway answers with an error, rendered in one place.

Every error carries its HTTP status and OpenAI error `type` / `code`; `render_error` renders it in the API shape of
the route it answers (`gateway.endpoints`: a route's `api`) as (status, headers, bytes): OpenAI's
`{"error": {"message", "type", "param", "code"}}`, or Anthropic's `{"type": "error", "error": {"type", "message"}}`
with the type its SDKs map the status to (no capacity is 529 `overloaded_error` there, the status Anthropic's SDK
raises `OverloadedError` for); `error_event` is the same error as a stream's last event. `error_response` makes it
the aiohttp response that handlers, the middleware and the server's protocol errors (`gateway.listener`) send.
Subclasses also inherit the matching builtin where one exists (a timeout is also a `TimeoutError`) so callers can
catch either.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

import orjson
from aiohttp import web

ApiShape = Literal["openai", "anthropic"]  # how a route's answers and errors are shaped (gateway.endpoints)


# The longest error message: longer ones (a client's megabyte model name quoted back) are cut, with "...".
MAX_MESSAGE = 1024


class GatewayError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if len(message) > MAX_MESSAGE:
            message = message[: MAX_MESSAGE - 3] + "..."
        super().__init__(message)
        self.message = message
        self.param = param if param is None or len(param) <= MAX_MESSAGE else param[: MAX_MESSAGE - 3] + "..."
        if code is not None:
            self.code = code
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedEncoding(GatewayError):
    """A request body in a Content-Encoding the gateway does not decode (RFC 9110 15.5.16)."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_content_encoding"


class UnsupportedTransferCoding(GatewayError):
    """A transfer coding other than chunked (RFC 9112 6.1)."""

    status = 501
    type = "invalid_request_error"
    code = "unsupported_transfer_encoding"


class HttpVersionNotSupported(GatewayError):
    status = 505
    type = "invalid_request_error"
    code = "http_version_not_supported"


class RequestTimeout(GatewayError, TimeoutError):
    """The client did not send its request head or body in time."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class HeadersTooLarge(GatewayError):
    status = 431
    type = "invalid_request_error"
    code = "request_header_too_large"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"


MAX_RETRY_AFTER_S = 60


class Overloaded(GatewayError):
    """No capacity now (no ready replica, queue full, queue wait exceeded): 503 with Retry-After."""

    status = 503
    type = "overloaded_error"
    code = "overloaded"

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float = 1.0,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        # up: a client that waits it finds room; at most MAX_RETRY_AFTER_S (a prediction behind a long-overdue
        # request grows without bound, and a minute's wait is already a long one for an interactive client)
        merged = {"Retry-After": str(min(MAX_RETRY_AFTER_S, max(1, math.ceil(retry_after_s))))}
        merged.update(headers or {})
        super().__init__(message, code=code, headers=merged)
        self.retry_after_s = retry_after_s


class UpstreamTimeout(GatewayError, TimeoutError):
    status = 504
    type = "timeout_error"
    code = "upstream_timeout"


class UpstreamError(GatewayError):
    """An engine answered with an error; relayed with its own status and body when it is OpenAI-shaped."""

    type = "upstream_error"
    code = "upstream_error"

    def __init__(self, message: str, *, status: int = 502, upstream_body: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.upstream_body = upstream_body

    def body(self) -> dict[str, object]:
        if self.upstream_body is not None:
            return self.upstream_body
        return super().body()


class AdapterLoadFailed(GatewayError):
    """An engine refused to load the LoRA adapter a request names (models.dynamic_lora): its reason, as 502."""

    status = 502
    type = "upstream_error"
    code = "adapter_load_failed"


class UpstreamUnavailable(GatewayError, ConnectionError):
    """Could not reach any replica (connect refused, reset before the first byte) within the retry budget."""

    status = 502
    type = "upstream_error"
    code = "upstream_unavailable"


class LoopDetected(GatewayError):
    """The request came back to the gateway that sent it (its `x-kvgate-via` names this gateway): an engine address
    that leads back here (508; a gateway before it in the loop tries its other replicas, as after any 5xx)."""

    status = 508
    type = "upstream_error"
    code = "loop_detected"


class Retryable(Exception):
    """An attempt on one replica failed before anything reached the client (connect, reset, timeout, 5xx): the
    proxy tries another replica, and answers `error` when none is left. `kind` labels the failure in metrics."""

    def __init__(self, kind: str, error: GatewayError) -> None:
        super().__init__(kind)
        self.kind = kind
        self.error = error


class Exhausted(Exception):
    """Every attempt on every replica allowed failed, or no replica was left to try: `error` is the answer."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.code)
        self.error = error


class Migration(Exception):
    """A stream's engine failed after the client got its first events, and the answer can continue elsewhere."""

    def __init__(self, failure: GatewayError) -> None:
        super().__init__(failure.code)
        self.failure = failure


# Anthropic's error types by status, as its SDKs name them (anthropic-sdk-python: _exceptions.py, ErrorType)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    408: "timeout_error", 409: "conflict_error", 413: "request_too_large", 429: "rate_limit_error",
    503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error",
}  # fmt: skip
ANTHROPIC_ERROR_TYPES = frozenset({*_ANTHROPIC_TYPES.values(), "api_error", "billing_error"})
OVERLOADED_ANTHROPIC = 529  # Anthropic's status for no capacity (its SDK: OverloadedError; 503 is not that class)


def anthropic_error(err: GatewayError) -> tuple[int, dict[str, object]]:
    """(status, body) of `err` in Anthropic's shape: an engine's own Anthropic-shaped error as it came, any other
    typed by its status; the gateway's own no-capacity answer is 529."""
    upstream = err.upstream_body if isinstance(err, UpstreamError) else None
    if upstream is not None and upstream.get("type") == "error":
        inner = upstream.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("type"), str) and inner["type"] in ANTHROPIC_ERROR_TYPES:
            return err.status, upstream
    status = OVERLOADED_ANTHROPIC if isinstance(err, Overloaded) else err.status
    kind = _ANTHROPIC_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": err.message}}


def render_error(
    err: GatewayError, *, request_id: str | None = None, api: ApiShape = "openai"
) -> tuple[int, dict[str, str], bytes]:
    """The one rendering of an error: status, headers (the error's own, Content-Type, x-request-id; Anthropic's
    `request-id` too, which its SDK reports as the error's request id) and body, in the route's API shape."""
    headers = dict(err.headers)
    headers["Content-Type"] = "application/json"
    if request_id:
        headers["x-request-id"] = request_id
    if api == "anthropic":
        if request_id:
            headers["request-id"] = request_id
        status, body = anthropic_error(err)
        return status, headers, orjson.dumps(body)
    return err.status, headers, orjson.dumps(err.body())


def error_event(
    err: GatewayError, api: ApiShape = "openai", *, responses_after: int | None = None, done: bool = False
) -> bytes:
    """`err` as the last event of a stream that already started (its status line is long sent); a Responses
    stream's (`responses_after`: the sequence number of the last event it had) as its typed `error` event; `done`:
    a chat or completions stream's, followed by `data: [DONE]` as vLLM ends such a stream after its error."""
    if api == "anthropic":
        return b"event: error\ndata: " + orjson.dumps(anthropic_error(err)[1]) + b"\n\n"
    if responses_after is not None:
        event = {"type": "error", "code": err.code, "message": err.message, "param": err.param}
        return b"event: error\ndata: " + orjson.dumps({**event, "sequence_number": responses_after + 1}) + b"\n\n"
    return b"data: " + orjson.dumps(err.body()) + (b"\n\ndata: [DONE]\n\n" if done else b"\n\n")


def error_response(err: GatewayError, *, request_id: str | None = None, api: ApiShape = "openai") -> web.Response:
    status, headers, body = render_error(err, request_id=request_id, api=api)
    return web.Response(status=status, body=body, headers=headers)


def http_exception_to_error(exc: web.HTTPException) -> GatewayError:
    """aiohttp's own HTTP errors (unknown route, wrong method, body too large) in OpenAI's shape."""
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return PayloadTooLarge("request body exceeds the configured limit")
    reason = exc.reason or "error"
    err = GatewayError(reason, code=reason.lower().replace(" ", "_"))
    err.status = exc.status
    err.type = "invalid_request_error" if exc.status < 500 else "internal_error"
    if allow := exc.headers.get("Allow"):  # a 405 names the methods the route takes
        err.headers["Allow"] = allow
    return err
