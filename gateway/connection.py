"""One client connection of the gateway's port (`gateway.listener`): aiohttp's own HTTP/1.1 protocol (llhttp
parser), `GuardedRequestHandler`, with the bounds an ingress needs:
- a head that does not complete within `server.head_timeout_s` of its first byte (of the connection's opening,
  for its first request) gets 408 and the connection closes (aiohttp alone only times out idle connections, after
  `keepalive_timeout_s`); also a head pipelined behind
  requests being answered (its 408 follows their answers); the body's own deadline is `server.body_timeout_s`,
  applied where a handler reads it (`gateway.body`);
- a head is bounded in all: more than `server.max_head_bytes` of it gets 431 at once (aiohttp bounds each line and
  the count of headers, and only checks the count when the head ends), also a whole head that arrived in one read
  (its request is dropped unserved); the count is exact for a head that starts a
  segment or follows a request without a body or with a Content-Length one, and starts with the next segment after a
  chunked one (`gateway.framing.after_request`);
- requests are parsed one at a time (aiohttp's parser, told to stop after each whole request, keeps the rest), so a
  malformed request replaces only itself: the requests pipelined before it are answered, in order, then its 400
  (aiohttp answers a parser error in place of every request parsed in the same call); nothing after a malformed
  request, or after one that closes the connection, is read;
- a chunked body whose first chunk-size line announces more than `server.max_body_bytes` fails at once with 413
  where the segment's bytes are known to be that body's (`gateway.framing`); a declared Content-Length over it is
  refused where the body is read (`gateway.body`), before any of it is waited for;
- what aiohttp's parser takes but the gateway will not serve (`gateway.framing.faulty`): an HTTP version other
  than 1.0 and 1.1 (505), a body in a Content-Encoding the gateway does not decode (only gzip and deflate are: 415),
  a transfer coding other than chunked (501), Transfer-Encoding in an HTTP/1.0 request (faulty framing, RFC 9112
  6.1: 400);
- protocol errors answer in their route's error shape (Anthropic's for the Messages routes, read from the request
  line; OpenAI's otherwise): malformed HTTP (smuggling shapes included: Content-Length with
  Transfer-Encoding, a duplicate Content-Length) 400 `invalid_http_request`, a header line over
  `max_header_bytes` or more than `max_headers` headers 431; the connection then closes;
Pipelining is bounded by aiohttp itself: at most 32 parsed requests wait per connection, then it stops reading
the socket until they are answered (in order). `Expect: 100-continue` is answered by aiohttp before the handler
reads the body (a body declared over `max_body_bytes` gets 413 instead: `gateway.body.expect_handler`).
Cost per connection: one timer while a head is incomplete; per segment a few integer checks, and one `bytes.rfind`
/ `bytes.find` where a request ended or a chunked head ended in it; per pipelined request one more call into the
parser.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any, Protocol

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError, LineTooLong
from aiohttp.http_parser import HttpRequestParser
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo
from aiohttp.web_request import BaseRequest

from gateway.config import GatewayConfig
from gateway.endpoints import API_BY_PATH
from gateway.errors import (
    ApiShape,
    BadRequest,
    GatewayError,
    HeadersTooLarge,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedEncoding,
    render_error,
)
from gateway.framing import CARRY, DECODED, ChunkLine, after_request, body_start, faulty

log = logging.getLogger("kvgate.server")


def raw_answer(err: GatewayError, api: ApiShape = "openai") -> bytes:
    """A whole HTTP/1.1 response for an error sent outside any request (no request object exists yet)."""
    status, headers, body = render_error(err, api=api)
    head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}", "Connection: close", f"Content-Length: {len(body)}"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


_REASONS = {408: "Request Timeout", 503: "Service Unavailable"}


_LINE_PEEK = 8192  # the most of a segment read for its request line's route (a longer line is refused anyway)
# A whole answer this small, written to a transport that is not paused, never waits for the client (below uvloop's
# and aiohttp's 64 KiB marks): it is written without a timer.
_NEVER_WAITS = 0x10000


def api_of_target(target: list[bytes]) -> ApiShape:
    """The API shape of the route a request line's target names (`[]`: none read): Anthropic's for the Messages
    routes, OpenAI's for the rest."""
    path = target[0].partition(b"?")[0].decode("latin-1") if target else ""
    return API_BY_PATH.get(path, "openai")


def protocol_error(status: int, exc: BaseException | None) -> GatewayError:
    """The error for a request aiohttp's parser refused (or a handler crash it caught, or one the
    listener refused itself: a GatewayError, answered as it is)."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, ContentEncodingError):  # br, zstd: no decoder installed
        return UnsupportedEncoding(f"the request body's Content-Encoding is not supported ({DECODED})")
    if status == 400:
        text = exc.message if isinstance(exc, HttpProcessingError) else str(exc or "")
        text = text if len(text) <= 200 else text[:200] + "..."  # never echo a huge header back
        if isinstance(exc, LineTooLong) or "too many headers" in text.lower():
            return HeadersTooLarge(f"request head too large: {text}")
        return BadRequest(f"malformed HTTP request: {text}", code="invalid_http_request")
    if isinstance(exc, UnicodeError):  # the client's bytes (a header aiohttp decoded with surrogates) did this
        return BadRequest("the request carries bytes that are not valid UTF-8", code="invalid_http_request")
    err = GatewayError("internal gateway error")
    err.status = status
    return err


class Port(Protocol):
    """What a connection shares with its port (`gateway.listener.GatewayListener`)."""

    config: GatewayConfig
    open_connections: int
    idle: OrderedDict[GuardedRequestHandler, None]  # kept alive between requests, the longest idle first

    def refused(self, err: GatewayError) -> None:
        """A request refused as its bytes arrived: logged and counted."""


class GuardedRequestHandler(RequestHandler):
    """aiohttp's protocol with a head deadline and bound, requests answered up to a malformed one, declared bodies
    over the limit refused at once, protocol errors in their route's shape and a connection count."""

    def __init__(self, listener: Port, server: web.Server, **kwargs: Any) -> None:
        super().__init__(server, **kwargs)
        self._listener = listener
        self._head_timer: asyncio.TimerHandle | None = None
        # aiohttp's parser, made to stop after each whole request (it keeps the rest): see `_parse`
        self._parser = HttpRequestParser(
            self, self._loop, self._read_bufsize, max_line_size=self.max_line_size, max_headers=self.max_headers,
            max_field_size=self.max_field_size, payload_exception=RequestPayloadError, max_msg_queue_size=1,
        )  # fmt: skip
        self._stopped_parsing = False  # after a protocol error (or a request that closes): nothing more is read
        self._head_bytes = 0  # bytes of the head being received (no body in progress), for `max_head_bytes`
        self._newest: StreamReader | None = None  # the body of the newest request parsed
        self._chunk_line: tuple[StreamReader, ChunkLine] | None = None  # a chunked body whose first line is awaited
        self._carry = b""  # the last bytes of the previous segment (`framing.body_start`)
        self._api: ApiShape = "openai"  # the shape of a refusal of the head being received: its route's

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # a connection that sends nothing is timed as a head that does not arrive: it would hold one of
        # `max_connections` until keepalive_timeout_s otherwise
        self._head_timer = self._loop.call_later(self._listener.config.server.head_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._listener.open_connections -= 1
        self._listener.idle.pop(self, None)
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._listener.idle.pop(self, None)
        if self._stopped_parsing:
            return
        if self._upgraded and self._payload_parser is not None:  # a WebSocket accepted (/v1/realtime): frames, not
            super().data_received(data)  # heads; aiohttp's reader bounds each message (realtime_max_message_bytes)
            return
        between = self._newest is None or self._newest.is_eof()  # no body of a parsed request still arriving
        if between and self._head_bytes == 0:  # a head begins with this segment: its route, from the request line
            self._api = api_of_target(data[:_LINE_PEEK].split(b"\r\n", 1)[0].split(b" ", 2)[1:2])
        parsed = self._request_count
        self._parse(data)
        new_requests = self._request_count - parsed
        limit = self._listener.config.server.max_head_bytes
        if new_requests and between and self._head_size(data) > limit:  # a head over the bound, whole in one read
            for _ in range(new_requests):  # not served: no handler has taken them yet
                self._messages.pop()
            self._request_count = parsed
            self._refuse(HeadersTooLarge(f"request head too large: more than {limit} bytes"))
            return
        if new_requests:
            self._newest = self._messages[-1][1] if self._messages else None
            self._head_bytes = self._next_head_bytes(data)
        elif between:
            self._head_bytes += len(data)
        if self._head_bytes > limit and not self._stopped_parsing:
            self._refuse(HeadersTooLarge(f"request head too large: more than {limit} bytes"))
        self._read_chunk_line(data, new_requests, between)
        self._carry = data[-CARRY:] if data else self._carry
        self._time_head(new_requests, bool(data))

    def _head_size(self, data: bytes) -> int:
        """The size of the head that ended in `data` (begun in it or in the segments before it), 0 if none did."""
        seen = self._carry + data
        end = seen.find(b"\r\n\r\n")
        return 0 if end < 0 else self._head_bytes + end + 4 - len(self._carry)

    def _next_head_bytes(self, data: bytes) -> int:
        """Bytes of the next head in the segment in which the newest request ended (`framing.after_request`);
        0 while its body is still arriving, or when its length is not known (chunked): then the count starts with
        the next segment."""
        message, body = self._messages[-1] if self._messages else (None, None)
        if message is None or body is None or isinstance(message, _ErrInfo) or message.chunked or not body.is_eof():
            return 0
        declared = message.headers.get("Content-Length", "0")
        return after_request(data, int(declared)) if declared.isdigit() else 0

    def _parse(self, data: bytes) -> None:
        """aiohttp's parsing, one request per step: its parser stops after each whole request, and the rest is
        parsed in further steps, so a parser error replaces only the request it is in (aiohttp answers a parser error
        with a 400 in place of every request parsed in the same call). Stops at aiohttp's queue bound (it resumes
        parsing as the queue drains), after an error and after a request that closes the connection."""
        super().data_received(data)
        count = -1
        while count != self._request_count and self._messages and self._payload_parser is None:
            count = self._request_count
            message, body = self._messages[-1]
            if not isinstance(message, _ErrInfo) and (err := faulty(message)) is not None:
                self._api = API_BY_PATH.get(message.path.partition("?")[0], "openai")
                self._messages.pop()  # not served: no handler has taken it yet
                self._request_count -= 1
                self._refuse(err)
                return
            if isinstance(message, _ErrInfo) or (message.should_close and body.is_eof()):
                self._stopped_parsing = True
                if isinstance(message, _ErrInfo):
                    self._fail_body(message)
                return
            if len(self._messages) >= self._max_msg_queue_size or self._close or self._force_close or self._upgraded:
                return
            super().data_received(b"")

    def _fail_body(self, error: _ErrInfo) -> None:
        """A parser error inside the body a handler is reading (a malformed chunk): that handler's read fails with
        it at once (400, not a body timeout), in place of a second answer, and the connection closes after it."""
        body = self._newest
        if body is None or body.is_eof():
            return
        self._messages.pop()
        self._request_count -= 1
        body.set_exception(BadRequest(f"malformed request body: {error.message}", code="invalid_http_request"))
        self.close()

    def _read_chunk_line(self, data: bytes, new_requests: int, between: bool) -> None:
        """Refuse at once a chunked body whose first chunk-size line announces more than `max_body_bytes`, where
        this segment's bytes are known to be that body's (`gateway.framing`)."""
        body = self._newest
        if new_requests:
            self._chunk_line = None
            message = self._messages[-1][0] if self._messages else None
            if new_requests > 1 or not between or body is None or body.is_eof() or self._reading_paused:
                return
            if message is None or isinstance(message, _ErrInfo) or not message.chunked:
                return
            start = body_start(self._carry, data)
            if start is None:
                return
            self._chunk_line, data = (body, ChunkLine()), data[start:]
        if self._chunk_line is None or self._chunk_line[0] is not body or body is None:
            self._chunk_line = None
            return
        over, size = self._chunk_line[1].feed(data)
        if over:
            self._chunk_line = None
        limit = self._listener.config.server.max_body_bytes
        if size is not None and size > limit:
            body.set_exception(PayloadTooLarge(f"the request body announces {size} bytes, over the limit ({limit})"))

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        """A body refused as too large (413) is not parsed further and the connection closes after the answer: what
        more of it arrives during aiohttp's lingering close (`lingering_time`, so that the client reads the answer
        before the close) is dropped as it comes; parsed, a compressed body's rest would be inflated only to be
        discarded (a 1 MB gzip body is a GiB: seconds of the event loop for each)."""
        if resp.status == 413 and not request.content.is_eof():
            self._stopped_parsing = True
            resp.force_close()
        body = resp.body if type(resp) is web.Response else None
        if isinstance(body, bytes) and len(body) <= _NEVER_WAITS and not self.writing_paused:
            finished = await super().finish_response(request, resp, start_time)  # (no timer: 4 us a request)
        else:
            finished = await self._finish_within(request, resp, start_time)
        if resp.keep_alive and not self._messages and not self._stopped_parsing and self.transport is not None:
            self._listener.idle[self] = None  # waits for a next request
        return finished

    async def _finish_within(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        """aiohttp's finish, but a client that takes none of its answer for send_timeout_s gives its place up
        (aiohttp waits for it forever)."""
        try:
            async with asyncio.timeout(self._listener.config.server.send_timeout_s):
                return await super().finish_response(request, resp, start_time)
        except TimeoutError:
            if self.transport is not None:  # abort, not close: a close waits for the unsent answer to leave
                self.transport.abort()
            self.force_close()
            return resp, True

    def reclaim(self) -> bool:
        """Close the connection if it is still idle between requests (True), for a new one at the bound."""
        if self._messages or self._force_close or self._close or self.transport is None or self._head_bytes:
            return False
        self.force_close()
        return True

    def _refuse(self, err: GatewayError) -> None:
        """Answer `err` after the requests already parsed, in order, then close; nothing more is read."""
        self._stopped_parsing = True
        self._messages.append((_ErrInfo(status=err.status, exc=err, message=err.message), EMPTY_PAYLOAD))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _time_head(self, new_requests: int, received: bool) -> None:
        """The head deadline: armed at a head's first byte (also one pipelined behind requests being answered),
        restarted when a whole head arrives and more follows, cancelled when none is pending."""
        if new_requests and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        pending = not self._stopped_parsing and (
            self._head_bytes > 0 or not (self._messages or self._request_in_progress)
        )
        if not pending:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
        elif self._head_timer is None and received and self.transport is not None:
            timeout = self._listener.config.server.head_timeout_s
            self._head_timer = self._loop.call_later(timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        """408: written at once when nothing else is being answered, else after the requests before it."""
        self._head_timer = None
        transport = self.transport
        if transport is None or transport.is_closing() or self._stopped_parsing:
            return
        err = RequestTimeout("the request head did not arrive in time")
        if self._messages or self._request_in_progress:
            if self._head_bytes > 0:
                self._refuse(err)
            return
        self._listener.refused(err)
        transport.write(raw_answer(err, self._api))
        self.force_close()
        transport.close()

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        if isinstance(kwargs.get("exc_info"), PayloadTooLarge):  # aiohttp drains a body refused by its announced
            return  # size after the 413 and meets the refusal: the connection closes, as it should
        super().log_exception(*args, **kwargs)

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if status >= 500 and not isinstance(exc, UnicodeError | GatewayError):  # (a GatewayError: refused here)
            log.error("error handling a request from %s", request.remote, exc_info=exc)
        if request.writer.output_size > 0:
            raise ConnectionError("the response is under way: no error answer can follow")
        err = protocol_error(status, exc)
        self._listener.refused(err)
        status, headers, body = render_error(err, api=self._api)
        resp = web.Response(status=status, body=body, headers=headers)
        resp.force_close()
        return resp
