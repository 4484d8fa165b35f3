"""`/v1/realtime`: vLLM's realtime transcription WebSocket (vLLM 0.32: `entrypoints/speech_to_text/realtime`),
proxied to one replica.

A session: the client asks to upgrade `GET /v1/realtime` (`?model=` as OpenAI's realtime clients name it, else the
pool's only model); the tenant is identified as for any request (401 before the upgrade), the upgrade checked (400
`invalid_websocket_handshake` before any engine is asked), and the session counted in the tenant's quotas as one
request, at once for its whole life (`max_concurrency`, `requests_per_minute`: 429); a replica of the model
is chosen by load (its routable replicas, the fewest requests and sessions in flight: a session holds its replica
for its whole life, counted in its in-flight load so routing, drains and gates see it); the engine's socket (a
data-parallel rank's with its `X-data-parallel-rank`) is opened before the client's is accepted, so no replica, a
full gateway or an engine that refuses is an HTTP answer in OpenAI's error shape (503 with Retry-After, or 502).
Then messages go both ways as they come, text and binary, until either side closes; the other side is closed with
the same code (one that no close frame may carry, an engine gone without one, as 1011).

Bounds: `server.realtime_max_sessions` open at once (one more gets 503 before the upgrade); a message over
`server.realtime_max_message_bytes` from either side closes both (1009, message too big); a session idle longer
than `server.keepalive_timeout_s` is closed, and so is one whose client (or engine) takes nothing sent to it for
`server.send_timeout_s` (1001; its session slot, replica load and quota freed); an engine that takes the connection
and never answers the upgrade is a 504 after `timeouts.first_byte_s`. On shutdown every session is closed with
1001 (going away) once new ones are refused. Cost: two relay tasks per session, one copy per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import HttpVersion11, WSCloseCode, WSMsgType, web

from engine_pool.http_client import VIA
from engine_pool.replica import Replica, rank_headers
from gateway.context import RequestContext
from gateway.errors import (
    BadRequest,
    GatewayError,
    NotFound,
    Overloaded,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from gateway.keys import COMPLETIONS, CONFIG, IDS, REPLICAS, REQUEST_ID

_Socket = web.WebSocketResponse | aiohttp.ClientWebSocketResponse
_NOT_SENDABLE = {1005, 1006, 1015}  # close codes a peer reports but no close frame may carry (RFC 6455 7.4.1)
PATH = "/v1/realtime"
REALTIME: web.AppKey[Realtime] = web.AppKey("realtime")


class Realtime:
    """The open sessions and the client that opens their engine sockets."""

    def __init__(self, http: aiohttp.ClientSession) -> None:
        self.http = http
        self.sessions: set[web.WebSocketResponse] = set()  # the clients' sockets, accepted
        self.opening = 0  # sessions being set up or open: what the bound counts

    async def close_all(self) -> None:
        for ws in list(self.sessions):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"gateway shutting down")


def _replica(request: web.Request, model: str) -> Replica:
    now = time.monotonic()
    replicas = [r for r in request.app[REPLICAS].for_model(model) if r.routable(now) and not r.pooling]
    if not replicas:
        raise Overloaded(f"no ready replica of model {model!r}", retry_after_s=1.0, code="no_ready_replica")
    return min(replicas, key=lambda r: (r.in_flight, r.id))


async def realtime(request: web.Request) -> web.StreamResponse:
    """One session, recorded as any request is (access log, `kvgate_requests_total{endpoint="realtime"}`): 101 for
    a session that was opened, the refusal's status for one that was not."""
    completions = request.app[COMPLETIONS]
    ctx = RequestContext(request[REQUEST_ID], "realtime", computed=False)  # its replica's load is its in-flight count
    try:
        response = await _session(request, ctx)
        ctx.status = 101
        return response
    except GatewayError as err:
        ctx.status, ctx.error = err.status, err.code
        raise
    except BaseException:  # cancelled: the client's connection closed (also at the end of an open session)
        ctx.status = 101 if ctx.answered else 499
        ctx.client_disconnected = not ctx.answered
        raise
    finally:
        completions.done(ctx, None)


async def _session(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    cfg, service = request.app[CONFIG].server, request.app[REALTIME]
    completions = request.app[COMPLETIONS]
    admission = completions.admission
    identity = admission.identify(request.headers, x_api_key=False)  # 401 first (auth on)
    ctx.tenant = identity.tenant
    client = web.WebSocketResponse(max_msg_size=cfg.realtime_max_message_bytes, autoping=True)
    if request.version < HttpVersion11 or not client.can_prepare(request).ok:  # before an engine socket is opened
        raise BadRequest(
            "a realtime session is a WebSocket upgrade: HTTP/1.1 with Upgrade: websocket, Connection: Upgrade, "
            "Sec-WebSocket-Version: 13 and a Sec-WebSocket-Key",
            code="invalid_websocket_handshake",
        )
    model = request.query.get("model") or completions.only_model()
    model = completions.aliases.get(model, model)
    if not request.app[REPLICAS].for_model(model):
        raise NotFound(f"the model {model!r} does not exist", param="model")
    # the tenant's quotas: a session is one of its requests (per minute) and at once (concurrency) for its life
    async with admission.slot(identity, model, 0, ctx):
        # no await from the bound's check to the session's count, nor from the replica's choice to its load
        if service.opening >= cfg.realtime_max_sessions:
            raise Overloaded("too many realtime sessions open", retry_after_s=1.0, code="realtime_sessions_full")
        replica = _replica(request, model)
        ctx.model, ctx.replica, ctx.route_reason = replica.model or model, replica.id, "least-load"
        started = replica.begin()
        service.opening += 1
        try:
            via = ", ".join([*request.headers.getall(VIA, ()), request.app[IDS].instance])  # as the client's requests
            handshake_s = request.app[CONFIG].timeouts.first_byte_s
            async with _engine_socket(service, replica, cfg.realtime_max_message_bytes, via, handshake_s) as upstream:
                await client.prepare(request)
                ctx.answered = True  # the session is open: however it ends, it was served
                service.sessions.add(client)
                try:
                    await _relay(client, upstream, cfg.keepalive_timeout_s, cfg.send_timeout_s)
                finally:
                    service.sessions.discard(client)
                return client
        finally:
            service.opening -= 1
            replica.end(started)


@contextlib.asynccontextmanager
async def _engine_socket(
    service: Realtime, replica: Replica, max_bytes: int, via: str, handshake_s: float
) -> AsyncIterator[aiohttp.ClientWebSocketResponse]:
    url = f"{replica.url}{PATH}"
    try:
        async with asyncio.timeout(handshake_s):  # an engine that takes the connection and never answers the upgrade
            upstream = await service.http.ws_connect(
                url, max_msg_size=max_bytes, autoping=True, headers=rank_headers(replica, {VIA: via})
            )
    except TimeoutError:
        raise UpstreamTimeout(f"replica {replica.id} did not answer the session's upgrade in time") from None
    except aiohttp.WSServerHandshakeError as exc:
        raise UpstreamError(f"replica {replica.id} refused the session: HTTP {exc.status}", status=502) from None
    except (aiohttp.ClientError, OSError) as exc:
        raise UpstreamUnavailable(f"replica {replica.id} unreachable: {exc}") from None
    try:
        yield upstream
    finally:
        await upstream.close()


async def _relay(
    client: web.WebSocketResponse, upstream: aiohttp.ClientWebSocketResponse, idle_s: float, send_s: float
) -> None:
    """Both directions until one side closes (or sends too big a message, or both stay idle past `idle_s`: 1001,
    or one takes nothing sent to it for `send_s`: 1001, its transport closed); the other side is then closed with
    the same code. A session busy in one direction is not idle."""
    last = [time.monotonic()]  # the last message either way

    async def pump(source: _Socket, sink: _Socket) -> int:
        while True:
            try:
                msg = await source.receive(timeout=max(0.01, last[0] + idle_s - time.monotonic()))
            except TimeoutError:
                if time.monotonic() - last[0] >= idle_s:  # nothing either way for idle_s
                    return WSCloseCode.GOING_AWAY
                continue
            last[0] = time.monotonic()
            if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):  # closed, or an error (too big: 1009)
                return source.close_code or WSCloseCode.OK
            try:
                async with asyncio.timeout(send_s):
                    await (sink.send_str(msg.data) if msg.type == WSMsgType.TEXT else sink.send_bytes(msg.data))
            except TimeoutError:  # the sink takes nothing: it is gone for this session
                return WSCloseCode.GOING_AWAY

    tasks = [asyncio.create_task(pump(client, upstream)), asyncio.create_task(pump(upstream, client))]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finished = done.pop()
        code = WSCloseCode.OK if finished.exception() is not None else finished.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if code in _NOT_SENDABLE:  # the other side vanished without a close frame: said as the server failing
        code = WSCloseCode.INTERNAL_ERROR
    for side in (client, upstream):
        if not side.closed:
            with contextlib.suppress(TimeoutError):  # aiohttp closes the transport of a close that times out
                async with asyncio.timeout(send_s):
                    await side.close(code=code)


async def realtime_ctx(app: web.Application) -> AsyncIterator[None]:
    """The sessions' client; on shutdown every open session closed with 1001."""
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0))
    service = app[REALTIME] = Realtime(http)

    async def going_away(_: web.Application) -> None:
        await service.close_all()

    app.on_shutdown.append(going_away)
    try:
        yield
    finally:
        await http.close()
