"""The gateway's one listening port: aiohttp's HTTP/1.1 server (llhttp parser) with the bounds an ingress needs.

Shared by `kvgate serve` and `gateway.embedded`, so they cannot drift. Each accepted connection gets a
`GuardedRequestHandler` (`gateway.connection`: head deadline and bound, requests answered up to a malformed one,
bodies over the limit refused at once, protocol errors in their route's shape). The port itself:
- at most `server.max_connections` connections: at the bound the connection idle the longest (kept alive between
  requests, nothing of a next one received) is closed to let a new one in, as nginx reclaims its keep-alive
  connections; with none idle one more is answered 503 (Retry-After) and closed at once.
Shutdown: stop accepting; idle connections close; requests in flight finish for up to `server.shutdown_grace_s`,
then those left are ended in their API's shape (`CompletionService.drain`: a stream with an error event, others
503 `shutting_down`), each given `_ENDING_S` to write it; then every cleanup step of the app runs.
Cost per connection: O(1) to accept, count and reclaim.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections import OrderedDict
from typing import Any, cast

from aiohttp import web

from gateway.accesslog import refused
from gateway.config import GatewayConfig
from gateway.connection import GuardedRequestHandler, raw_answer
from gateway.errors import GatewayError, Overloaded
from gateway.keys import COMPLETIONS, METRICS, POOL
from gateway.server_config import ServerConfig

BACKLOG = 1024
_ENDING_S = 2.0  # after shutdown's grace, how long a handler has to write the end of the request it was serving


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
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=_ENDING_S, **self.handler_kwargs)
        self._server: asyncio.AbstractServer | None = None
        self.open_connections = 0
        self.max_connections = 0
        # the connections kept alive between requests, the longest idle first (bounded by the connections)
        self.idle: OrderedDict[GuardedRequestHandler, None] = OrderedDict()
        self.port = 0
        self._stopped = False
        self._refusal = raw_answer(Overloaded("too many connections to this gateway", code="too_many_connections"))

    def refused(self, err: GatewayError) -> None:
        """A request refused as its bytes arrived (no route read yet): logged and counted as `unrouted`."""
        server = self.config.server
        refused(server.access_log, self.app[METRICS].requests, "-", "unrouted", err.status, err.code, time.monotonic())

    def _protocol(self) -> asyncio.BaseProtocol:
        server = self.runner.server
        assert server is not None
        if self.open_connections >= self.max_connections and not self._reclaim():
            self.app[METRICS].connections_refused.value += 1
            return _Refused(self._refusal)
        self.open_connections += 1
        return GuardedRequestHandler(self, server, loop=asyncio.get_running_loop(), **self.handler_kwargs)

    def _reclaim(self) -> bool:
        """Close the connection idle the longest, if any (its slot is the new connection's)."""
        while self.idle:
            handler, _ = self.idle.popitem(last=False)
            if handler.reclaim():  # (counted open until its connection_lost, in a moment)
                self.app[METRICS].connections_reclaimed.value += 1
                return True
        return False

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
        if (pool := self.app.get(POOL)) is not None:
            pool.quiesce()  # an engine that fails during the drain is not relaunched only to be stopped after it
        server = self.runner.server
        if server is not None:
            server.pre_shutdown()  # idle connections close now
            await self.app[COMPLETIONS].drain(self.config.server.shutdown_grace_s)
        await self.runner.cleanup()  # handlers ending (_ENDING_S), then the app's cleanup steps
