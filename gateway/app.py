"""The aiohttp application: typed app keys, middleware, and the resources each `cleanup_ctx` step owns.

Start-up order (reverse on shutdown): HTTP client session -> replica set (attached engines, probes) -> prefix cache
-> engine pool -> router and proxy -> admission -> the completion service both servers call. Nothing is
module-global: a test can run several gateways in one process.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from engine_pool import admin
from engine_pool.app_ctx import pool_ctx as _pool_ctx
from engine_pool.replica import Replica
from engine_pool.replica_set import ReplicaSet
from gateway import handlers
from gateway.admission.setup import admission_ctx
from gateway.cache_ctx import cache_ctx
from gateway.completion import CompletionService
from gateway.config import EngineConfig, GatewayConfig
from gateway.errors import GatewayError, error_response, http_exception_to_error
from gateway.ids import IdSource
from gateway.keys import (
    ADMISSION,
    CACHE,
    CLIENT,
    COMPLETIONS,
    CONFIG,
    IDS,
    METRICS,
    PROXY,
    REGISTRY,
    REPLICAS,
    REQUEST_ID,
    ROUTER,
    UPSTREAM,
)
from gateway.metrics import GatewayMetrics
from gateway.proxy import ProxySettings, UpstreamProxy
from gateway.router import Router
from gateway.upstream import UpstreamClient
from policies.registry import build_policy

log = logging.getLogger("kvgate.gateway")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def attached_replica(engine: EngineConfig) -> Replica:
    host = engine.url.split("://", 1)[1]
    return Replica(
        engine.name or host,
        engine.url,
        engine.model,
        metrics_url=engine.metrics_url,
        kv_events_endpoint=engine.kv_events_endpoint,
        tokenizer=engine.tokenizer,
        max_concurrency=engine.max_concurrency,
        max_num_seqs=engine.max_num_seqs,
        managed=False,
    )


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request_id = request.headers.get("x-request-id") or request.app[IDS].next()
    request[REQUEST_ID] = request_id
    try:
        response = await handler(request)
    except GatewayError as err:
        return error_response(err, request_id=request_id)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(http_exception_to_error(exc), request_id=request_id)
    except Exception:
        log.exception("unhandled error in %s %s (request %s)", request.method, request.path, request_id)
        return error_response(GatewayError("internal gateway error"), request_id=request_id)
    if not response.prepared:
        response.headers.setdefault("x-request-id", request_id)
    return response


async def _client_ctx(app: web.Application) -> AsyncIterator[None]:
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
    upstream = UpstreamClient()
    app[UPSTREAM] = upstream
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        app[CLIENT] = session  # probes, scrapes, warm-ups; requests go through the lean UpstreamClient
        try:
            yield
        finally:
            upstream.close()


async def _replicas_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    replicas = ReplicaSet(
        app[CLIENT],
        interval_s=cfg.health.interval_s,
        timeout_s=cfg.health.timeout_s,
        metrics_interval_s=cfg.health.metrics_interval_s,
    )
    app[REPLICAS] = replicas
    for engine in cfg.engines:
        replicas.add(attached_replica(engine))
    try:
        yield
    finally:
        await replicas.close()


async def _router_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    policy = build_policy(cfg.routing.policy, cfg.routing.params)
    router = Router(policy, app[REPLICAS], app[METRICS], app.get(CACHE))
    app[ROUTER] = router
    app[PROXY] = UpstreamProxy(
        app[UPSTREAM],
        router,
        app[REPLICAS],
        app[METRICS],
        ProxySettings(cfg.timeouts, cfg.retry, cfg.server.route_headers),
    )
    yield


async def _completions_ctx(app: web.Application) -> AsyncIterator[None]:
    app[COMPLETIONS] = CompletionService(
        app[CONFIG], app[METRICS], app[ADMISSION], app[REPLICAS], app[ROUTER], app[PROXY], app.get(CACHE)
    )
    yield


def build_app(config: GatewayConfig, *, registry: CollectorRegistry | None = None) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=config.server.max_body_bytes)
    app[CONFIG] = config
    app[IDS] = IdSource()
    app[REGISTRY] = registry or CollectorRegistry()
    app[METRICS] = GatewayMetrics(app[REGISTRY])
    app.cleanup_ctx.extend([_client_ctx, _replicas_ctx, cache_ctx, _pool_ctx, _router_ctx])  # pool: launched engines
    app.cleanup_ctx.append(admission_ctx)  # after the router: tenants, quotas, the fair queue
    app.cleanup_ctx.append(_completions_ctx)  # the completion endpoints, over everything above
    handlers.add_routes(app)
    admin.add_routes(app)  # /admin/*: drain, restart, rolling restart, scale
    return app
