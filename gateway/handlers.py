"""HTTP handlers: the route table's endpoints (`gateway.endpoints`, all on the one request path in
gateway.completion), models, version, health, readiness and metrics."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import admin
from gateway.abort import PATH as ABORT_PATH
from gateway.abort import abort_requests
from gateway.accesslog import refused
from gateway.admission.auth import check_admin
from gateway.body import expect_handler
from gateway.endpoints import ENDPOINTS, Endpoint, endpoint_label
from gateway.errors import GatewayError
from gateway.keys import ADMISSION, CACHE, COMPLETIONS, CONFIG, IDS, METRICS, REGISTRY, REPLICAS, REQUEST_ID, UPSTREAM
from gateway.realtime import PATH as REALTIME_PATH
from gateway.realtime import realtime


def _endpoint_handler(endpoint: Endpoint) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await request.app[COMPLETIONS].handle(request, endpoint, request[REQUEST_ID])

    return handle


async def version(request: web.Request) -> web.Response:
    """vLLM's `/version` of a ready replica (what clients check the engine by), with kvgate's own beside it."""
    out: dict[str, Any] = {"kvgate": _kvgate_version()}
    now = time.monotonic()
    for replica in request.app[REPLICAS]:
        if replica.routable(now):
            try:
                status, raw = await request.app[UPSTREAM].fetch("GET", replica.url + "/version", timeout_s=2.0)
                if status == 200:
                    out = {**json.loads(raw), **out}
                    break
            except (ConnectionError, TimeoutError, ValueError):
                continue
    return web.json_response(out)


def _kvgate_version() -> str:
    try:
        return metadata.version("kvgate")
    except metadata.PackageNotFoundError:
        return "unknown"


async def list_models(request: web.Request) -> web.Response:
    request.app[COMPLETIONS].admission.identify(request.headers, x_api_key=True)  # 401 when auth is on, as vLLM's
    data = []
    replica_set = request.app[REPLICAS]
    for model, replicas in sorted(replica_set.models().items()):
        entry: dict[str, Any] = {"id": model, "object": "model", "created": 0, "owned_by": "kvgate"}
        base = replica_set.base_model(model)
        if base != model:  # a LoRA adapter, deduplicated across the replicas that have it loaded
            entry["parent"], entry["root"] = base, next(r.adapters[model] for r in replicas)
        lens = [r.max_model_len for r in replicas if r.max_model_len]
        if lens:
            entry["max_model_len"] = min(lens)
        data.append(entry)
    served = {entry["id"]: entry for entry in data}
    for alias, target in sorted(request.app[COMPLETIONS].aliases.items()):
        if target in served and alias not in served:  # another name of a served model: its entry, renamed
            data.append({**served[target], "id": alias, "root": served[target].get("root", target)})
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def readiness(app: web.Application) -> dict[str, Any]:
    """/ready's answer: ready once every known model has a routable replica that answers whole requests (a prefill
    replica of a split model serves nothing alone) and no tokenizer the cache-aware router waits for is loading;
    with each model's count of routable replicas and each replica's state."""
    now = time.monotonic()
    models: dict[str, dict[str, Any]] = {}
    serving: set[str] = set()  # the models with a routable replica that answers whole requests
    for replica in app[REPLICAS]:
        entry = models.setdefault(replica.model or "?", {"ready": 0, "replicas": {}})
        ok = replica.routable(now)
        entry["ready"] += int(ok)
        if ok and replica.role != "prefill":
            serving.add(replica.model or "?")
        entry["replicas"][replica.id] = {
            "ready": ok,
            "healthy": replica.healthy,
            "warm": replica.warm,
            "draining": replica.draining,
            "breaker_open": replica.breaker_open(now),
            "in_flight": replica.in_flight,
        }
    # an engine whose model is not known yet (not reached, not an engine) is listed, but keeps the gateway from
    # ready only while no model is known at all
    served = [name for name in models if name != "?"]
    ready = bool(served) and all(name in serving for name in served)
    cache = app.get(CACHE)
    loading = cache.tokenizers_loading() if cache is not None else []
    state: dict[str, Any] = {"ready": ready and not loading, "models": models}
    if loading:  # the first cache-aware request would wait for them
        state["tokenizers_loading"] = loading
    return state


def check_observability(request: web.Request) -> None:
    """Raise unless this request may see /metrics and /ready's detail (`server.metrics_access`): 401 without the
    admin key, 404 when none is configured. `auto` follows admission.auth as it runs now (a reload may switch it)."""
    cfg = request.app[CONFIG]
    access = cfg.server.metrics_access
    if access == "admin" or (access == "auto" and request.app[ADMISSION].config.auth):
        check_admin(request.headers, cfg.admin.key)


async def ready(request: web.Request) -> web.Response:
    state = readiness(request.app)
    status = 200 if state["ready"] else 503
    try:
        check_observability(request)
    except GatewayError:  # a load balancer's probe: the verdict, not the pool's inventory
        return web.json_response({"ready": state["ready"]}, status=status)
    return web.json_response(state, status=status)


async def metrics(request: web.Request) -> web.Response:
    check_observability(request)
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_routes(app: web.Application) -> None:
    """Every route of the gateway's one server."""
    max_body, ids = app[CONFIG].server.max_body_bytes, app[IDS]

    def note(request: web.Request, request_id: str, err: GatewayError) -> None:
        path = request.match_info.route.resource.canonical if request.match_info.route.resource else None
        refused(
            app[CONFIG].server.access_log, app[METRICS].requests, request_id, endpoint_label(path), err.status,
            err.code, time.monotonic(),
        )  # fmt: skip

    expect = expect_handler(max_body, ids, note)
    for endpoint in ENDPOINTS:
        expects = expect if endpoint.api == "openai" else expect_handler(max_body, ids, note, endpoint.api)
        app.router.add_route(endpoint.method, endpoint.path, _endpoint_handler(endpoint), expect_handler=expects)
    app.router.add_post(ABORT_PATH, abort_requests, expect_handler=expect)
    app.router.add_get(REALTIME_PATH, realtime, expect_handler=expect)
    app.router.add_get("/version", version, expect_handler=expect)
    app.router.add_get("/v1/models", list_models, expect_handler=expect)
    app.router.add_get("/health", health, expect_handler=expect)
    app.router.add_get("/ready", ready, expect_handler=expect)
    app.router.add_get("/metrics", metrics, expect_handler=expect)
    admin.add_routes(app, expect)  # /admin/*: reload, drain, restart, rolling restart, scale
