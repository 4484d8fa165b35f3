"""The one request path, top to bottom, for every endpoint of the route table (`gateway.endpoints`).

Per request: identify the tenant (401) -> read and validate the body (400/404/408/413) -> cache salt -> prefix info
for routing -> admission slot (429/503; an async context manager that always releases) -> route and forward with
retries before the first byte (`gateway.proxy`) -> relay -> record (usage, metrics, access log, what the cache
learns). Every answer, errors included, goes out through the request's `Responder`; errors are rendered by
`gateway.errors`. The client leaving cancels the handler's task, which aborts the engine request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping

from aiohttp import web

from cacheindex.state import CacheAwareState
from engine_pool.http_client import VIA
from engine_pool.replica import Replica
from engine_pool.replica_set import ReplicaSet
from gateway.accesslog import log_access
from gateway.adapters import AdapterLoader
from gateway.admission.controller import AdmissionController, Demand
from gateway.body import read_body
from gateway.config import GatewayConfig, ModelsConfig
from gateway.context import AUDIO_BYTES_PER_S, AUDIO_TOKENS_PER_S, RequestContext
from gateway.endpoints import Endpoint
from gateway.errors import BadRequest, GatewayError, NotFound, Overloaded, error_event, render_error
from gateway.exchange import Exchange
from gateway.fleet import RoutingShare
from gateway.ids import valid_request_id
from gateway.metrics import GatewayMetrics
from gateway.migration import Relayed, migratable
from gateway.proxy import UpstreamProxy
from gateway.request_parse import ParsedRequest, engine_body, multipart_with_model, parse_multipart, parse_request
from gateway.responder import Responder
from gateway.router import Router
from gateway.tracing import Tracer, valid_traceparent
from policies.base import RequestInfo

log = logging.getLogger("kvgate.gateway")

# a model's 503s that send its requests on to a fallback (models.fallbacks); others (quota store down, the tenant's
# own queue bound) would refuse the fallback too
_NO_CAPACITY = frozenset(
    {"no_ready_replica", "queue_full", "queue_wait", "queue_timeout", "engines_not_discovered", "latency_target"}
)
HELD_MAX = 100_000  # stored responses remembered (id -> replica), least recently used dropped first


class ResponseHolders:
    """Which replica created which stored response (vLLM keeps a response where it ran): a bounded LRU map, and,
    with other gateways (`fleet`), their record in Redis for a call that comes through another gateway."""

    def __init__(self, replicas: ReplicaSet, shared: RoutingShare | None) -> None:
        self.replicas = replicas
        self.shared = shared
        self._held: OrderedDict[str, str] = OrderedDict()

    def record(self, response_id: str, replica_id: str, *, share: bool = True) -> None:
        self._held[response_id] = replica_id
        self._held.move_to_end(response_id)
        if len(self._held) > HELD_MAX:
            self._held.popitem(last=False)
        if share and self.shared is not None:
            self.shared.publish_response(response_id, replica_id)

    async def get(self, response_id: str) -> Replica | None:
        replica_id = self._held.get(response_id)
        if replica_id is None and self.shared is not None:
            replica_id = await self.shared.response_replica(response_id)
            if replica_id is not None:
                self.record(response_id, replica_id, share=False)
        return None if replica_id is None else self.replicas.get(replica_id)


_TRACESTATE = 512  # W3C's bound on what a vendor must pass on of a tracestate


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
        shared: RoutingShare | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.admission = admission
        self.replicas = replicas
        self.router = router
        self.proxy = proxy
        self.cache = cache
        self.holders = ResponseHolders(replicas, shared)
        self.adapters = AdapterLoader(replicas, metrics, config.models)
        self.set_models(config.models)
        self.tracer = tracer
        sessions = config.cache
        self._session_headers = tuple(h.lower() for h in (sessions.session_header, *sessions.agent_session_headers))
        self._access_log = config.server.access_log
        # the models the configuration names: one with no replica now is unavailable (503), not unknown (404)
        pool = config.pool.models if config.pool is not None else []
        self._configured = {m.served for m in pool} | {e.model for e in config.engines if e.model}
        self._running: set[asyncio.Task[object]] = set()  # the handlers' tasks of requests in flight
        self._drained = asyncio.Event()  # set once shutting down and none is in flight
        self._shutting_down = False
        self._cut = False  # shutdown's grace is over: requests still in flight are ended (`cut`)

    def session_key(self, headers: Mapping[str, str]) -> str | None:
        """The first session header the request carries (`cache.session_header`, then the agents' own:
        `cache.agent_session_headers`); None without one (then the body's `user`, where the cache reads it)."""
        for name in self._session_headers:
            if value := headers.get(name):
                return value
        return None

    def set_models(self, models: ModelsConfig) -> None:
        """Aliases, fallbacks and the adapters loaded on demand (at start and on a config reload)."""
        self.aliases: Mapping[str, str] = models.aliases
        self._fallbacks: Mapping[str, list[str]] = models.fallbacks
        self.adapters.configure(models)

    async def handle(self, request: web.Request, endpoint: Endpoint, request_id: str) -> web.StreamResponse:
        """Answer one request; returns the response for aiohttp to finish (a stream is already written)."""
        ctx = RequestContext(
            request_id, endpoint.name, time.monotonic(), api=endpoint.api, computed=endpoint.computes_kv
        )
        traceparent = request.headers.get("traceparent")
        if self.tracer is not None:
            ctx.trace = self.tracer.begin(traceparent)
        if ctx.trace is None and traceparent is not None and valid_traceparent(traceparent):
            ctx.client_traceparent = traceparent  # not traced here (off, or not sampled): passed on as it came
        if traceparent is not None and (state := request.headers.get("tracestate")) and len(state) <= _TRACESTATE:
            ctx.client_tracestate = state
        out = Responder(request)
        admission = self.admission
        info: RequestInfo | None = None
        task = asyncio.current_task()
        assert task is not None
        self._running.add(task)
        try:
            headers = request.headers
            try:
                identity = admission.identify(headers, x_api_key=endpoint.api == "anthropic")  # 401 first (auth on)
            except GatewayError:
                ctx.refused_at = time.monotonic()  # where its trace's admission span ends
                raise
            ctx.tenant = identity.tenant
            raw, parsed, holder = await self._read(request, endpoint)
            named = parsed.body.get("request_id")  # vLLM names the request by the header, else by this
            if isinstance(named, str) and "x-request-id" not in headers and valid_request_id(named):
                ctx.request_id = named  # so the engine's id is the client's (an abort finds the rollout)
            if (target := self.aliases.get(parsed.model)) is not None:
                if endpoint.body == "multipart":  # the form's field too: the engine reads the model there
                    raw = multipart_with_model(raw, parsed.content_type, target)
                    parsed.body["model"] = target  # (the form, not a JSON body, is what goes on)
                parsed.model = target
            chain = [parsed.model, *(self._fallbacks.get(parsed.model, ()) if holder is None else ())]
            # metrics label only known models (bounded cardinality); a model with fallbacks or of the adapter
            # catalog is a configured name
            loadable = parsed.model in self.adapters.catalog  # a LoRA adapter kvgate loads on demand: not unknown
            if len(chain) == 1 and not loadable and not self.replicas.for_model(parsed.model):
                if self.replicas.undiscovered():  # an engine not reached yet may serve it: ask again soon
                    raise Overloaded(
                        f"the model {parsed.model!r} is not served by any engine reached so far",
                        code="engines_not_discovered",
                    )
                if parsed.model in self._configured:  # scaled to 0, every replica removed: it comes back
                    raise Overloaded(f"no replica of model {parsed.model!r} is running", code="no_ready_replica")
                raise NotFound(f"the model {parsed.model!r} does not exist", param="model")
            ctx.model, ctx.stream = parsed.model, parsed.stream
            salted = endpoint.body != "multipart" and admission.apply_cache_salt(identity, parsed.body)
            kind, routed_body = endpoint.body, parsed.body  # what routing reads: a chat view where there is one
            if endpoint.view is not None and (view := endpoint.view(parsed.body)) is not None:
                kind, routed_body = endpoint.view_kind, view
            for i, model in enumerate(chain):
                if i:  # the previous model had no capacity: its fallback, as if asked for
                    self.metrics.fallbacks.labels(chain[0], model).inc()
                    ctx.extra_headers["x-kvgate-fallback"] = f"{chain[0]} -> {model}"
                    parsed.model = ctx.model = model
                try:
                    if model in self.adapters.catalog:  # loaded first (models.dynamic_lora); no replica: a fallback
                        await self.adapters.ensure(model)
                except Overloaded as err:
                    if i + 1 == len(chain) or err.code not in _NO_CAPACITY:
                        raise
                    continue
                info = await self.router.request_info(
                    model=model,
                    endpoint=kind,
                    body=routed_body,
                    tenant=identity.tenant,
                    # a route that computes no KV (count_tokens, render, tokenize) neither binds a session nor
                    # follows one
                    session_key=self.session_key(headers) if kind in ("chat", "completions") else None,
                )
                demand, tokens = None, 0  # counting a prompt, reading a stored response: no tokens, no targets
                if ctx.computed:
                    demand = Demand(info, parsed.max_tokens, admission.latency.targets(identity, model, headers))
                    tokens = info.prompt_tokens or _estimate(endpoint, raw)
                try:
                    async with admission.slot(identity, model, tokens, ctx, demand):
                        ctx.status = await self.proxy.forward(
                            self._exchange(out, request, endpoint, parsed, info, ctx, raw, salted, holder)
                        )
                    break
                except Overloaded as err:
                    if i + 1 == len(chain) or out.started or err.code not in _NO_CAPACITY:
                        raise
        except GatewayError as err:
            await self._error(err, ctx, out)
        except ConnectionResetError:  # a write found the client gone
            self.client_left(ctx)
        except Exception:
            if out.started:
                raise
            log.exception("unhandled error in %s (request %s)", endpoint.path, request_id)
            await self._error(GatewayError("internal gateway error"), ctx, out)
        except asyncio.CancelledError:  # the client left, or shutdown's grace is over (`cut`)
            if not self._cut:
                self.client_left(ctx)
                raise
            task.uncancel()
            await self._shut(ctx, out, done=endpoint.body in ("chat", "completions"))
        except BaseException:
            self.client_left(ctx)
            raise
        finally:
            self._running.discard(task)
            if self._shutting_down and not self._running:
                self._drained.set()
            self.done(ctx, info)
        if out.response is None:  # the client left before anything could be sent: nothing will be
            return web.Response(status=499)
        return out.response

    def _exchange(
        self,
        out: Responder,
        request: web.Request,
        endpoint: Endpoint,
        parsed: ParsedRequest,
        info: RequestInfo,
        ctx: RequestContext,
        raw: bytes,
        salted: bool,
        holder: Replica | None,
    ) -> Exchange:
        retry = self.config.retry
        relayed = None
        if retry.migrate_streams and parsed.stream and migratable(parsed):
            relayed = Relayed(retry.migration_buffer_bytes)
        # the running usage a migration counts from: chat's and completions' (a Messages stream counts its deltas)
        data = engine_body(parsed, raw, salted=salted, usage_stats=relayed is not None and parsed.kind != "json")
        deadline = time.monotonic() + self.config.timeouts.total_s
        # the target as sent, in origin form (RFC 9112 3.2.2: an absolute-form one's authority is not the engine's)
        path = request.raw_path if request.raw_path.startswith("/") else request.url.raw_path_qs
        ex = Exchange(out, request.method, path, parsed, info, ctx, data, deadline, holder, relayed)
        ex.gated = ctx.computed
        if endpoint.records_id and parsed.stream:  # GET, cancel, resume reach its replica while it runs or after
            ex.on_answer_id = lambda response_id: self.holders.record(response_id, ctx.replica)
        for name in endpoint.forward_headers:
            if (value := request.headers.get(name)) is not None:
                ex.forward[name] = value
        if VIA in request.headers:  # the gateways before this one (the client adds this one): a loop through several
            ex.forward[VIA] = ", ".join(request.headers.getall(VIA))  # is refused where it closes
        return ex

    async def _read(self, request: web.Request, endpoint: Endpoint) -> tuple[bytes, ParsedRequest, Replica | None]:
        """The body as sent, what kvgate reads of it, and the replica the request must go to (a stored response's
        holder, also for a response that continues one: `previous_response_id`), by the endpoint's body kind
        (`gateway.endpoints`)."""
        holder = None
        if endpoint.body == "held":  # a stored response: only the replica that created it has it
            raw, holder = b"", await self.holders.get(request.match_info["response_id"])
            if holder is None or holder.model is None:
                raise NotFound("no replica is known to hold this response", code="response_not_found")
            stream = request.method == "GET" and request.query.get("stream") == "true"  # a background response's
            parsed = ParsedRequest("held", {}, holder.model, stream, True, None)  # events, relayed as they come
        elif endpoint.body == "multipart":
            raw = await read_body(request, self.config.server, json=False)
            parsed = parse_multipart(raw, request.headers.get("Content-Type", ""))
        else:
            server = self.config.server
            raw = await read_body(request, server, json=False)  # (its nesting checked as it is decoded)
            parsed = parse_request(
                endpoint.body, raw, max_depth=server.max_json_depth, model_optional=endpoint.model_optional
            )
            previous = parsed.body.get("previous_response_id") if endpoint.records_id else None
            if isinstance(previous, str):  # a conversation stored on one replica continues there
                holder = await self.holders.get(previous)
        parsed.records_id, parsed.api = endpoint.records_id, endpoint.api
        if not parsed.model:
            parsed.model = self.only_model()
        return raw, parsed, holder

    def only_model(self) -> str:
        """The model a request without one means: the pool's only model; 400 when it serves several."""
        bases = {self.replicas.base_model(name) for name in self.replicas.models()}  # adapters belong to a base
        if not bases and self.replicas.undiscovered():  # as for a model named before its engine answered
            raise Overloaded("no engine has been reached yet", code="engines_not_discovered")
        if len(bases) != 1:
            raise BadRequest("'model' is required: this gateway serves several models", param="model")
        return next(iter(bases))

    def done(self, ctx: RequestContext, info: RequestInfo | None) -> None:
        """A request's end, however it ended: the cache state learns what was cached, metrics, the access log."""
        if info is not None and self.cache is not None:
            # a split request's cached tokens are the handed-over KV, not the prefix the index predicted
            reported = ctx.cached_tokens if ctx.status == 200 and not ctx.split else None
            self.cache.on_finished(info, ctx.replica, reported, ctx.tool_call and ctx.status == 200)
        if ctx.answer_id is not None and ctx.status == 200:
            self.holders.record(ctx.answer_id, ctx.replica)
        ctx.duration_s = time.monotonic() - ctx.started
        self._observe(ctx)
        if self._access_log != "off":
            log_access(ctx, self._access_log)
        if ctx.trace is not None and self.tracer is not None:
            self.tracer.finish(ctx)

    @property
    def in_flight(self) -> int:
        """Requests being handled now, from their head's arrival to their answer's end."""
        return len(self._running)

    async def drain(self, grace_s: float) -> None:
        """Shutdown (the listener no longer accepts): the requests in flight get up to `grace_s` to finish, then
        those left are ended (`cut`)."""
        self._shutting_down = True
        if self._running:
            log.info("shutting down: %d requests in flight, waiting up to %g s", len(self._running), grace_s)
            try:
                async with asyncio.timeout(grace_s):
                    await self._drained.wait()
            except TimeoutError:
                pass
        self.cut()

    def cut(self) -> None:
        """End every request still in flight: a stream gets an error event (`shutting_down`) and its end, a request
        not answered yet 503 with Retry-After (Anthropic's routes: 529); each engine request is aborted."""
        self._shutting_down = self._cut = True
        if self._running:
            log.warning("shutting down: ending %d requests still in flight", len(self._running))
        for task in list(self._running):
            task.cancel()

    async def _shut(self, ctx: RequestContext, out: Responder, *, done: bool) -> None:
        """`done`: a chat or completions stream (ended with `[DONE]` after its error event)."""
        err = Overloaded("the gateway is shutting down: retry on another instance", code="shutting_down")
        try:
            if not out.started:
                await self._error(err, ctx, out)
                return
            if not ctx.answered:  # a stream the client has not had whole: said so, never a clean end
                ctx.status, ctx.error = err.status, err.code
                await out.write(error_event(err, ctx.api, done=done))
            await out.end()
        except ConnectionResetError:
            self.client_left(ctx)

    def client_left(self, ctx: RequestContext) -> None:
        if ctx.answered:  # the client had every event and left before the chunked terminator: a success
            ctx.status = 200
        else:
            ctx.status, ctx.client_disconnected = 499, True
            self.metrics.model(ctx.model).cancelled.value += 1

    async def _error(self, err: GatewayError, ctx: RequestContext, out: Responder) -> None:
        for name, value in ctx.extra_headers.items():
            err.headers.setdefault(name, value)
        status, headers, body = render_error(err, request_id=ctx.request_id, api=ctx.api)
        ctx.status, ctx.error = status, err.code  # the status the client got (the API's own for no capacity)
        await out.send(status, headers, body)

    def _observe(self, ctx: RequestContext) -> None:
        status = str(ctx.status)
        self.metrics.requests.labels(ctx.model, ctx.replica, ctx.endpoint, status).inc()
        self.admission.metrics.tenant(ctx.tenant).requests(status).inc()
        if ctx.model == "-" or not ctx.computed:  # refused before its model was known, or no engine work: no figures
            return
        m = self.metrics.model(ctx.model)
        # the latencies of what an engine computed: a time to first token where tokens came (not a count, a render
        # or an embedding), an end-to-end latency where a prompt was computed or tokens came
        completion = ctx.delivered_tokens()
        if ctx.ttft_s is not None and completion:  # its first token reached the client, stayed or not for the rest
            m.ttft.observe(ctx.ttft_s)
        if ctx.status == 200 and (completion or ctx.prompt_tokens):
            if ctx.ttft_s is not None and ctx.prefill_done_at is not None:
                self.metrics.handover.labels(ctx.model).observe(ctx.started + ctx.ttft_s - ctx.prefill_done_at)
            if ctx.duration_s is not None:
                m.e2e.observe(ctx.duration_s)
        # the tokens the engines worked for, as the tenant is charged them (a cut stream: those it delivered)
        if ctx.prompt_tokens:
            m.prompt.value += ctx.prompt_tokens
        if hits := ctx.cache_hits():
            m.cached.value += hits
        if completion:
            m.completion.value += completion


def _estimate(endpoint: Endpoint, raw: bytes) -> int:
    """The prompt tokens of a request the prefix index does not read, until its usage says: an audio upload's
    encoder positions at the most bytes per second audio takes, anything else's a token per 4 bytes."""
    if endpoint.body == "multipart":
        return len(raw) * AUDIO_TOKENS_PER_S // AUDIO_BYTES_PER_S
    return len(raw) // 4
