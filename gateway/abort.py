"""`POST /inference/v1/abort_requests`: vLLM's abort of token-in, token-out requests by id (RL rollout frameworks
cancel the rollouts they no longer need), through the gateway.

vLLM's body is `{"request_ids": ["generate-tokens-<id>", ...]}` (the ids its `/inference/v1/generate` gave them:
`<id>` is the request's `X-Request-Id`, which kvgate passes on as the client sent it, or the body's `request_id`),
and the engine answers 200 at once, aborting in the background; ids it does not run are ignored. A request's ids
may run on any replica, and an abort is rare, so kvgate sends the body to every engine that generates (each URL
once: a data-parallel engine's ranks share one API server, which aborts on all of them), at the same time, and
answers 200 when each accepted it. An engine without the route (started without `--enable-scale-out`: it runs no
such request) counts as accepted; one that fails or refuses makes the answer 502, naming it.
Authenticated as any request (tenant keys); cost: one round trip per engine URL, in parallel.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from gateway.body import read_body
from gateway.context import RequestContext
from gateway.errors import BadRequest, GatewayError, UpstreamError
from gateway.keys import COMPLETIONS, CONFIG, REPLICAS, REQUEST_ID, UPSTREAM

PATH = "/inference/v1/abort_requests"
_JSON = {"Content-Type": "application/json"}


async def abort_requests(request: web.Request) -> web.Response:
    """Recorded as any request is (access log, `kvgate_requests_total{endpoint="abort"}`)."""
    ctx = RequestContext(request[REQUEST_ID], "abort")
    try:
        response = await _abort(request, ctx)
        ctx.status = response.status
        return response
    except GatewayError as err:
        ctx.status, ctx.error = err.status, err.code
        raise
    finally:
        request.app[COMPLETIONS].done(ctx, None)


async def _abort(request: web.Request, ctx: RequestContext) -> web.Response:
    ctx.tenant = request.app[COMPLETIONS].admission.identify(request.headers, x_api_key=False).tenant  # 401 first
    raw = await read_body(request, request.app[CONFIG].server)
    try:
        body = json.loads(raw)
    except ValueError:
        raise BadRequest("the body is not valid JSON", code="invalid_json") from None
    ids = body.get("request_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise BadRequest("request_ids must be a list of request ids", param="request_ids")
    now = time.monotonic()
    urls = sorted({r.url for r in request.app[REPLICAS] if r.healthy and not r.pooling})
    if not urls:
        return web.Response(status=200)
    client, timeout_s = request.app[UPSTREAM], request.app[CONFIG].timeouts.connect_s + 5.0

    async def send(url: str) -> str | None:
        try:
            status, answer = await client.fetch("POST", url + PATH, raw, _JSON, timeout_s=timeout_s)
        except (ConnectionError, TimeoutError) as exc:
            return f"{url}: {exc!r}"
        return None if status in (200, 404) else f"{url}: HTTP {status} {answer[:200].decode(errors='replace')}"

    failed = [f for f in await asyncio.gather(*(send(u) for u in urls)) if f is not None]
    if failed:
        raise UpstreamError(f"the abort did not reach every engine ({time.monotonic() - now:.2f} s): {failed}")
    return web.Response(status=200)
