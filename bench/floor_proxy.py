"""The floor of a Python gateway on kvgate's parts: what relaying alone costs, for the overhead benchmark to show
beside kvgate and sglang-router.

An aiohttp server on uvloop (kvgate's server) with one catch-all route that reads the body, picks the next engine
round-robin, sends the body through kvgate's engine client (`engine_pool.http_client`) and answers with the engine's
status and body (read whole), or relays its chunks as they come for `"stream": true`. No parsing, admission,
routing, metrics, access log or error handling: not a product, a measurement of what any gateway built on aiohttp
and this client pays before it does anything. Run: `python bench/floor_proxy.py --port P --engine URL [...]`.
"""

from __future__ import annotations

import argparse
import itertools
from urllib.parse import urlsplit

import uvloop
from aiohttp import web

from engine_pool.http_client import UpstreamClient, UpstreamPool

_MAX_ANSWER = 256 * 1024 * 1024  # the gateway's default server.max_answer_bytes
_JSON = {"Content-Type": "application/json"}


def app(engines: list[str]) -> web.Application:
    client = UpstreamClient()
    pools: list[UpstreamPool] = []
    for url in engines:
        parts = urlsplit(url)
        pools.append(client.pool(parts.hostname or "127.0.0.1", parts.port or 80))
    turn = itertools.cycle(pools)

    async def relay(request: web.Request) -> web.StreamResponse:
        if request.method == "GET":
            return web.Response(text="ok")
        body = await request.read()
        resp = await next(turn).request("POST", request.path, body, _JSON, connect_timeout_s=5.0)
        await resp.headers_ready
        if b'"stream": true' not in body and b'"stream":true' not in body:
            data = await resp.read(_MAX_ANSWER)
            resp.release()
            return web.Response(body=data, status=resp.status, headers=_JSON)
        out = web.StreamResponse(status=resp.status, headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        async for chunk in resp.iter_chunks():
            await out.write(chunk)
        resp.release()
        await out.write_eof()
        return out

    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", relay)
    return application


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--engine", action="append", required=True)
    args = p.parse_args()
    loop = uvloop.new_event_loop()
    web.run_app(app(args.engine), host="127.0.0.1", port=args.port, access_log=None, print=None, loop=loop)


if __name__ == "__main__":
    main()
