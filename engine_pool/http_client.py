"""The product's one HTTP client, for everything kvgate sends to engines: the proxied requests (`gateway.proxy`),
health probes, metrics scrapes and warm-ups (`fetch`). Keep-alive connection pools on raw asyncio protocols,
responses parsed by httptools (llhttp, the parser Node.js uses).

Why not aiohttp's client: on these machines it costs several times what the whole rest of a proxied request does
(the gateway overhead benchmark in docs/ shows both). This client does only what relaying to vLLM needs: POST/GET
with a body, the status, the body read whole or streamed chunk by chunk (chunked transfer decoding by the
parser), keep-alive reuse, and abort (closing the socket, which is how vLLM learns that a client left).

Pool: per (host, port), a LIFO stack of idle connections bounded by `max_idle`; a connection goes back only when its
response was read to the end and both sides allow keep-alive. Timeouts: `UpstreamResponse.set_timeout` registers a
deadline with the client's `DeadlineWatch`, one timer ticking every 50 ms while anything is watched (not a timer per
request). Flow control: a response holds at most about `READ_HIGH_WATER` bytes its reader has not taken; past that
the connection stops reading the socket until the reader catches up, so a slow client backs up into the engine's
socket instead of the gateway's memory. Costs per request: one transport.write, one parser feed per received
segment; no per-request allocations beyond the response object and its list of header pairs (bytes, not decoded).


The HTTP/1.1 exchange on one connection (its framing, the bound on a head, the response a request reads) is
`engine_pool.http_exchange`.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from engine_pool.http_exchange import (
    DeadlineWatch,
    EngineConnection,
    ResponseTooLarge,
    UpstreamConnectionError,
    UpstreamProtocolError,
    UpstreamResponse,
)

__all__ = [  # the exchange's names a caller of the client meets (its errors, its responses)
    "VIA", "ResponseTooLarge", "UpstreamClient", "UpstreamConnectionError", "UpstreamPool", "UpstreamProtocolError",
    "UpstreamResponse", "via_chain",
]  # fmt: skip

_NO_HEADERS: Mapping[str, str] = {}
# the gateways a request went through, by instance (`gateway.ids`): each adds its own to what it sends, and refuses a
# request that already carries it (an engine address that leads back to the gateway would otherwise loop)
VIA = "x-kvgate-via"
FETCH_MAX_BYTES = 64 * 1024 * 1024  # `UpstreamClient.fetch`'s bound on a body (a scrape, a probe's answer)


def via_chain(lines: Iterable[str]) -> list[str]:
    """The gateway instances a request's `VIA` header lines name, in order."""
    return [name for line in lines for part in line.split(",") if (name := part.strip())]


class UpstreamPool:
    """Keep-alive connections to one host:port."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        use_tls: bool = False,
        max_idle: int = 256,
        idle_timeout_s: float = 4.0,
        deadlines: DeadlineWatch | None = None,
        via: str | None = None,
    ) -> None:
        self.read_pauses = 0  # times a response stopped reading the socket for a slow reader (flow control)
        self.deadlines = deadlines or DeadlineWatch()
        self.host, self.port = host, port
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if use_tls else None
        self.max_idle = max_idle
        self.idle_timeout_s = idle_timeout_s  # below uvicorn's 5 s keep-alive, so vLLM never closes one under us
        self._idle: list[EngineConnection] = []
        # every request's fixed header lines: the host, and the sending gateway (`VIA`) when it has one
        self._fixed = f"Host: {host}:{port}\r\n" + (f"{VIA}: {via}\r\n" if via else "")

    def put(self, conn: EngineConnection) -> None:
        if len(self._idle) < self.max_idle:  # its parser goes on with the next response (llhttp resets itself)
            conn.idle_since = time.monotonic()
            conn.reused = True
            self._idle.append(conn)
        else:
            conn.abort()

    async def _connect(self, connect_timeout_s: float) -> EngineConnection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: EngineConnection(self), self.host, self.port, ssl=self.ssl
                )
        except TimeoutError:
            raise UpstreamConnectionError(f"connect to {self.host}:{self.port} timed out") from None
        except OSError as exc:
            raise UpstreamConnectionError(f"connect to {self.host}:{self.port} failed: {exc}") from None
        return conn

    def _idle_conn(self) -> EngineConnection | None:
        oldest_ok = time.monotonic() - self.idle_timeout_s
        while self._idle:
            candidate = self._idle.pop()
            if not candidate.closed and candidate.idle_since >= oldest_ok:
                return candidate
            candidate.abort()
        return None

    async def request(
        self, method: str, path: str, body: bytes, headers: Mapping[str, str], *, connect_timeout_s: float
    ) -> UpstreamResponse:
        """Send the request, on an idle kept-alive connection when there is one (then without suspending), else on a
        new one; the returned response's headers may not have arrived yet (`await resp.headers_ready`). The head is
        encoded as aiohttp decoded the client's (UTF-8, its other bytes kept as surrogates), so a path or header
        value passed on is the bytes the client sent."""
        fields = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
        head = f"{method} {path} HTTP/1.1\r\n{self._fixed}Content-Length: {len(body)}\r\n{fields}\r\n"
        data = head.encode("utf-8", "surrogateescape") + body
        conn = self._idle_conn() if self._idle else None
        if conn is None:
            conn = await self._connect(connect_timeout_s)
        resp = UpstreamResponse(conn, reused=conn.reused)
        conn.expect(resp)
        assert conn.transport is not None
        conn.transport.write(data)
        return resp

    def close(self) -> None:
        """Drop the idle connections; one released after this is closed too (the pool is gone)."""
        self.max_idle = 0
        for conn in self._idle:
            conn.abort()
        self._idle.clear()


class UpstreamClient:
    """One pool per upstream host:port; `close()` drops every idle connection. `via`: the sending gateway's
    instance, in every request's `VIA` header (a gateway refuses a request that carries its own: a loop)."""

    async def fetch(
        self,
        method: str,
        url: str,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        *,
        timeout_s: float,
        max_bytes: int = FETCH_MAX_BYTES,
    ) -> tuple[int, bytes]:
        """A whole request and response within `timeout_s` (probes, scrapes, warm-ups): (status, body). Raises
        UpstreamConnectionError (a ConnectionError; `ResponseTooLarge` for a body over `max_bytes`) or
        TimeoutError."""
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        pool = self.pool(parts.hostname or "127.0.0.1", parts.port or (443 if tls else 80), tls)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        async with asyncio.timeout(timeout_s):
            resp = await pool.request(method, path, body, headers or _NO_HEADERS, connect_timeout_s=timeout_s)
            try:
                await resp.headers_ready
                data = await resp.read(max_bytes)
            except BaseException:
                resp.close()
                raise
        resp.release()
        return resp.status, data

    def __init__(self, *, max_idle_per_host: int = 256, via: str | None = None) -> None:
        self.max_idle_per_host = max_idle_per_host
        self.via = via
        self.deadlines = DeadlineWatch()  # one timer for every pool's response timeouts
        self._pools: dict[tuple[str, int, bool], UpstreamPool] = {}  # (host, port, TLS)

    def pool(self, host: str, port: int, use_tls: bool = False) -> UpstreamPool:
        key = (host, port, use_tls)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = UpstreamPool(
                host, port, use_tls=use_tls, max_idle=self.max_idle_per_host, deadlines=self.deadlines, via=self.via
            )
        return pool

    def drop(self, host: str, port: int) -> None:
        """Forget the pool of an upstream no replica uses any more (removed, or gone from DNS): the table of pools
        is bounded by the upstreams in use, not by every one ever seen."""
        for use_tls in (False, True):
            pool = self._pools.pop((host, port, use_tls), None)
            if pool is not None:
                pool.close()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self.deadlines.close()

    def __len__(self) -> int:
        """The upstreams it keeps a pool for."""
        return len(self._pools)
