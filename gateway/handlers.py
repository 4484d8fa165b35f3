"""HTTP handlers: the OpenAI endpoints, models, health, readiness and metrics."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.accesslog import log_access
from gateway.admission.admin import reload_admission
from gateway.context import RequestContext
from gateway.errors import GatewayError, NotFound
from gateway.keys import ADMISSION, CACHE, CONFIG, METRICS, PROXY, REGISTRY, REPLICAS, REQUEST_ID, ROUTER
from gateway.request_parse import Endpoint, parse_request
from policies.base import RequestInfo


async def _completion(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    app = request.app
    cfg, metrics = app[CONFIG], app[METRICS]
    ctx = RequestContext(request_id=request[REQUEST_ID], endpoint=endpoint)
    admission = app[ADMISSION]
    info: RequestInfo | None = None
    try:
        identity = admission.identify(request.headers)  # 401 before anything else when auth is on
        ctx.tenant = identity.tenant
        raw = await request.read()
        parsed = parse_request(endpoint, raw)
        if not app[REPLICAS].for_model(parsed.model):  # metrics label only known models: bounded cardinality
            raise NotFound(f"the model {parsed.model!r} does not exist", param="model")
        ctx.model, ctx.stream = parsed.model, parsed.stream
        body_changed = admission.apply_cache_salt(identity, parsed.body)
        session_key = request.headers.get(cfg.cache.session_header)
        info = await app[ROUTER].request_info(
            model=parsed.model, endpoint=endpoint, body=parsed.body, tenant=ctx.tenant, session_key=session_key
        )
        prompt_estimate = info.prompt_tokens or len(raw) // 4
        async with admission.admission(identity, parsed.model, prompt_estimate, ctx):
            response = await app[PROXY].forward(request, parsed, info, ctx, raw, body_changed=body_changed)
        ctx.status = response.status
        return response
    except GatewayError as err:
        ctx.status, ctx.error = err.status, err.code
        for name, value in ctx.extra_headers.items():
            err.headers.setdefault(name, value)
        raise
    except BaseException:
        if ctx.delivered:  # the client had every event and left before the chunked terminator: a success
            ctx.status = 200
        else:
            ctx.status, ctx.client_disconnected = 499, True
            metrics.cancelled.labels(ctx.model).inc()
        raise
    finally:
        if ctx.status == 200 and info is not None and (cache := app.get(CACHE)) is not None:
            cache.on_finished(info, ctx.replica, ctx.cached_tokens)
        ctx.duration_s = time.monotonic() - ctx.started
        _observe(request, ctx)
        admission.metrics.requests.labels(ctx.tenant, str(ctx.status)).inc()
        log_access(ctx, cfg.server.access_log)


def _observe(request: web.Request, ctx: RequestContext) -> None:
    m = request.app[METRICS]
    m.requests.labels(ctx.model, ctx.replica, ctx.endpoint, str(ctx.status)).inc()
    if ctx.status == 200:
        if ctx.ttft_s is not None:
            m.ttft.labels(ctx.model).observe(ctx.ttft_s)
        if ctx.duration_s is not None:
            m.e2e.labels(ctx.model).observe(ctx.duration_s)
        for kind, value in (
            ("prompt", ctx.prompt_tokens),
            ("cached", ctx.cached_tokens),
            ("completion", ctx.completion_tokens),
        ):
            if value:
                m.tokens.labels(ctx.model, kind).inc(value)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "completions")


async def list_models(request: web.Request) -> web.Response:
    data = []
    for model, replicas in sorted(request.app[REPLICAS].models().items()):
        entry: dict[str, Any] = {"id": model, "object": "model", "created": 0, "owned_by": "kvgate"}
        lens = [r.max_model_len for r in replicas if r.max_model_len]
        if lens:
            entry["max_model_len"] = min(lens)
        data.append(entry)
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def readiness(request: web.Request) -> dict[str, Any]:
    now = time.monotonic()
    models: dict[str, dict[str, Any]] = {}
    for replica in request.app[REPLICAS]:
        entry = models.setdefault(replica.model or "?", {"ready": 0, "replicas": {}})
        ok = replica.routable(now)
        entry["ready"] += int(ok)
        entry["replicas"][replica.id] = {
            "ready": ok,
            "healthy": replica.healthy,
            "warm": replica.warm,
            "draining": replica.draining,
            "breaker_open": replica.breaker_open(now),
            "in_flight": replica.in_flight,
        }
    ready = bool(models) and all(m["ready"] > 0 for m in models.values())
    return {"ready": ready, "models": models}


async def ready(request: web.Request) -> web.Response:
    state = readiness(request)
    return web.json_response(state, status=200 if state["ready"] else 503)


async def metrics(request: web.Request) -> web.Response:
    m, now = request.app[METRICS], time.monotonic()
    for replica in request.app[REPLICAS]:
        m.replica_ready.labels(replica.id, replica.model or "?").set(1 if replica.routable(now) else 0)
        m.in_flight.labels(replica.id).set(replica.in_flight)
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/admin/reload", reload_admission)
