"""The gateway's one listening port, shared by `kvgate serve` and `gateway.embedded` so they cannot drift.

With `server.fast_path` (default) the socket is served by `gateway.fastpath` (the two completion endpoints), which
hands every other connection to aiohttp's server; without it, aiohttp serves the port alone (`web.TCPSite`).
Shutdown: stop accepting; close idle connections; running requests finish for up to `server.shutdown_grace_s` (the
fast path's first, then aiohttp's); then every cleanup step of the app runs.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from gateway.config import GatewayConfig
from gateway.fastpath import FastPathServer
from gateway.keys import COMPLETIONS, IDS

BACKLOG = 1024


class GatewayListener:
    def __init__(self, app: web.Application, config: GatewayConfig) -> None:
        self.app = app
        self.config = config
        self.runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=config.server.shutdown_grace_s
        )
        self.fast: FastPathServer | None = None
        self._server: asyncio.AbstractServer | None = None
        self.port = 0
        self._stopped = False

    async def start(self) -> int:
        """Run the app's start-up steps and listen; returns the bound port."""
        server_cfg = self.config.server
        await self.runner.setup()
        try:
            if server_cfg.fast_path:
                fallback = self.runner.server
                assert fallback is not None
                self.fast = FastPathServer(
                    self.app[COMPLETIONS], fallback, self.app[IDS], max_body_bytes=server_cfg.max_body_bytes
                )
                loop = asyncio.get_running_loop()
                self._server = await loop.create_server(
                    self.fast, server_cfg.host, server_cfg.port, backlog=BACKLOG, reuse_address=True
                )
                self.port = int(self._server.sockets[0].getsockname()[1])
            else:
                site = web.TCPSite(self.runner, server_cfg.host, server_cfg.port, backlog=BACKLOG, reuse_address=True)
                await site.start()
                self.port = int(self.runner.addresses[0][1])
        except BaseException:
            await self.runner.cleanup()
            raise
        return self.port

    async def stop(self) -> None:
        """Graceful shutdown; a second call does nothing."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.server.shutdown_grace_s
        if self._server is not None:
            self._server.close()  # stop accepting
        fallback = self.runner.server
        if fallback is not None:
            fallback.pre_shutdown()  # idle handed-over connections close now
        if self.fast is not None:
            await self.fast.shutdown(grace)
        await self.runner.cleanup()  # aiohttp's connections (grace), then the app's cleanup steps
