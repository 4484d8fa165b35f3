"""How the completion logic talks to a client, whichever server holds the connection.

`gateway.completion` writes every answer through a `Responder`: one whole response (`send`), or a stream
(`start_stream`, `write`..., `end`). Two implementations: `AiohttpResponder` (the aiohttp routes) and
`FastResponder` (the fast path's connections, `gateway.fastpath`). Both raise `ConnectionResetError` from `write`
once the client has gone. `FastResponder` frames by hand: Content-Length for whole answers, chunked transfer
encoding for streams (HTTP/1.0 clients: raw body, then close); every answer carries x-request-id.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Protocol

from aiohttp import web

from gateway.http1 import DateHeader, response_head


class Responder(Protocol):
    @property
    def started(self) -> bool:
        """The response status line and headers have been committed (nothing else may be sent but body bytes)."""
        ...

    async def send(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        """A whole response; `headers` carries Content-Type (the responder adds framing headers)."""
        ...

    async def start_stream(self, status: int, headers: Mapping[str, str]) -> None:
        """Commit the headers of a response whose body follows in `write` calls."""
        ...

    async def write(self, data: bytes) -> None:
        """Send body bytes; waits while the client's socket buffer is full (backpressure)."""
        ...

    async def end(self) -> None:
        """Finish a streamed response."""
        ...


class AiohttpResponder:
    """Builds the aiohttp response the route handler returns (`response`), or streams through `prepare`."""

    __slots__ = ("request", "response")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self.response is not None and self.response.prepared

    async def send(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.response = web.Response(body=body, status=status, headers=headers)

    async def start_stream(self, status: int, headers: Mapping[str, str]) -> None:
        response = web.StreamResponse(status=status, headers=headers)
        await response.prepare(self.request)
        self.response = response

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    async def end(self) -> None:
        assert self.response is not None
        await self.response.write_eof()


class _FastRequest(Protocol):
    @property
    def keep_alive(self) -> bool: ...

    @property
    def http10(self) -> bool: ...


class _FastServer(Protocol):
    @property
    def date(self) -> DateHeader: ...


class _FastConnection(Protocol):
    """What `FastResponder` needs of the fast path's protocol (gateway.fastpath.FastPathProtocol)."""

    @property
    def transport(self) -> asyncio.Transport | None: ...

    @property
    def server(self) -> _FastServer: ...

    @property
    def write_paused(self) -> bool: ...

    @property
    def closing(self) -> bool: ...

    async def drain(self) -> None: ...


class FastResponder:
    __slots__ = ("_chunked", "complete", "conn", "keep_alive", "request", "request_id", "started")

    def __init__(self, conn: _FastConnection, request: _FastRequest, request_id: str) -> None:
        self.conn = conn
        self.request = request
        self.request_id = request_id
        self.started = False
        self.complete = False
        self.keep_alive = request.keep_alive
        self._chunked = False

    def _transport(self) -> asyncio.Transport:
        transport = self.conn.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        return transport

    def _head(self, status: int, headers: Mapping[str, str], framing: str) -> bytes:
        self.keep_alive = keep = self.keep_alive and not self.conn.closing
        if "x-request-id" not in headers:
            headers = {**headers, "x-request-id": self.request_id}
        if not keep:
            connection = "Connection: close\r\n"
        elif self.request.http10:
            connection = "Connection: keep-alive\r\n"
        else:
            connection = ""
        return response_head(status, headers, self.conn.server.date.line(), f"{framing}{connection}\r\n")

    async def send(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.send_now(status, headers, body)

    def send_now(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        """`send` without a coroutine (the fast lane, `gateway.lane`)."""
        transport = self._transport()
        self.started = True
        transport.write(self._head(status, headers, f"Content-Length: {len(body)}\r\n") + body)
        self.complete = True

    async def start_stream(self, status: int, headers: Mapping[str, str]) -> None:
        transport = self._transport()
        self.started = True
        if self.request.http10:  # no chunked encoding in HTTP/1.0: the body ends when the connection closes
            self.keep_alive = False
            transport.write(self._head(status, headers, ""))
        else:
            self._chunked = True
            transport.write(self._head(status, headers, "Transfer-Encoding: chunked\r\n"))

    async def write(self, data: bytes) -> None:
        if not data:
            return
        transport = self._transport()
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        if self.conn.write_paused:
            await self.conn.drain()

    async def end(self) -> None:
        transport = self._transport()
        if self._chunked:
            transport.write(b"0\r\n\r\n")
        self.complete = True
