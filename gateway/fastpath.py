"""The fast path: a lean HTTP/1.1 front on the gateway's port for `POST /v1/chat/completions` and
`POST /v1/completions`; every other request is handed, with its connection, to aiohttp.

Per connection, an asyncio Protocol feeds received bytes to httptools (llhttp). A complete hot request (body
buffered, at most `server.max_body_bytes`) goes to `gateway.lane.dispatch`: answered by the fast lane (no task) or
by `CompletionService.handle` in its own task; one at a time, so pipelined requests are answered in order; up to
`MAX_QUEUED` parsed requests wait, then reading pauses. Headers are not parsed one by one: the few a request needs
are looked up in its raw head (`http1.RawHeaders`).
A request that is not a hot POST (other path or method, a query string, Upgrade, an Expect other than
100-continue or sent behind queued requests) stops the parser; once the requests before it are answered, the
connection is handed to a fresh aiohttp `RequestHandler` (`web.Server()`), with the bytes from that request on,
and stays with aiohttp. Those bytes are the buffer since the last request boundary (`http1.request_boundary`
finds boundaries inside it): usually just the one request.
Errors of the fast path's own: malformed HTTP -> 400, a body over the limit -> 413 as soon as the Content-Length or
the received part exceeds it, a head over `MAX_HEAD_BYTES` / `MAX_HEADERS` -> 431; each OpenAI-shaped, after the
earlier requests' answers, then the connection closes (after a short linger that discards input, so the client
reads the answer instead of a reset).
The client leaving cancels the running lane or task at once. Writes respect pause_writing/resume_writing (a stream
awaits the drain). `FastPathServer.shutdown` closes idle connections and lets running requests finish within the
grace time.
Cost per request: one parser feed per received segment, one lower-cased copy of the head, one transport.write per
answer (streams: one per relayed chunk, and a task).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
from typing import cast

import httptools
from aiohttp import web

from gateway.completion import CompletionService
from gateway.errors import BadRequest, GatewayError, HeadersTooLarge, PayloadTooLarge, render_error
from gateway.http1 import DateHeader, RawHeaders, request_boundary, response_head
from gateway.ids import IdSource
from gateway.lane import Handler, Lane, dispatch
from gateway.request_parse import Endpoint
from gateway.responder import FastResponder

log = logging.getLogger("kvgate.fastpath")

HOT_PATHS: dict[bytes, Endpoint] = {b"/v1/chat/completions": "chat", b"/v1/completions": "completions"}
MAX_QUEUED = 8  # parsed requests waiting on one connection before reading pauses
MAX_HEADERS = 128  # as aiohttp's defaults
MAX_HEAD_BYTES = 64 * 1024
KEEPALIVE_S = 3630.0  # idle keep-alive connections close after this (aiohttp's default)
CREATED = inspect.CORO_CREATED
LINGER_S = 2.0  # after an error answer that closes the connection, input is discarded this long


class _Stop(Exception):
    """Raised from a parser callback to stop parsing (hand over, or reject)."""


class FastRequest:
    """A parsed hot request. `headers` is its raw head, looked up by lower-case name (`http1.RawHeaders`)."""

    __slots__ = ("body", "endpoint", "headers", "http10", "keep_alive")

    def __init__(self, endpoint: Endpoint, headers: RawHeaders, body: bytes, keep_alive: bool, http10: bool) -> None:
        self.endpoint = endpoint
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.http10 = http10


class FastPathServer:
    """Protocol factory for the listening socket; tracks its connections for a graceful shutdown."""

    def __init__(self, service: CompletionService, fallback: web.Server, ids: IdSource, max_body_bytes: int) -> None:
        self.service = service
        self.fallback = fallback  # aiohttp's low-level server: calling it makes a RequestHandler protocol
        self.ids = ids
        self.max_body_bytes = max_body_bytes
        self.date = DateHeader()
        self.connections: set[FastPathProtocol] = set()
        self._empty = asyncio.Event()
        self._empty.set()
        self.closing = False

    def __call__(self) -> FastPathProtocol:
        return FastPathProtocol(self)

    def added(self, conn: FastPathProtocol) -> None:
        self.connections.add(conn)
        self._empty.clear()

    def discarded(self, conn: FastPathProtocol) -> None:
        self.connections.discard(conn)
        if not self.connections:
            self._empty.set()

    async def shutdown(self, grace_s: float) -> None:
        """Close idle connections now; let running requests finish for up to `grace_s`, then abort the rest."""
        self.closing = True
        for conn in list(self.connections):
            conn.begin_close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                await self._empty.wait()
        tasks = [t for conn in list(self.connections) if (t := conn.abort()) is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)


class FastPathProtocol(asyncio.Protocol):
    def __init__(self, server: FastPathServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        # the request being parsed
        self._url = b""
        self._headers = RawHeaders(b"")
        self._head_done = False
        self._endpoint: Endpoint = "chat"
        self._body: list[bytes] = []
        self._body_len = 0
        self._in_msg = False
        # received bytes since the last request boundary, and how many complete requests they hold
        self._raw: list[bytes] = []
        self._raw_msgs = 0
        self._queue: collections.deque[FastRequest] = collections.deque()
        self._task: asyncio.Task[None] | Lane | None = None  # the request running: in a task, or in the lane
        self._handover = False
        self._reject: GatewayError | None = None
        self._closing = False  # answer what is running, then close
        self._lingering = False
        self._reading_paused = False
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._idle_since = self.loop.time()
        self._timer: asyncio.TimerHandle | None = None

    # --- asyncio.Protocol -------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses
        self.server.added(self)
        self._timer = self.loop.call_at(self._idle_since + KEEPALIVE_S, self._idle_check)
        if self.server.closing:
            self.begin_close()

    def data_received(self, data: bytes) -> None:
        if self._handover:
            self._raw.append(data)  # the handed-over request's bytes (reading is paused: bounded)
            return
        if self._reject is not None:
            return  # discarded while the error answer lingers
        self._raw.append(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if not self._handover and self._reject is None:
                self._reject = BadRequest(f"malformed HTTP request: {exc}", code="invalid_http_request")
        if self._handover or self._reject is not None:
            self._pause_reading()
            if self._task is None:
                self._advance()
            return
        if not self._in_msg:
            self._raw.clear()
            self._raw_msgs = 0
        else:
            if not self._head_done and sum(map(len, self._raw)) > MAX_HEAD_BYTES + 1024:
                self._reject = HeadersTooLarge("request line or headers too large")  # a head that never ends
                self._pause_reading()
                if self._task is None:
                    self._advance()
                return
            if self._raw_msgs >= MAX_QUEUED:
                self._compact()
        if len(self._queue) >= MAX_QUEUED:
            self._pause_reading()

    def eof_received(self) -> bool:
        return False  # as aiohttp: a client's EOF closes the connection, which cancels a running request

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.discarded(self)
        if self._timer is not None:
            self._timer.cancel()
        self._queue.clear()
        if self._task is not None:
            self._cancel_running()  # the client left: the handler stops, the engine request is aborted
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self.transport = None

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        if self._task is None and self.transport is not None:
            self._advance()  # a handover waits for the write buffer to drain

    async def drain(self) -> None:
        if self.write_paused and self.transport is not None:
            self._drain = self.loop.create_future()
            try:
                await self._drain
            finally:
                self._drain = None

    # --- httptools callbacks ------------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._in_msg = True
        self._url = b""
        self._head_done = False
        self._body = []
        self._body_len = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_HEAD_BYTES:
            self._reject = HeadersTooLarge("request line or headers too large")
            raise _Stop

    # no on_header: httptools then skips a callback per header; the few headers needed are looked up in the raw
    # head instead (`RawHeaders`)

    def _header_block(self) -> bytes:
        """The current request's headers, from the bytes received since the last request boundary."""
        raw = self._raw
        data = raw[0] if len(raw) == 1 else b"".join(raw)
        start = request_boundary(data, self._raw_msgs) if self._raw_msgs else 0
        while data.startswith(b"\r\n", start):  # blank lines before a request are allowed
            start += 2
        end = data.find(b"\r\n\r\n", start)
        return data[data.find(b"\r\n", start) : end]

    def on_headers_complete(self) -> None:
        self._head_done = True
        block = self._header_block()
        if len(block) > MAX_HEAD_BYTES or block.count(b"\r\n") > MAX_HEADERS:
            self._reject = HeadersTooLarge("request line or headers too large")
            raise _Stop
        parser = self.parser
        endpoint = HOT_PATHS.get(self._url) if parser.get_method() == b"POST" else None
        headers = self._headers = RawHeaders(block)
        expect = headers.get("expect")
        if (
            endpoint is None
            or "upgrade" in headers
            or (expect is not None and (expect.lower() != "100-continue" or self._task is not None or self._queue))
        ):
            self._handover = True
            raise _Stop
        length = headers.get("content-length")
        if length is not None and int(length) > self.server.max_body_bytes:  # llhttp checked it is a number
            self._reject = PayloadTooLarge("request body exceeds the configured limit")
            raise _Stop
        if expect is not None and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._endpoint = endpoint

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > self.server.max_body_bytes:
            self._reject = PayloadTooLarge("request body exceeds the configured limit")
            raise _Stop
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_msg = False
        self._raw_msgs += 1
        parts = self._body
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        parser = self.parser
        request = FastRequest(
            self._endpoint, self._headers, body, parser.should_keep_alive(), parser.get_http_version() == "1.0"
        )
        if self._task is None and not self._queue:
            self._start(request)
        else:
            self._queue.append(request)

    # --- requests -----------------------------------------------------------------------------------------------
    def _start(self, request: FastRequest) -> None:
        server = self.server
        request_id = request.headers.get("x-request-id") or server.ids.next()
        out = FastResponder(self, request, request_id)
        running = dispatch(server.service, request.endpoint, request.headers, request.body, request_id, out, self)
        if isinstance(running, Lane):
            self._task = running
        else:
            self.run_handler(running, out)

    def run_handler(self, handler: Handler, out: FastResponder) -> None:
        self._task = self.loop.create_task(self._serve(handler, out))

    async def _serve(self, handler: Handler, out: FastResponder) -> None:
        try:
            await handler
        except Exception:
            log.exception("fast path: request %s failed after its answer started", out.request_id)
            out.complete = False
        self.lane_done(out)

    def lane_done(self, out: FastResponder) -> None:
        """The running request was answered (by its lane or its task): close, or go on with the next one."""
        self._task = None
        if not out.complete or not out.keep_alive:
            self._close()
            return
        self._idle_since = self.loop.time()
        self._advance()

    def _advance(self) -> None:
        """Nothing is running: start the next queued request, or act on a pending handover / rejection / close."""
        if self.transport is None or self._lingering:
            return
        if self._queue:
            self._start(self._queue.popleft())
            if self._reading_paused and len(self._queue) < MAX_QUEUED // 2 and not (self._handover or self._reject):
                self._reading_paused = False
                self.transport.resume_reading()
        elif self._closing:
            self._close()
        elif self._reject is not None:
            self._send_reject(self._reject)
        elif self._handover and not self.write_paused:
            self._hand_over(self.transport)

    def _send_reject(self, err: GatewayError) -> None:
        assert self.transport is not None
        status, headers, body = render_error(err, request_id=self.server.ids.next())
        tail = f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        self.transport.write(response_head(status, headers, self.server.date.line(), tail) + body)
        self._closing = self._lingering = True
        self._raw.clear()
        self._resume_reading()  # discard what the client still sends, so it reads the answer rather than a reset
        if self.transport.can_write_eof():
            self.transport.write_eof()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(LINGER_S, self._close)

    def _hand_over(self, transport: asyncio.Transport) -> None:
        raw = b"".join(self._raw)
        start = request_boundary(raw, self._raw_msgs)
        if start < 0 or self.server.closing:
            self._close()
            return
        self.server.discarded(self)
        if self._timer is not None:
            self._timer.cancel()
        self.transport = None
        handler = self.server.fallback()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if start < len(raw):
            handler.data_received(raw[start:])
        if self._reading_paused:
            transport.resume_reading()

    def _compact(self) -> None:
        """Drop the bytes of requests already parsed (a pipelining client whose segments never end on a boundary)."""
        raw = b"".join(self._raw)
        start = request_boundary(raw, self._raw_msgs)
        if start > 0:
            self._raw = [raw[start:]]
            self._raw_msgs = 0

    # --- connection state -----------------------------------------------------------------------------------------
    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()

    def _idle_check(self) -> None:
        self._timer = None
        if self.transport is None:
            return
        due = self._idle_since + KEEPALIVE_S
        if self._task is None and not self._in_msg and not self._queue and self.loop.time() >= due:
            self._close()
        else:
            self._timer = self.loop.call_at(max(due, self.loop.time() + 1.0), self._idle_check)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    @property
    def closing(self) -> bool:
        return self._closing

    def begin_close(self) -> None:
        """Shutdown: close now when idle, else after the running request's answer."""
        self._closing = True
        if self._task is None and not self._in_msg and not self._queue:
            self._close()

    def abort(self) -> asyncio.Task[None] | None:
        """Cancel the running request (a lane ends at once; a task is returned, to be awaited) and drop the
        connection."""
        task = self._task
        if task is not None:
            self._cancel_running()
        if self.transport is not None:
            self.transport.abort()
        return task if isinstance(task, asyncio.Task) else None

    def _cancel_running(self) -> None:
        """Cancel the running request. A task that has not started yet is cancelled once it has: its handler may
        hold what `begin_now` took (an admission slot, an engine request), released only by running it."""
        task = self._task
        if isinstance(task, asyncio.Task) and inspect.getcoroutinestate(cast(Handler, task.get_coro())) == CREATED:
            self.loop.call_soon(task.cancel)  # after the task's first step, queued when it was created
        elif task is not None:
            task.cancel()
