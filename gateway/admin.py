"""Admin HTTP endpoints (`/admin/...`): reload the configuration; list replicas, drain, restart, rolling
restart, scale.

Authenticated by `Authorization: Bearer <admin.key>` (constant-time comparison); when `admin.key` is unset every
admin route answers 404. Operations run as tasks the pool owns (a client that disconnects does not cancel a rolling
restart half way); `?wait=false` answers 202 at once instead of waiting for the result.

    POST /admin/reload                            re-read the config file (empty body) or swap the admission section
    GET  /admin/replicas                          every replica (managed and attached) with its state
    POST /admin/replicas/{id}/drain               drain then stop a managed replica
    POST /admin/replicas/{id}/restart             drain, stop, relaunch (also revives a failed replica)
    POST /admin/models/{model}/rolling-restart    one replica at a time, never below N-1 ready
    POST /admin/models/{model}/scale              body {"replicas": n}; removal drains first
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from engine_pool.pool import EnginePool
from engine_pool.slots import PoolError, UnknownReplica
from gateway.admission.auth import check_admin
from gateway.admission.config import AdmissionConfig
from gateway.body import ExpectHandler, read_body
from gateway.config_load import format_validation_error
from gateway.errors import BadRequest, GatewayError, NotFound
from gateway.keys import CONFIG, CONFIG_SOURCE, POOL, REPLICAS
from gateway.reload import RELOADER

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_OPS = web.AppKey("admin_operations", set[asyncio.Task[Any]])


class Conflict(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


def _pool(request: web.Request) -> EnginePool:
    pool = request.app.get(POOL)
    if pool is None:
        raise Conflict("no engine pool is configured: kvgate drains, restarts and scales only the engines it launched")
    return pool


def _admin(handler: Handler) -> Handler:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        check_admin(request.headers, request.app[CONFIG].admin.key)
        try:
            return await handler(request)
        except UnknownReplica as exc:
            raise NotFound(f"no managed replica {exc.args[0]!r}", param="id", code="replica_not_found") from None
        except PoolError as exc:
            raise Conflict(str(exc)) from None

    return wrapped


async def _operation(request: web.Request, name: str, coro: Coroutine[Any, Any, Any]) -> web.Response:
    """Run `coro` as a task the app owns; wait for it unless `?wait=false`."""
    task = asyncio.create_task(coro, name=f"admin:{name}")
    ops = request.app[_OPS]
    ops.add(task)
    task.add_done_callback(ops.discard)
    if request.query.get("wait", "true").lower() in ("0", "false", "no"):
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
        return web.json_response({"operation": name, "status": "started"}, status=202)
    started = time.monotonic()
    result = await asyncio.shield(task)
    return web.json_response(
        {"operation": name, "status": "done", "result": result, "seconds": round(time.monotonic() - started, 3)}
    )


@_admin
async def list_replicas(request: web.Request) -> web.Response:
    pool = request.app.get(POOL)
    managed = {s.id: s.describe() for s in pool.slots()} if pool is not None else {}
    now = time.monotonic()
    out = []
    for replica in request.app[REPLICAS]:
        entry: dict[str, Any] = {
            "id": replica.id,
            "model": replica.model,
            "url": replica.url,
            "managed": replica.managed,
            "role": replica.role,
            "dp_rank": replica.dp_rank,
            "routable": replica.routable(now),
            "healthy": replica.healthy,
            "warm": replica.warm,
            "draining": replica.draining,
            "in_flight": replica.in_flight,
        }
        entry.update(managed.pop(replica.id, {}))
        out.append(entry)
    out.extend(managed.values())  # managed replicas not (or no longer) in the routing set
    return web.json_response({"replicas": out})


@_admin
async def drain(request: web.Request) -> web.Response:
    pool, rid = _pool(request), request.match_info["id"]
    pool.slot(rid)
    return await _operation(request, f"drain {rid}", _state(pool.drain(rid), "stopped"))


@_admin
async def restart(request: web.Request) -> web.Response:
    pool, rid = _pool(request), request.match_info["id"]
    pool.slot(rid)
    return await _operation(request, f"restart {rid}", _state(pool.restart_one(rid, reason="admin"), "ready"))


@_admin
async def rolling_restart(request: web.Request) -> web.Response:
    pool, model = _pool(request), request.match_info["model"]
    if model not in pool.models:
        raise NotFound(f"no pool model {model!r}", param="model")
    return await _operation(request, f"rolling-restart {model}", pool.rolling_restart(model))


@_admin
async def scale(request: web.Request) -> web.Response:
    pool, model = _pool(request), request.match_info["model"]
    if model not in pool.models:
        raise NotFound(f"no pool model {model!r}", param="model")
    try:
        body = json.loads(await read_body(request, request.app[CONFIG].server) or b"{}")
    except ValueError:
        raise BadRequest('body must be JSON: {"replicas": n}') from None
    n = body.get("replicas") if isinstance(body, dict) else None
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= pool.config.max_replicas:
        raise BadRequest(f"'replicas' must be an integer in [0, {pool.config.max_replicas}]", param="replicas")
    return await _operation(request, f"scale {model} {n}", pool.scale(model, n))


async def reload_config(request: web.Request) -> web.Response:
    """An empty body re-reads the config file the gateway was started with (file + environment, like SIGHUP) and
    applies what can change without a restart (gateway.reload), answering what was applied and what needs a
    restart; a JSON body changes the `admission` section (`{"admission": {...}}` or the section itself): each key it
    gives replaces the running one (`tenants`: the whole tenant table), the keys it leaves out keep their running
    values. Invalid input changes nothing and answers 400 with the path-qualified reason. In-flight and queued
    requests are not touched."""
    check_admin(request.headers, request.app[CONFIG].admin.key)
    reloader = request.app[RELOADER]
    raw = await read_body(request, request.app[CONFIG].server)
    try:
        if raw.strip():
            running = reloader.running.admission
            section = _admission_keys(json.loads(raw))
            admission = AdmissionConfig.model_validate(running.model_dump() | section)
            result = await reloader.apply(reloader.running.model_copy(update={"admission": admission}))
        elif request.app.get(CONFIG_SOURCE) is not None:
            result = await reloader.reload_file()
        else:
            raise BadRequest("no config file to re-read: send the admission section as the JSON body")
    except ValueError as exc:
        message = format_validation_error(exc, "admission") if isinstance(exc, ValidationError) else str(exc)
        raise BadRequest(message) from None
    admission = reloader.running.admission
    return web.json_response({
        "reloaded": True, "tenants": sorted(admission.tenants), "auth": admission.auth, "applied": result.applied,
        "restart_needed": result.restart_needed, "engines_added": result.engines_added,
        "engines_removed": result.engines_removed, "engines_changed": result.engines_changed,
    })  # fmt: skip


def _admission_keys(data: Any) -> dict[str, Any]:
    """The admission keys a reload body changes; ValueError for anything else."""
    if isinstance(data, dict) and "admission" in data:
        if other := sorted(set(data) - {"admission"}):
            raise ValueError(f"only the admission section can be sent here, not {other}: reload the file for those")
        data = data["admission"]
    if not isinstance(data, dict):
        raise ValueError("the body must be a JSON object: the admission keys to change")
    return data


async def _state(awaitable: Awaitable[Any], wanted: str) -> str:
    """The state an operation left its replica in; Conflict (409) when it is not the one it was for (a restart
    that ended failed, or stopped by another command)."""
    state = str(await awaitable)
    if state != wanted:
        raise Conflict(f"the replica ended {state}, not {wanted}", code=f"replica_{state}")
    return state


async def _ops_ctx(app: web.Application) -> AsyncIterator[None]:
    app[_OPS] = set()
    yield
    ops: set[asyncio.Task[Any]] = app[_OPS]
    tasks = list(ops)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def add_routes(app: web.Application, expect: ExpectHandler) -> None:
    app.cleanup_ctx.append(_ops_ctx)
    app.router.add_post("/admin/reload", reload_config, expect_handler=expect)
    app.router.add_get("/admin/replicas", list_replicas, expect_handler=expect)
    app.router.add_post("/admin/replicas/{id}/drain", drain, expect_handler=expect)
    app.router.add_post("/admin/replicas/{id}/restart", restart, expect_handler=expect)
    app.router.add_post("/admin/models/{model}/rolling-restart", rolling_restart, expect_handler=expect)
    app.router.add_post("/admin/models/{model}/scale", scale, expect_handler=expect)
