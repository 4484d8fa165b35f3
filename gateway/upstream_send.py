"""One engine round trip of the proxy (gateway.proxy): the request's headers, the send, a whole answer's read, and the
headers of the client's response.

`send`: the body goes to the replica on a kept-alive connection of the one HTTP client (engine_pool.http_client),
with the request's forwarded headers, its `x-request-id` and its trace context; then the response headers are
waited for: a stream's come with its first event (waited for `first_byte_s`, then `Retryable`: the proxy tries
another replica), a whole answer's only when the generation is done (waited for until the total deadline; a timeout
then is not retried). A kept-alive connection that turns out stale is replaced once; connect failures are
`Retryable`, and so is an answer that breaks HTTP (without that second try: a fresh connection would get the same);
a cancelled wait (the client left) aborts the engine request. `read_answer`: a whole answer's body,
within the deadline and `server.max_answer_bytes`; `content_type` and `framed_as_json` what it says it is and whether
it looks so. `response_headers`: the engine's headers the client gets, less
the hop-by-hop ones and those the gateway writes itself (`_NOT_RELAYED`, `x-kvgate-*`), plus the request id, what
admission adds and the route headers. Cost: one engine round trip per `send`; O(headers) for the header sets.
"""

from __future__ import annotations

import time

from engine_pool.http_client import (
    ResponseTooLarge,
    UpstreamClient,
    UpstreamConnectionError,
    UpstreamProtocolError,
    UpstreamResponse,
)
from engine_pool.replica import Replica, rank_headers
from gateway.config import TimeoutConfig
from gateway.errors import Retryable, UpstreamError, UpstreamTimeout, UpstreamUnavailable
from gateway.exchange import Exchange
from policies.base import Decision

# engine response headers the client does not get: hop by hop (RFC 9110 7.6.1), framing, and what the gateway's own
# server writes (lower case, as compared)
_NOT_RELAYED = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"te", b"trailer", b"upgrade",
        b"proxy-authenticate", b"proxy-authorization", b"content-length", b"content-type",
        b"date", b"server", b"x-request-id", b"request-id",
    }
)  # fmt: skip


def response_headers(
    ex: Exchange, replica: Replica, decision: Decision, upstream: UpstreamResponse, *, route_headers: bool
) -> dict[str, str]:
    """The client's response headers: the engine's own (rate limits, timings, tracing, custom ones), less the
    hop-by-hop ones and those the gateway writes itself, which replace the engine's: framing and type,
    `x-request-id` (and Anthropic's `request-id`), the route headers and what admission adds (`x-ratelimit-*`)."""
    headers = {
        name.decode("latin-1"): value.decode("latin-1")
        for name, value in upstream.headers
        if name.lower() not in _NOT_RELAYED and not name.lower().startswith(b"x-kvgate-")
    }
    headers["x-request-id"] = ex.ctx.request_id
    if ex.parsed.api == "anthropic":
        headers["request-id"] = ex.ctx.request_id  # the Anthropic SDK's `_request_id`
    headers.update(ex.ctx.extra_headers)
    if route_headers:
        headers["x-kvgate-replica"] = replica.id
        headers["x-kvgate-route-reason"] = decision.reason
    return headers


def content_type(upstream: UpstreamResponse) -> str | None:
    """The engine's Content-Type (a binary embedding's `application/octet-stream`, a transcription's text); None
    when it names none."""
    for name, value in upstream.headers:
        if name.lower() == b"content-type":
            return value.decode("latin-1")
    return None


def framed_as_json(raw: bytes) -> bool:
    """An answer that says it is JSON looks like one: an object or array, closed (O(1): the first and last non-blank
    bytes, no copy; what an HTML page, SSE text or a body cut short is not). The client parses it, not the gateway."""
    start, end = 0, len(raw)
    while start < end and raw[start] in _BLANK:
        start += 1
    while end > start and raw[end - 1] in _BLANK:
        end -= 1
    return end - start >= 2 and (raw[start], raw[end - 1]) in _JSON_ENDS


_BLANK = b" \t\r\n"  # JSON's whitespace
_JSON_ENDS = ((ord("{"), ord("}")), (ord("["), ord("]")))


def _ask_headers(ex: Exchange) -> dict[str, str]:
    ctx = ex.ctx
    headers = {**ex.forward, "Content-Type": ex.parsed.content_type, "x-request-id": ctx.request_id}
    if ctx.trace is not None:  # the engine's spans join the request's trace under kvgate.upstream
        headers["traceparent"] = ctx.trace.upstream_traceparent()
        ctx.sent_at = time.monotonic()
    elif ctx.client_traceparent is not None:
        headers["traceparent"] = ctx.client_traceparent
    if ctx.client_tracestate is not None and "traceparent" in headers:
        headers["tracestate"] = ctx.client_tracestate
    return headers


async def send(client: UpstreamClient, timeouts: TimeoutConfig, replica: Replica, ex: Exchange) -> UpstreamResponse:
    """Send and wait for the response headers; a kept-alive connection that turns out stale is replaced once.
    A stream's headers come with its first event: waited for `first_byte_s`, then retried elsewhere. A whole
    answer's headers come only when the generation is done: waited for until the total deadline, and a timeout
    then is not retried (the engine took the request; running it again elsewhere would only repeat the work)."""
    pool = client.pool(replica.host, replica.port, replica.use_tls)
    headers = rank_headers(replica, _ask_headers(ex))
    url = replica.base_path + ex.path
    for fresh_retry in (False, True):
        upstream: UpstreamResponse | None = None
        left = ex.deadline - time.monotonic()
        budget = min(timeouts.first_byte_s, left) if ex.stream else left
        try:
            started = time.monotonic()  # on an idle kept-alive connection (the common case) nothing waits
            upstream = await pool.request(
                ex.method, url, ex.data, headers, connect_timeout_s=min(timeouts.connect_s, budget)
            )
            # one timer on the response (the client's DeadlineWatch), not a task timeout around the wait
            upstream.set_timeout(budget - (time.monotonic() - started))
            await upstream.headers_ready
            return upstream
        except TimeoutError:
            if upstream is not None:
                upstream.close()
            if not ex.stream:
                raise UpstreamTimeout(f"replica {replica.id} did not finish within timeouts.total_s") from None
            if ex.deadline - time.monotonic() <= 0.01:  # the request's own deadline: no time left to try another
                raise UpstreamTimeout("no answer within timeouts.total_s", code="total_timeout") from None
            raise Retryable("timeout", UpstreamTimeout(f"replica {replica.id} did not answer in time")) from None
        except UpstreamProtocolError as exc:  # it answered, but not in HTTP: no fresh connection would do better
            if upstream is not None:
                upstream.close()
            raise Retryable("protocol", UpstreamUnavailable(f"replica {replica.id} broke HTTP: {exc}")) from None
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


async def read_answer(upstream: UpstreamResponse, replica: Replica, deadline: float, limit: int) -> bytes:
    """A whole answer's body of at most `limit` bytes, within the deadline; a connection lost on the way is
    `Retryable`, a larger answer an `UpstreamError` (another replica would answer the same)."""
    if not upstream.complete:  # usually the whole body came with the headers
        upstream.set_timeout(deadline - time.monotonic())
    try:
        raw = await upstream.read(limit)
    except ResponseTooLarge:
        raise UpstreamError(
            f"replica {replica.id}'s answer is larger than server.max_answer_bytes ({limit} bytes)"
        ) from None
    except TimeoutError:  # the total deadline: nothing left to retry with
        raise UpstreamTimeout(f"replica {replica.id} did not finish within timeouts.total_s") from None
    except ConnectionError as exc:
        raise Retryable("reset", UpstreamUnavailable(f"replica {replica.id} failed mid-response: {exc}")) from None
    replica.record_success()
    return raw
