"""`kvgate serve`: load and validate the whole configuration, then run the gateway until SIGINT/SIGTERM.

Shutdown (`gateway.listener`): stop accepting, let in-flight requests finish for up to `server.shutdown_grace_s`,
end those left in their API's shape, then run every cleanup step (engine processes are stopped by the pool's own
cleanup). While it drains, SIGHUP is ignored and a second SIGINT/SIGTERM ends the requests in flight at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import io
import json
import logging
import re
import signal
import sys
import time
from typing import Any

from aiohttp import web

from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.config_load import ConfigError, ConfigSource, load_config
from gateway.handlers import readiness
from gateway.keys import COMPLETIONS, CONFIG, CONFIG_SOURCE, REPLICAS
from gateway.listener import GatewayListener
from gateway.reload import RELOADER
from policies.registry import policy_names

log = logging.getLogger("kvgate")
_GC_YOUNG = 20_000  # allocations between collections of the young generation (see `serve`)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate serve", description="Run the kvgate gateway.")
    p.add_argument("--config", "-c", help="YAML config file (environment KVGATE__A__B=... and flags override it)")
    p.add_argument("--host", help="listen address (server.host)")
    p.add_argument("--port", type=int, help="listen port (server.port); 0 picks a free one")
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="URL",
        help="attach an engine speaking vLLM's OpenAI API (repeatable; replaces the config file's engines)",
    )
    p.add_argument("--policy", help=f"routing policy: {', '.join(policy_names())}")
    p.add_argument("--access-log", choices=["plain", "json", "off"], help="access log format")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--check", action="store_true", help="validate the configuration, print it and exit")
    return p


_SECRET = "<redacted>"


def redacted(config: dict[str, Any]) -> dict[str, Any]:
    """The configuration as `--check` prints it: the admin key, the cache-salt secret, the OTLP headers (auth) and
    the passwords in Redis URLs replaced (a check's output goes to terminals and CI logs)."""
    for section, key in (("admin", "key"), ("admission", "cache_salt_secret")):
        if config[section].get(key) is not None:
            config[section][key] = _SECRET
    tracing = config["tracing"]
    tracing["headers"] = dict.fromkeys(tracing["headers"], _SECRET)
    for holder, key in ((config["admission"].get("redis"), "url"), (config["fleet"], "redis_url")):
        if holder and holder.get(key):
            holder[key] = re.sub(r"(://[^:/@]*:)[^@]*@", rf"\g<1>{_SECRET}@", holder[key])
    return config


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    server = {
        k: v for k, v in (("host", args.host), ("port", args.port), ("access_log", args.access_log)) if v is not None
    }
    if server:
        out["server"] = server
    if args.engine:
        out["engines"] = [{"url": url} for url in args.engine]
    if args.policy:
        out["routing"] = {"policy": args.policy}
    return out


class CannotListen(Exception):
    """The gateway's address cannot be bound: said in one line, exit status 1."""


async def serve(
    config: GatewayConfig, *, ready: asyncio.Future[int] | None = None, source: ConfigSource | None = None
) -> None:
    """Run until SIGINT/SIGTERM (or cancellation); `ready` receives the bound port once listening. SIGHUP (and
    `POST /admin/reload`) re-reads `source` (the file, the environment, the flags) and applies what can change
    without dropping requests (gateway.reload)."""
    app = build_app(config)
    if source is not None:
        app[CONFIG_SOURCE] = source
    listener = GatewayListener(app, config)
    try:
        port = await listener.start()
    except OSError as exc:  # the port taken, an address not this machine's
        raise CannotListen(
            f"cannot listen on {config.server.host}:{config.server.port}: {exc.strerror or exc}"
        ) from None
    # What startup built (modules, config, the app) lives as long as the process: out of the collector's
    # generations, a full collection scans only what requests allocate (30-35 ms pauses of the event loop every
    # few thousand requests before, about 1 ms after: kvgate_gc_pause_seconds). The young generation is collected
    # after _GC_YOUNG allocations, not 700: each collection walks the requests in flight (at 64 concurrent, about
    # 3,000 objects that all survive it): every 700 allocations that was 10-14 us of collector time per request, at
    # 20,000 2 us (timed by gc callbacks over 15,000 requests as shipped, two runs each). Cycles wait longer for it.
    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_YOUNG, *gc.get_threshold()[1:])
    log.info(
        "kvgate listening on http://%s:%d (OpenAI base URL http://%s:%d/v1)",
        config.server.host,
        port,
        config.server.host,
        port,
    )
    if ready is not None and not ready.done():
        ready.set_result(port)
    announcer = asyncio.create_task(_announce_ready(app, f"http://{config.server.host}:{port}"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)  # the handler only records the request; this coroutine acts
    loop.add_signal_handler(signal.SIGHUP, app[RELOADER].request_reload)
    try:
        await stop.wait()
        log.info("shutting down: draining in-flight requests (up to %.0f s)", config.server.shutdown_grace_s)
    finally:
        announcer.cancel()
        # while draining: a reload is refused, a second SIGINT/SIGTERM ends the requests in flight at once
        loop.add_signal_handler(signal.SIGHUP, log.warning, "SIGHUP ignored: the gateway is shutting down")
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, app[COMPLETIONS].cut)
        try:
            await listener.stop()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(sig)


async def _announce_ready(app: web.Application, base_url: str) -> None:
    """Log once when /ready first says ready (engines may take minutes to load): where to send requests. Checked as
    the replicas change, and twice a second for what else /ready waits for (a tokenizer loading)."""
    replicas = app[REPLICAS]
    while True:
        changed = replicas.changed
        if readiness(app)["ready"]:
            break
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                await changed.wait()
    now = time.monotonic()
    models = replicas.models()
    names = ", ".join(
        f"{m} ({sum(r.routable(now) for r in rs)}/{len(rs)} replicas ready)" for m, rs in sorted(models.items())
    )
    if pending := [r.url for r in replicas if r.model is None]:  # their models are not known: not counted
        names += f"; {len(pending)} more engine{'s' if len(pending) > 1 else ''} not reached yet"
        names += f" ({', '.join(pending[:3])}{', ...' if len(pending) > 3 else ''})"
    first = min(models, key=lambda m: (any(r.pooling for r in models[m]), m))  # a chat model if any
    key = " -H 'Authorization: Bearer YOUR_KEY'" if app[CONFIG].admission.auth else ""
    log.info(
        "ready: %s. OpenAI base URL %s/v1, e.g. curl %s/v1/chat/completions -H 'Content-Type: "
        'application/json\'%s -d \'{"model": "%s", "messages": [{"role": "user", '
        '"content": "Hello"}]}\'',
        names,
        base_url,
        base_url,
        key,
        first,
    )


class _Formatter(logging.Formatter):
    """The default `asctime` with the date and time formatted once a second rather than for every record (the
    access log writes one per request)."""

    _second = -1
    _text = ""

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "raw", False):  # a JSON access-log line: the object alone, a line of JSON
            return record.getMessage()
        return super().format(record)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        second = int(record.created)
        if second != self._second:
            self._second, self._text = second, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        return f"{self._text},{int(record.msecs):03d}"


class BatchedStderrHandler(logging.StreamHandler):
    """Log lines to stderr through a 64 KiB buffer, written when a WARNING or worse arrives, when the buffer fills,
    or by `flush` (`serve` calls it every `FLUSH_S`, and logging's shutdown at exit): one write for a batch of access
    log lines instead of one per request. A line is late by at most `FLUSH_S`."""

    FLUSH_S = 0.2

    def __init__(self) -> None:
        buffered = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False), 64 * 1024), encoding="utf-8")
        super().__init__(buffered)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(self.format(record) + self.terminator)
            if record.levelno >= logging.WARNING:
                self.flush()
        except Exception:
            self.handleError(record)


async def _serve_flushing_logs(handler: logging.Handler, config: GatewayConfig, source: ConfigSource | None) -> None:
    async def flush() -> None:
        while True:
            await asyncio.sleep(BatchedStderrHandler.FLUSH_S)
            handler.flush()

    flusher = asyncio.create_task(flush(), name="kvgate:log-flush")
    try:
        await serve(config, source=source)
    finally:
        flusher.cancel()
        handler.flush()


def setup_logging(level: str) -> BatchedStderrHandler:
    handler = BatchedStderrHandler()
    handler.setFormatter(_Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    logging.getLogger("kvgate.access").setLevel(logging.INFO)  # `server.access_log` switches it, not the level
    # The format uses neither the caller's file and line nor thread or process names, and finding each costs time
    # on every record (one per request): switched off as the logging docs' "Optimization" section describes.
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    return handler


def run(coro_factory: Any) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro_factory())
    else:
        uvloop.run(coro_factory())


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    log_handler = setup_logging(args.log_level)
    flags = flag_overrides(args)
    try:
        config = load_config(args.config, overrides=flags)
    except ConfigError as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(json.dumps(redacted(config.model_dump(mode="json")), indent=2))
        return 0
    source = ConfigSource(args.config, flags) if args.config is not None else None
    try:
        run(lambda: _serve_flushing_logs(log_handler, config, source))
    except CannotListen as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 1
    return 0
