"""The gateway's one listening port: aiohttp's HTTP/1.1 server (llhttp parser) with the bounds an ingress needs.

Shared by `kvgate serve` and `gateway.embedded`, so they cannot drift. Each accepted connection gets a
`GuardedRequestHandler`, aiohttp's own protocol with three additions:
- a head that does not complete within `server.head_timeout_s` of its first byte gets 408 and the connection
  closes (aiohttp alone only times out idle connections, after `keepalive_timeout_s`); the body's own deadline is
  `server.body_timeout_s`, applied where a handler reads it (`gateway.body`);
- protocol errors answer in OpenAI's error shape: malformed HTTP (smuggling shapes included: Content-Length with
  Transfer-Encoding, a duplicate Content-Length) 400 `invalid_http_request`, a header line over
  `max_header_bytes` or more than `max_headers` headers 431; the connection then closes;
- at most `server.max_connections` connections: one more is answered 503 (Retry-After) and closed at once.
Pipelining is bounded by aiohttp itself: at most 32 parsed requests wait per connection, then it stops reading
the socket until they are answered (in order). `Expect: 100-continue` is answered by aiohttp before the handler
reads the body (a body declared over `max_body_bytes` gets 413 instead: `gateway.body.expect_handler`).
Shutdown: stop accepting; idle connections close; running requests finish for up to `server.shutdown_grace_s`;
then every cleanup step of the app runs. Cost per connection: one timer while a head is incomplete.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from gateway.config import GatewayConfig, ServerConfig
from gateway.errors import BadRequest, GatewayError, HeadersTooLarge, Overloaded, RequestTimeout, render_error
from gateway.keys import METRICS

log = logging.getLogger("kvgate.server")

BACKLOG = 1024


def _raw_answer(err: GatewayError) -> bytes:
    """A whole HTTP/1.1 response for an error sent outside any request (no request object exists yet)."""
    status, headers, body = render_error(err)
    head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}", "Connection: close", f"Content-Length: {len(body)}"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


_REASONS = {408: "Request Timeout", 503: "Service Unavailable"}


def protocol_error(status: int, exc: BaseException | None) -> GatewayError:
    """The OpenAI-shaped error for a request aiohttp's parser refused (or a handler crash it caught)."""
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


class GuardedRequestHandler(RequestHandler):
    """aiohttp's protocol with a head deadline, OpenAI-shaped protocol errors and a connection count."""

    def __init__(self, listener: GatewayListener, server: web.Server, **kwargs: Any) -> None:
        super().__init__(server, **kwargs)
        self._listener = listener
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._listener.open_connections -= 1
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        head_pending = not (self._messages or self._request_in_progress)  # no whole head yet, nothing served
        if self._head_timer is not None:
            if not head_pending:
                self._head_timer.cancel()
                self._head_timer = None
        elif head_pending and self.transport is not None:
            timeout = self._listener.config.server.head_timeout_s
            self._head_timer = self._loop.call_later(timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        transport = self.transport
        if transport is None or transport.is_closing() or self._messages or self._request_in_progress:
            return
        transport.write(_raw_answer(RequestTimeout("the request head did not arrive in time")))
        self.force_close()
        transport.close()

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if status >= 500 and not isinstance(exc, UnicodeError):
            log.error("error handling a request from %s", request.remote, exc_info=exc)
        if request.writer.output_size > 0:
            raise ConnectionError("the response is under way: no error answer can follow")
        status, headers, body = render_error(protocol_error(status, exc))
        resp = web.Response(status=status, body=body, headers=headers)
        resp.force_close()
        return resp


class _Refused(asyncio.Protocol):
    """The protocol of a connection over `server.max_connections`: 503, then close."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        writer = cast(asyncio.WriteTransport, transport)  # uvloop's transports are not asyncio subclasses
        writer.write(self.answer)
        writer.close()


def connection_limit(server_cfg: ServerConfig) -> int:
    """`server.max_connections`, or half of the file-descriptor limit (raised to its hard limit first, as Go's
    runtime does): the other half is for engine connections, probes and files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if server_cfg.max_connections is not None:
        return server_cfg.max_connections
    return max(64, (soft if soft != resource.RLIM_INFINITY else 65536) // 2)


class GatewayListener:
    def __init__(self, app: web.Application, config: GatewayConfig) -> None:
        self.app = app
        self.config = config
        server_cfg = config.server
        self.handler_kwargs: dict[str, Any] = {
            "access_log": None,  # kvgate writes its own access log (gateway.accesslog)
            "keepalive_timeout": server_cfg.keepalive_timeout_s,
            "max_line_size": server_cfg.max_header_bytes,
            "max_field_size": server_cfg.max_header_bytes,
            "max_headers": server_cfg.max_headers,
            "lingering_time": 2.0,  # after an answer that left a body unread, its rest is discarded this long
        }
        self.runner = web.AppRunner(
            app, handler_cancellation=True, shutdown_timeout=server_cfg.shutdown_grace_s, **self.handler_kwargs
        )
        self._server: asyncio.AbstractServer | None = None
        self.open_connections = 0
        self.max_connections = 0
        self.port = 0
        self._stopped = False
        self._refusal = _raw_answer(Overloaded("too many connections to this gateway", code="too_many_connections"))

    def _protocol(self) -> asyncio.BaseProtocol:
        server = self.runner.server
        assert server is not None
        if self.open_connections >= self.max_connections:
            self.app[METRICS].connections_refused.value += 1
            return _Refused(self._refusal)
        self.open_connections += 1
        return GuardedRequestHandler(self, server, loop=asyncio.get_running_loop(), **self.handler_kwargs)

    async def start(self) -> int:
        """Run the app's start-up steps and listen; returns the bound port."""
        server_cfg = self.config.server
        self.max_connections = connection_limit(server_cfg)
        self.app[METRICS].export_connections(lambda: self.open_connections)
        await self.runner.setup()
        try:
            loop = asyncio.get_running_loop()
            self._server = await loop.create_server(
                self._protocol, server_cfg.host, server_cfg.port, backlog=BACKLOG, reuse_address=True
            )
            self.port = int(self._server.sockets[0].getsockname()[1])
        except BaseException:
            await self.runner.cleanup()
            raise
        return self.port

    async def stop(self) -> None:
        """Graceful shutdown; a second call does nothing."""
        if self._stopped:
            return
        self._stopped = True
        if self._server is not None:
            self._server.close()  # stop accepting
        server = self.runner.server
        if server is not None:
            server.pre_shutdown()  # idle connections close now
        await self.runner.cleanup()  # running requests (grace), then the app's cleanup steps
