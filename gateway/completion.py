"""The two OpenAI completion endpoints, implemented once for both servers (aiohttp routes and the fast path).

Per request: identify the tenant (401) -> read and validate the body (400/404/413) -> cache salt -> prefix info
for routing -> admission (429/503) -> forward with retries (`gateway.proxy`) -> usage, metrics, access log.
Every answer, errors included, goes out through a `Responder`; errors are rendered by `gateway.errors`.
The client leaving cancels the task running `handle` (both servers do this), which aborts the engine request.
`begin_now` is the same flow up to the first attempt without a coroutine, for the fast lane (`gateway.lane`);
`handle(begun=...)` takes over from wherever it stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from engine_pool.replica_set import ReplicaSet
from gateway.accesslog import log_access
from gateway.admission.auth import Identity
from gateway.admission.controller import AdmissionController, Ticket
from gateway.config import GatewayConfig
from gateway.context import RequestContext
from gateway.errors import GatewayError, NotFound, render_error
from gateway.metrics import GatewayMetrics
from gateway.proxy import Attempt, UpstreamProxy
from gateway.request_parse import Endpoint, ParsedRequest, parse_request
from gateway.responder import Responder
from gateway.router import Router
from policies.base import RequestInfo
from policies.prefix.state import CacheAwareState

log = logging.getLogger("kvgate.gateway")

ReadBody = Callable[[], Awaitable[bytes]]


@dataclass(slots=True)
class Begun:
    """A request `CompletionService.begin_now` took as far as it could without a coroutine."""

    ctx: RequestContext
    identity: Identity
    parsed: ParsedRequest
    raw: bytes
    salted: bool
    info: RequestInfo | None = None  # None: the cache hooks compute it (a coroutine)
    ticket: Ticket | None = None  # admitted
    first: Attempt | None = None  # its first attempt, started
    error: GatewayError | None = None  # refused by admission, or admitted and no replica could take it


class CompletionService:
    def __init__(
        self,
        config: GatewayConfig,
        metrics: GatewayMetrics,
        admission: AdmissionController,
        replicas: ReplicaSet,
        router: Router,
        proxy: UpstreamProxy,
        cache: CacheAwareState | None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.admission = admission
        self.replicas = replicas
        self.router = router
        self.proxy = proxy
        self.cache = cache
        self._session_header = config.cache.session_header.lower()
        self._access_log = config.server.access_log

    def begin_now(self, endpoint: Endpoint, headers: Mapping[str, str], raw: bytes, request_id: str) -> Begun | None:
        """`handle`'s steps without a coroutine, as far as they go (the fast path's common case: all of them up to
        the first attempt). None when the request has an error to answer before admission: nothing was done then,
        and `handle` meets the error again. Otherwise `handle(begun=...)` goes on from where this stopped: the
        prefix info to compute (cache hooks), admission to wait for (`Begun.ticket` None: the queue or a remote quota
        store), or the first attempt, started (`Begun.first`); `Begun.error` when admission refused the request or no
        replica could take it."""
        ctx = RequestContext(request_id, endpoint, time.monotonic())
        admission = self.admission
        try:
            identity = admission.identify(headers)
            parsed = parse_request(endpoint, raw)
            if not self.replicas.for_model(parsed.model):
                return None
            salted = admission.apply_cache_salt(identity, parsed.body)
        except Exception:  # an error to answer: `handle` meets it again and answers it
            return None
        ctx.tenant, ctx.model, ctx.stream = identity.tenant, parsed.model, parsed.stream
        begun = Begun(ctx, identity, parsed, raw, salted)
        begun.info = info = self.router.plain_info(parsed.model, identity.tenant, headers.get(self._session_header))
        if info is None:
            return begun
        try:
            begun.ticket = admission.admit_now(identity, parsed.model, len(raw) // 4, ctx)
            if begun.ticket is not None:
                begun.first = self.proxy.start(parsed, info, ctx, raw, salted)
        except GatewayError as err:
            begun.error = err
        except Exception:  # a bug: the request still ends as `handle` ends it, with a 500
            log.exception("unhandled error starting %s (request %s)", endpoint, request_id)
            begun.error = GatewayError("internal gateway error")
        return begun

    async def handle(
        self,
        endpoint: Endpoint,
        headers: Mapping[str, str],
        body: bytes | ReadBody,
        request_id: str,
        out: Responder,
        begun: Begun | None = None,
    ) -> None:
        """Answer one request through `out`; returns once the whole response was handed to the server.
        `headers` is looked up by lower-case name (aiohttp's case-insensitive headers, or the fast path's
        `RawHeaders`); `body` is the request body, or a coroutine function reading it. `begun`: the request
        as `begin_now` left it."""
        ctx = RequestContext(request_id, endpoint, time.monotonic()) if begun is None else begun.ctx
        admission = self.admission
        info: RequestInfo | None = None if begun is None else begun.info
        try:
            if begun is None:
                identity = admission.identify(headers)  # 401 before anything else when auth is on
                ctx.tenant = identity.tenant
                raw = body if isinstance(body, bytes) else await body()
                parsed = parse_request(endpoint, raw)
                if not self.replicas.for_model(parsed.model):  # metrics label only known models: bounded cardinality
                    raise NotFound(f"the model {parsed.model!r} does not exist", param="model")
                ctx.model, ctx.stream = parsed.model, parsed.stream
                salted = admission.apply_cache_salt(identity, parsed.body)
                ticket, first = None, None
            else:
                identity, parsed, raw, salted = begun.identity, begun.parsed, begun.raw, begun.salted
                ticket, first = begun.ticket, begun.first
                if begun.error is not None and ticket is None:
                    raise begun.error  # refused by admission
            model = parsed.model
            if info is None:
                session_key = headers.get(self._session_header)
                info = self.router.plain_info(model, identity.tenant, session_key) or await self.router.request_info(
                    model=model, endpoint=endpoint, body=parsed.body, tenant=identity.tenant, session_key=session_key
                )
            if ticket is None:
                prompt_estimate = info.prompt_tokens or len(raw) // 4
                ticket = admission.admit_now(identity, model, prompt_estimate, ctx) or await admission.admit(
                    identity, model, prompt_estimate, ctx
                )
            try:
                if begun is not None and begun.error is not None:
                    raise begun.error  # admitted, and then no replica could take it
                ctx.status = await self.proxy.forward(out, parsed, info, ctx, raw, salted, first)
            finally:
                if not admission.finish_now(ticket, ctx):
                    await admission.finish(ticket, ctx)
        except GatewayError as err:
            await self._error(err, ctx, out)
        except ConnectionResetError:  # a write found the client gone
            self.client_left(ctx)
        except Exception:
            if out.started:
                raise
            log.exception("unhandled error in %s (request %s)", endpoint, request_id)
            await self._error(GatewayError("internal gateway error"), ctx, out)
        except BaseException:  # cancelled: the client left (or shutdown)
            self.client_left(ctx)
            raise
        finally:
            self.done(ctx, info)

    def done(self, ctx: RequestContext, info: RequestInfo | None) -> None:
        """A request's end, however it ended: the cache state learns what was cached, metrics, the access log."""
        if info is not None and self.cache is not None:
            self.cache.on_finished(info, ctx.replica, ctx.cached_tokens if ctx.status == 200 else None)
        ctx.duration_s = time.monotonic() - ctx.started
        self._observe(ctx)
        if self._access_log != "off":
            log_access(ctx, self._access_log)

    def client_left(self, ctx: RequestContext) -> None:
        if ctx.delivered:  # the client had every event and left before the chunked terminator: a success
            ctx.status = 200
        else:
            ctx.status, ctx.client_disconnected = 499, True
            self.metrics.model(ctx.model).cancelled.value += 1

    async def _error(self, err: GatewayError, ctx: RequestContext, out: Responder) -> None:
        ctx.status, ctx.error = err.status, err.code
        for name, value in ctx.extra_headers.items():
            err.headers.setdefault(name, value)
        status, headers, body = render_error(err, request_id=ctx.request_id)
        await out.send(status, headers, body)

    def _observe(self, ctx: RequestContext) -> None:
        status = str(ctx.status)
        self.metrics.requests.labels(ctx.model, ctx.replica, ctx.endpoint, status).inc()
        self.admission.metrics.tenant(ctx.tenant).requests(status).inc()
        if ctx.status == 200:
            m = self.metrics.model(ctx.model)
            if ctx.ttft_s is not None:
                m.ttft.observe(ctx.ttft_s)
            if ctx.duration_s is not None:
                m.e2e.observe(ctx.duration_s)
            if ctx.prompt_tokens:
                m.prompt.value += ctx.prompt_tokens
            if ctx.cached_tokens:
                m.cached.value += ctx.cached_tokens
            if ctx.completion_tokens:
                m.completion.value += ctx.completion_tokens
