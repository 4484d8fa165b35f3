"""The aiohttp application: typed app keys, middleware, and the resources each `cleanup_ctx` step owns.

Start-up order (reverse on shutdown): the HTTP client to engines -> replica set (attached engines, probes) ->
what is shared with the other gateways (Redis) and the prefix cache (gateway.cache_ctx) -> engine pool ->
router and proxy -> admission -> the completion service.
Nothing is module-global: a test can run several gateways in one process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry

from engine_pool.discovery import DnsDiscovery
from engine_pool.http_client import VIA, UpstreamClient, via_chain
from engine_pool.pool import EnginePool
from engine_pool.replica_set import ReplicaSet
from gateway import handlers
from gateway.accesslog import refused
from gateway.admission.controller import AdmissionController
from gateway.admission.local import LocalQuotaStore
from gateway.admission.metrics import AdmissionMetrics
from gateway.admission.quota import QuotaStore
from gateway.admission.redis_store import RedisQuotaStore
from gateway.attached import attached_replica, dns_target
from gateway.cache_ctx import CACHE_SWITCH, cache_ctx
from gateway.completion import CompletionService
from gateway.config import GatewayConfig
from gateway.endpoints import API_BY_PATH, endpoint_label
from gateway.errors import BadRequest, GatewayError, LoopDetected, error_response, http_exception_to_error
from gateway.ids import REQUEST_ID_MAX, IdSource, valid_request_id
from gateway.keys import (
    ADMISSION,
    CACHE,
    COMPLETIONS,
    CONFIG,
    DISCOVERY,
    FLEET,
    IDS,
    METRICS,
    POOL,
    PROXY,
    REGISTRY,
    REPLICAS,
    REQUEST_ID,
    ROUTER,
    UPSTREAM,
)
from gateway.metrics import GatewayMetrics
from gateway.proxy import ProxySettings, UpstreamProxy
from gateway.realtime import realtime_ctx
from gateway.reload import RELOADER, ConfigReloader
from gateway.router import Router
from gateway.tracing import Tracer
from policies.registry import build_policy

log = logging.getLogger("kvgate.gateway")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


_ANTHROPIC_PREFIX = "/v1/messages"  # Anthropic's routes (and those it has that kvgate does not: batches)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    started = time.monotonic()
    client_id = request.headers.get("x-request-id")
    request_id = client_id if client_id and valid_request_id(client_id) else request.app[IDS].next()
    request[REQUEST_ID] = request_id
    resource = request.match_info.route.resource
    # the route's shape (a path no route takes or a method it does not: Anthropic's below its Messages API)
    api = API_BY_PATH.get(resource.canonical, "openai") if resource is not None else None
    if api is None:
        api = "anthropic" if request.path.startswith(_ANTHROPIC_PREFIX) else "openai"
    try:
        if client_id and client_id != request_id:
            raise BadRequest(
                f"x-request-id must be visible ASCII, at most {REQUEST_ID_MAX} characters", param="x-request-id"
            )
        if len(request.headers.getall("x-request-id", ())) > 1:  # which one the engine and the logs keep: ambiguous
            raise BadRequest("x-request-id sent more than once", param="x-request-id")
        if VIA in request.headers and request.app[IDS].instance in via_chain(request.headers.getall(VIA)):
            raise LoopDetected(
                "the request came back to the gateway that sent it: an engine address of this gateway leads back to "
                "it (x-kvgate-via)"
            )
        response = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = http_exception_to_error(exc)
    except GatewayError as exc:
        err = exc
    except Exception:
        log.exception("unhandled error in %s %s (request %s)", request.method, request.path, request_id)
        err = GatewayError("internal gateway error")
    else:
        if not response.prepared:
            response.headers.setdefault("x-request-id", request_id)
        return response
    # refused outside the request paths that log themselves (a completion's handler answers its own errors): a
    # route's checks above, the admin API's key, a path no route takes (a scan, a wrong path or method)
    endpoint = endpoint_label(resource.canonical if resource is not None else None)
    refused(
        request.app[CONFIG].server.access_log, request.app[METRICS].requests, request_id, endpoint, err.status,
        err.code, started,
    )  # fmt: skip
    return error_response(err, request_id=request_id, api=api)


async def _client_ctx(app: web.Application) -> AsyncIterator[None]:
    # requests, probes, scrapes, warm-ups: one client, marking each with this gateway (a request back here is a loop)
    upstream = app[UPSTREAM] = UpstreamClient(via=app[IDS].instance)
    try:
        yield
    finally:
        upstream.close()


async def _replicas_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    replicas = ReplicaSet(
        app[UPSTREAM],
        interval_s=cfg.health.interval_s,
        timeout_s=cfg.health.timeout_s,
        metrics_interval_s=cfg.health.metrics_interval_s,
    )
    app[REPLICAS] = replicas
    app[METRICS].export_replicas(replicas)
    replicas.add_listener(app[METRICS])  # a replica removed for good: its series go
    for engine in cfg.engines:
        if engine.url is not None:
            replicas.add(attached_replica(engine))
    found = app[DISCOVERY] = [DnsDiscovery(dns_target(e), replicas) for e in cfg.engines if e.dns is not None]
    if found:
        app[METRICS].export_discovery(found)
    for discovery in found:
        discovery.start()
    try:
        yield
    finally:
        for discovery in found:
            await discovery.close()
        await replicas.close()


async def _pool_ctx(app: web.Application) -> AsyncIterator[None]:
    """The engines kvgate launches: after the replica set (the pool adds its replicas, `managed=True`, warm after
    warm-up), before the router; on shutdown, after the server let in-flight requests finish, it stops every engine
    process group."""
    cfg = app[CONFIG].pool
    if cfg is None or not cfg.models:
        yield
        return
    # the gateway's port is bound only after start-up, when the engines are launched: none of them may take it
    reserved = (app[CONFIG].server.port,)
    pool = app[POOL] = EnginePool(cfg, app[REPLICAS], app[UPSTREAM], app[REGISTRY], reserved_ports=reserved)
    try:
        await pool.start()
        yield
    finally:
        await pool.stop()


async def _router_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    policy = build_policy(cfg.routing.policy, cfg.routing.params)
    router = Router(policy, app[REPLICAS], app[METRICS])
    await app[CACHE_SWITCH].route_with(router, policy, cfg.routing)
    app[ROUTER] = router
    app[PROXY] = UpstreamProxy(
        app[UPSTREAM],
        router,
        app[REPLICAS],
        app[METRICS],
        ProxySettings(
            cfg.timeouts, cfg.retry, cfg.server.route_headers, cfg.routing.disaggregation, cfg.server.max_answer_bytes
        ),
    )
    yield


async def _admission_ctx(app: web.Application) -> AsyncIterator[None]:
    """Tenants, quotas and the fair queue: the quota store (Redis when configured), the metrics, the controller."""
    cfg = app[CONFIG].admission
    metrics = AdmissionMetrics(app[REGISTRY])
    redis_store: RedisQuotaStore | None = None
    store: QuotaStore
    if cfg.redis is not None:
        store = redis_store = RedisQuotaStore(cfg.redis, metrics, max_tenants=cfg.max_tenants)
    else:
        store = LocalQuotaStore(max_tenants=cfg.max_tenants)
    controller = AdmissionController(cfg, app[REPLICAS], app[ROUTER], store, metrics)
    if redis_store is not None:
        redis_store.start()
    controller.start()
    app[ADMISSION] = controller
    try:
        yield
    finally:
        await controller.close()


async def _completions_ctx(app: web.Application) -> AsyncIterator[None]:
    tracing = app[CONFIG].tracing
    tracer = Tracer(tracing) if tracing.otlp_endpoint else None
    app[COMPLETIONS] = CompletionService(
        app[CONFIG],
        app[METRICS],
        app[ADMISSION],
        app[REPLICAS],
        app[ROUTER],
        app[PROXY],
        app[CACHE],
        app.get(FLEET),
        tracer,
    )
    reloader = app[RELOADER] = ConfigReloader(app)
    reloader.start()
    try:
        yield
    finally:
        await reloader.close()
        await app[COMPLETIONS].adapters.close()
        if tracer is not None:
            await asyncio.to_thread(tracer.close)  # after in-flight requests finished: their spans go out


async def _gc_ctx(app: web.Application) -> AsyncIterator[None]:
    with app[METRICS].gc_pauses():
        yield


def build_app(config: GatewayConfig, *, registry: CollectorRegistry | None = None) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=config.server.max_body_bytes)
    app[CONFIG] = config
    app[IDS] = IdSource()
    app[REGISTRY] = registry or CollectorRegistry()
    app[METRICS] = GatewayMetrics(app[REGISTRY])
    app.cleanup_ctx.append(_gc_ctx)
    app.cleanup_ctx.extend([_client_ctx, _replicas_ctx, cache_ctx, _pool_ctx, _router_ctx])  # pool: launched engines
    app.cleanup_ctx.append(_admission_ctx)  # after the router: tenants, quotas, the fair queue
    app.cleanup_ctx.append(_completions_ctx)  # the completion endpoints, over everything above
    app.cleanup_ctx.append(realtime_ctx)  # /v1/realtime's sessions and their engine sockets
    handlers.add_routes(app)
    return app
