"""One HTTP/1.1 exchange with an engine on one kept-alive connection (`engine_pool.http_client` pools them): the
connection's protocol, which feeds what arrives to httptools (llhttp), and the response a request reads, whole or
chunk by chunk, with its flow control and its deadline (`DeadlineWatch`, one timer for every response).

Framing (RFC 9110 §15.2, RFC 9112 §6.3): a response is the engine's final answer; the interim 1xx ones before it
(100 Continue, 103 Early Hints: llhttp completes a message for each) are parsed and dropped, so the connection goes
back to the pool only after the final answer's end. A 101 (switching protocols) fails the request: nothing kvgate
asks for is upgraded. Bytes that begin a message when no request waits on one (after the final answer, or on an
idle pooled connection) fail the connection: they would otherwise be read as the next request's answer. A body
with neither Content-Length nor chunked coding ends where the engine closes the connection (HTTP/1.0, or 1.1
without framing): that close is its normal end, not a failure; such a connection is never reused.

Bound on a head: the bytes before the final answer's headers end (its status line and headers, any interim 1xx
answers before it) are at most `MAX_HEAD_BYTES` per request, counted as they are fed to the parser; past that the
request fails (`UpstreamProtocolError`) and the connection is aborted. Why: httptools gathers a header value by
concatenating each received piece of it onto the rest (quadratic in its length), so an engine's endless header
line would otherwise cost the gateway's one event loop unbounded CPU and memory, and a huge header would be relayed
to clients. vLLM's heads are a few hundred bytes; 64 KiB is far above any real one. The cost: one comparison per
segment received while a head is read (and one of a name's length per header, for the framing above); before the
failure at most `MAX_HEAD_BYTES` are parsed and the concatenation copies at most MAX_HEAD_BYTES² / (bytes per
segment), whatever the engine sends and however long it goes on.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Protocol, cast

import httptools

READ_HIGH_WATER = 256 * 1024  # bytes received and not yet taken by the reader before the socket stops being read
MAX_HEADERS = 64  # response headers kept per response (the rest are parsed and dropped)
MAX_HEAD_BYTES = 64 * 1024  # bytes of a response's head, interim 1xx answers included (see "Bound on a head" above)


class UpstreamConnectionError(ConnectionError):
    """Could not connect, or the connection broke before the response was complete."""


class UpstreamProtocolError(UpstreamConnectionError):
    """The engine broke HTTP/1.1's framing (a malformed or oversized head, a 101, an answer nobody asked for); the
    connection was aborted."""


class ResponseTooLarge(UpstreamConnectionError):
    """A whole body read past its bound (`UpstreamResponse.read`'s `limit`); the connection was aborted."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the response body is larger than {limit} bytes")
        self.limit = limit


class ConnectionPool(Protocol):
    """What a connection needs of the pool it belongs to (`engine_pool.http_client.UpstreamPool`)."""

    read_pauses: int
    deadlines: DeadlineWatch

    def put(self, conn: EngineConnection) -> None: ...


class EngineConnection(asyncio.Protocol):
    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.reading_paused = False
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self.reading_head = False  # the response's final headers have not ended yet (interim 1xx ones may have)
        self.head_left = 0  # bytes the response's head may still take before it fails (`MAX_HEAD_BYTES` in all)
        self.interim = False  # the message being parsed is an interim 1xx answer: dropped, not the response

    def expect(self, resp: UpstreamResponse) -> None:
        """`resp` is the answer to the request about to be sent on this connection."""
        self.response = resp
        self.reading_head = True
        self.head_left = MAX_HEAD_BYTES

    # --- asyncio.Protocol ------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        try:
            if self.reading_head:
                self._feed_head(data)
            else:
                self.parser.feed_data(data)
        except (httptools.HttpParserError, UpstreamProtocolError) as exc:
            self._fail(_protocol_error(exc))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        resp = self.response
        if resp is None or resp.complete:
            return
        if exc is None and self._ends_at_close(resp):
            self.on_message_complete()  # a body delimited by the close (RFC 9112 §6.3 rule 8): whole
        else:
            self._fail(UpstreamConnectionError(f"upstream closed the connection: {exc or 'EOF'}"))

    # --- httptools callbacks ------------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        resp = self.response
        if resp is None or resp.complete:
            raise UpstreamProtocolError("upstream sent an answer to no request")

    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.response
        if resp is None:
            return
        if len(resp.headers) < MAX_HEADERS:
            resp.headers.append((name, value))
        if _is_framing(name, value):
            resp.framed = True

    def on_headers_complete(self) -> None:
        resp = self.response
        if resp is None:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            self._interim(resp, status)
            return
        self.reading_head = False
        resp.status = status
        resp.keep_alive = self.parser.should_keep_alive()
        if not resp.headers_ready.done():
            resp.headers_ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        resp = self.response
        if resp is not None:
            resp.chunks.append(body)
            resp.buffered += len(body)
            if resp.buffered > READ_HIGH_WATER and not self.reading_paused and self.transport is not None:
                self.reading_paused = True  # a slow client: let the engine's socket fill rather than our memory
                self.pool.read_pauses += 1
                self.transport.pause_reading()
            resp.wake()

    def on_message_complete(self) -> None:
        if self.interim:  # an interim 1xx answer's end: the final answer follows
            self.interim = False
            return
        resp = self.response
        if resp is not None:
            resp.complete = True
            resp.wake()

    # --- helpers ----------------------------------------------------------------------------------------------------
    def _feed_head(self, data: bytes) -> None:
        """Feed what arrived while the head is read: at most `head_left` bytes of it, and the rest only when the
        head ended within those (what follows a head's end is its body). O(len(data)) whatever the engine sends."""
        left = self.head_left
        self.head_left = left - len(data)
        if len(data) <= left:
            self.parser.feed_data(data)
            return
        view = memoryview(data)
        self.parser.feed_data(view[:left])
        if self.reading_head:
            raise UpstreamProtocolError(f"the response head is longer than {MAX_HEAD_BYTES} bytes")
        self.parser.feed_data(view[left:])

    def _interim(self, resp: UpstreamResponse, status: int) -> None:
        """An interim 1xx answer's head: dropped (its headers too), the final answer awaited; a 101 fails."""
        if status == 101:
            raise UpstreamProtocolError("upstream switched protocols (101)")
        self.interim = True
        resp.headers.clear()
        resp.framed = False

    def _ends_at_close(self, resp: UpstreamResponse) -> bool:
        """Whether the engine's close is the response's normal end: its head came whole, with neither a length nor
        chunked coding (then llhttp reads its body to the close, and said the connection is not kept alive)."""
        return not self.reading_head and not resp.framed and not resp.keep_alive and resp.error is None

    def _fail(self, exc: Exception) -> None:
        resp = self.response
        if resp is None:
            return
        resp.error = exc
        if not resp.headers_ready.done():
            resp.headers_ready.set_exception(exc)
        resp.wake()

    def resume_reading(self) -> None:
        if self.reading_paused:
            self.reading_paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


def _is_framing(name: bytes, value: bytes) -> bool:
    """A Content-Length, or a Transfer-Encoding that names chunked anywhere (conservative: such a body is never taken
    as ending at the close, so a truncated one fails rather than passing as whole)."""
    size = len(name)
    if size == 14:
        return name.lower() == b"content-length"
    return size == 17 and name.lower() == b"transfer-encoding" and b"chunked" in value.lower()


def _protocol_error(exc: Exception) -> UpstreamProtocolError:
    """A parse failure as the request's error: ours as raised from a parser callback, else llhttp's."""
    if isinstance(exc, UpstreamProtocolError):
        return exc
    cause = exc.__context__
    if isinstance(cause, UpstreamProtocolError):
        return cause
    return UpstreamProtocolError(f"bad response from upstream: {exc}")


class UpstreamResponse:
    def __init__(self, conn: EngineConnection, *, reused: bool = False) -> None:
        self._conn = conn
        self.reused = reused  # sent on a kept-alive connection (a failure before any byte may be a stale socket)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []  # as received, the first MAX_HEADERS of them
        self.keep_alive = False
        self.framed = False  # a Content-Length or chunked coding was announced: a close before the end truncates
        self.complete = False
        self.error: Exception | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0  # bytes in `chunks`; past READ_HIGH_WATER the connection stops reading until taken
        self._loop = loop = asyncio.get_running_loop()
        self.headers_ready: asyncio.Future[None] = loop.create_future()
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self.deadline: float | None = None  # loop time; watched by the pool's DeadlineWatch

    def set_timeout(self, delay_s: float) -> None:
        """Fail the response with TimeoutError in `delay_s` (at most `DeadlineWatch.tick_s` late) unless it is
        complete by then; replaces an earlier timeout. `headers_ready` and the body readers raise it."""
        self.deadline = self._loop.time() + delay_s
        self._conn.pool.deadlines.watch(self)

    def clear_timeout(self) -> None:
        if self.deadline is not None:
            self.deadline = None
            self._conn.pool.deadlines.unwatch(self)

    def expire(self) -> None:
        self.deadline = None
        if self.complete or self.error is not None:
            return
        self.error = TimeoutError("upstream response timed out")
        if not self.headers_ready.done():
            self.headers_ready.set_exception(self.error)
        self.wake()

    def wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked encoding already removed); what arrived together comes as one piece."""
        chunks = self.chunks
        while True:
            if chunks:
                data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self.buffered = 0
                self._conn.resume_reading()
                yield data
                continue
            if self.complete:
                return
            if self.error is not None:
                raise self.error
            await self._wait()

    async def read(self, limit: int) -> bytes:
        """The whole body (`iter_chunks`' semantics without an async generator: most bodies are already complete);
        one larger than `limit` bytes aborts the connection and raises `ResponseTooLarge`."""
        chunks = self.chunks
        parts: list[bytes] = []
        size = 0
        while True:
            if chunks:
                size += self.buffered
                if size > limit:
                    self.close()
                    raise ResponseTooLarge(limit)
                parts += chunks
                chunks.clear()
                self.buffered = 0
                self._conn.resume_reading()
                continue
            if self.complete:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            if self.error is not None:
                raise self.error
            await self._wait()

    def close(self) -> None:
        """Abort: the connection is closed (the engine sees the client leave) and never reused."""
        self.clear_timeout()
        if not self._done:
            self._done = True
            self._conn.abort()

    def release(self) -> None:
        """Return the connection to its pool when the response was read whole; abort it otherwise."""
        self.clear_timeout()
        if self._done:
            return
        self._done = True
        conn = self._conn
        conn.response = None
        if self.complete and self.keep_alive and not conn.closed and self.error is None:
            conn.resume_reading()
            conn.pool.put(conn)
        else:
            conn.abort()


class DeadlineWatch:
    """Timeouts for many responses with one timer instead of one each: every `tick_s` while any response is
    watched, fail those past their deadline. O(1) per watch/unwatch, O(watched) per tick; at most `tick_s` late."""

    def __init__(self, tick_s: float = 0.05) -> None:
        self.tick_s = tick_s
        self._watched: set[UpstreamResponse] = set()  # bounded by the requests in flight
        self._handle: asyncio.TimerHandle | None = None

    def watch(self, resp: UpstreamResponse) -> None:
        self._watched.add(resp)
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(self.tick_s, self._tick)

    def unwatch(self, resp: UpstreamResponse) -> None:
        self._watched.discard(resp)

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        for resp in [r for r in self._watched if r.deadline is None or r.deadline <= now]:
            self._watched.discard(resp)
            resp.expire()
        self._handle = loop.call_later(self.tick_s, self._tick) if self._watched else None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._watched.clear()
