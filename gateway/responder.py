"""How the request path answers its client: one whole response (`send`), or a stream (`start_stream`, `write`...,
`end`), as the aiohttp response the route handler returns.

A whole answer is built and returned (aiohttp writes it after the handler); a stream is prepared at its first event
and written as events arrive, each write waiting while the client's socket buffer is full (backpressure).
`write` raises `ConnectionResetError` once the client has gone; `drop` closes the connection of one that stalled.
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web


class Responder:
    __slots__ = ("request", "response")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        """The status line and headers are committed (nothing but body bytes may follow)."""
        return self.response is not None and self.response.prepared

    async def send(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        """A whole response; `headers` carries Content-Type."""
        self.response = web.Response(body=body, status=status, headers=headers)
        if headers.get("Connection") == "close":  # the connection cannot carry another request (a body not read)
            self.response.force_close()

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

    def drop(self) -> None:
        """Close the client's connection at once, nothing more written (a client that takes nothing of its
        stream would hold any last write too)."""
        transport = self.request.transport
        if transport is not None:
            transport.abort()
