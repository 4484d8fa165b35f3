"""aiohttp front of the simulated engine: vLLM's OpenAI server endpoints plus ``/sim/*`` test hooks.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or SSE), ``GET /v1/models``, ``GET /health``,
``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``, ``POST /v1/embeddings`` (deterministic vectors),
``POST /v1/audio/transcriptions`` and ``/translations`` (multipart; the text describes the file received),
``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's Messages API as vLLM serves it:
`simengine.messages`), ``GET /load``, ``GET /version``, ``POST /reset_prefix_cache``, ``GET /sim/stats``,
``GET|POST /sim/faults``. Errors are OpenAI-shaped (Anthropic-shaped on the Messages API). The ``X-Request-Id``
request header is echoed on every response. Handlers are cancelled when the client disconnects
(``handler_cancellation=True``), which is how a dropped request stops generating.
Here: the app (routes, error middleware, response headers, the KV-event publisher's lifetime, `run_sim_engine`) and
the endpoints other than generation; chat, completions and the Responses API are `simengine.generation`, the
handlers' shared helpers (engine key, JSON and error replies) `simengine.web_common`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from simengine import messages, realtime
from simengine.config import Faults, SimConfig
from simengine.engine import SimEngine
from simengine.generation import (
    RESPONSES,
    chat_completions,
    completions,
    generate_tokens,
    responses,
    stored_response,
)
from simengine.kv_events import KVEventPublisher
from simengine.protocol import OpenAIError, bad_request, chat_tokens, check_model, prompt_tokens
from simengine.tokenize import detokenize, tokenize_text
from simengine.web_common import ENGINE_KEY, error_reply, json_object, json_reply, read_body

SIM_VERSION = "0.0.0+kvgate.sim"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors_mw(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except OpenAIError as exc:
        request.app[ENGINE_KEY].note_rejected()
        return json_reply(exc.body(), exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_reply(exc.status, exc.reason)


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    rid = request.headers.get("X-Request-Id")
    if rid is not None:
        response.headers["X-Request-Id"] = rid
        request.app[ENGINE_KEY].request_ids.append(rid)  # the name vLLM gives the request
    for name, value in request.app[ENGINE_KEY].config.response_headers.items():
        response.headers.setdefault(name, value)
    traceparent = request.headers.get("traceparent")
    if traceparent is not None:  # what vLLM would parent its request spans on (--otlp-traces-endpoint)
        request.app[ENGINE_KEY].traceparents.append(traceparent)
        if (tracestate := request.headers.get("tracestate")) is not None:
            request.app[ENGINE_KEY].tracestates.append(tracestate)


async def anthropic_messages(request: web.Request) -> web.StreamResponse:
    return await messages.create(request, request.app[ENGINE_KEY])


async def anthropic_count_tokens(request: web.Request) -> web.StreamResponse:
    return await messages.count_tokens(request, request.app[ENGINE_KEY])


# --- everything else ---------------------------------------------------------------------------------------------
async def tokenize(request: web.Request) -> web.Response:
    engine, body, _ = await json_object(request)
    if "messages" in body:
        tokens = chat_tokens(body)
    elif isinstance(body.get("prompt"), str):
        tokens = prompt_tokens(body, allow_ids=False)
    else:
        raise bad_request("send either 'prompt' (a string) or 'messages'", "prompt")
    return json_reply({"count": len(tokens), "max_model_len": engine.config.max_model_len, "tokens": tokens})


EMBEDDING_DIM = 8


async def embeddings(request: web.Request) -> web.Response:
    """OpenAI's embeddings: one vector per input string, a deterministic function of its tokens (unit length)."""
    _, body, model = await json_object(request)
    inputs = body.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or not all(isinstance(x, str) for x in inputs):
        raise bad_request("'input' must be a string or a non-empty list of strings", "input")
    data, total = [], 0
    for i, text in enumerate(inputs):
        tokens = tokenize_text(text)
        total += len(tokens)
        raw = [((sum(tokens) * (k + 1) + len(tokens) * 7919) % 1000) / 1000 - 0.5 for k in range(EMBEDDING_DIM)]
        norm = sum(x * x for x in raw) ** 0.5 or 1.0
        data.append({"object": "embedding", "index": i, "embedding": [x / norm for x in raw]})
    usage = {"prompt_tokens": total, "total_tokens": total}
    return json_reply({"object": "list", "model": model, "data": data, "usage": usage})


async def transcriptions(request: web.Request) -> web.Response:
    """OpenAI's audio transcription/translation form: the text is a description of the file received (its size
    and first bytes' checksum), so a test can tell the bytes arrived intact."""
    engine = request.app[ENGINE_KEY]
    form = await request.post()
    check_model({"model": form.get("model")}, engine.config, engine.adapters)
    upload = form.get("file")
    if not isinstance(upload, web.FileField):
        raise bad_request("'file' is required (a form file)", "file")
    data = upload.file.read()
    return json_reply(
        {"text": f"{len(data)} bytes, sum {sum(data) % 65536}", "usage": {"type": "duration", "seconds": 1}}
    )


async def detokenize_handler(request: web.Request) -> web.Response:
    _, body, _ = await json_object(request)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("'tokens' must be a list of integers", "tokens")
    try:
        return json_reply({"prompt": detokenize(tokens)})
    except ValueError as exc:
        raise bad_request(str(exc), "tokens") from exc


async def models(request: web.Request) -> web.Response:
    cfg = request.app[ENGINE_KEY].config
    card = {
        "id": cfg.model,
        "object": "model",
        "created": 0,
        "owned_by": "vllm",
        "root": cfg.model,
        "parent": None,
        "max_model_len": cfg.max_model_len,
        "permission": [],
    }
    loaded = request.app[ENGINE_KEY].adapters.items()
    adapters = [{**card, "id": name, "root": path, "parent": cfg.model, "max_model_len": None} for name, path in loaded]
    return json_reply({"object": "list", "data": [card, *adapters]})


async def load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's runtime LoRA API (VLLM_ALLOW_RUNTIME_LORA_UPDATING): the adapter's folder must exist (vLLM reads its
    weights: a missing one fails at once); loading takes `lora_load_ms`; a name already loaded is refused as vLLM
    refuses it."""
    engine = request.app[ENGINE_KEY]
    body = await read_body(request)
    name, path = (body.get("lora_name"), body.get("lora_path")) if isinstance(body, dict) else (None, None)
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        return error_reply(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
    if name in engine.adapters:
        return error_reply(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
    if not await asyncio.to_thread(os.path.isdir, path):
        return error_reply(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
    await asyncio.sleep(engine.config.lora_load_ms / 1000)
    engine.adapters[name] = path
    engine.stats.lora_loads += 1
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await read_body(request)
    name = body.get("lora_name") if isinstance(body, dict) else None
    if not isinstance(name, str) or name not in engine.adapters:
        return error_reply(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
    del engine.adapters[name]
    engine.stats.lora_unloads += 1
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def health(request: web.Request) -> web.Response:
    return web.Response(status=503 if request.app[ENGINE_KEY].faults.fail_health else 200)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[ENGINE_KEY].render_metrics()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def load(request: web.Request) -> web.Response:
    return json_reply({"server_load": request.app[ENGINE_KEY].in_flight})


async def version(request: web.Request) -> web.Response:
    return json_reply({"version": SIM_VERSION})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    if not request.app[ENGINE_KEY].reset_prefix_cache():
        return error_reply(409, "blocks are in use by running requests", "ConflictError")
    return web.Response(status=200)


async def sim_stats(request: web.Request) -> web.Response:
    return json_reply(request.app[ENGINE_KEY].stats_dict())


async def sim_faults(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if request.method == "POST":
        body = await read_body(request)
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        try:
            engine.set_faults(Faults.model_validate(engine.faults.model_dump() | body))
        except ValidationError as exc:
            raise bad_request(f"invalid faults: {exc.errors(include_url=False)}") from exc
    return json_reply(engine.faults.model_dump())


async def _kv_events_ctx(app: web.Application) -> AsyncIterator[None]:
    engine = app[ENGINE_KEY]
    cfg = engine.config
    if cfg.kv_events_port is None:
        yield
        return
    publisher = KVEventPublisher(
        host=cfg.host,
        port=cfg.kv_events_port,
        topic=cfg.kv_events_topic.encode(),
        replay_port=cfg.kv_events_replay_port,
    )
    await publisher.start()
    engine.attach_publisher(publisher)
    try:
        yield
    finally:
        await publisher.close()


def build_app(engine: SimEngine) -> web.Application:
    app = web.Application(middlewares=[_errors_mw], client_max_size=64 * 1024**2)
    app[ENGINE_KEY] = engine
    app[RESPONSES] = {}
    app.on_response_prepare.append(_echo_request_id)
    app.cleanup_ctx.append(_kv_events_ctx)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/inference/v1/generate", generate_tokens)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages", anthropic_messages)
    app.router.add_post("/v1/messages/count_tokens", anthropic_count_tokens)
    app.router.add_get("/v1/responses/{response_id}", stored_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", stored_response)
    app.router.add_post("/v1/audio/transcriptions", transcriptions)
    app.router.add_post("/v1/audio/translations", transcriptions)
    app.router.add_post("/detokenize", detokenize_handler)
    app.router.add_get("/load", load)
    app.router.add_get("/v1/realtime", realtime.realtime)
    if engine.config.runtime_lora:  # vLLM registers these only with VLLM_ALLOW_RUNTIME_LORA_UPDATING
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_get("/version", version)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/sim/stats", sim_stats)
    app.router.add_route("*", "/sim/faults", sim_faults)
    return app


@dataclass(frozen=True, slots=True)
class SimServer:
    """A running simulated engine: where it listens and its engine object (state, stats, `wait_until`)."""

    url: str
    port: int
    engine: SimEngine

    @property
    def kv_events_endpoint(self) -> str | None:
        pub = self.engine.publisher
        return pub.endpoint if pub is not None else None

    @property
    def kv_events_replay_endpoint(self) -> str | None:
        pub = self.engine.publisher
        return pub.replay_endpoint if pub is not None else None

    @property
    def kv_events_port(self) -> int | None:
        pub = self.engine.publisher
        return pub.bound_port if pub is not None else None


@asynccontextmanager
async def run_sim_engine(
    config: SimConfig | None = None, *, exit_fn: Callable[[int], object] = os._exit
) -> AsyncIterator[SimServer]:
    """Serve a simulated engine in the current event loop (``config.port`` 0 = any free port).

    ``exit_fn`` is what the ``crash_after`` fault calls (tests pass a recorder instead of `os._exit`).
    """
    cfg = config or SimConfig()
    engine = SimEngine(cfg, exit_fn=exit_fn)
    runner = web.AppRunner(build_app(engine), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, cfg.host, cfg.port)
        await site.start()
        port = int(runner.addresses[0][1])
        yield SimServer(url=f"http://{cfg.host}:{port}", port=port, engine=engine)
    finally:
        await runner.cleanup()
