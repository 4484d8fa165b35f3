"""aiohttp front of the simulated engine: vLLM's OpenAI server endpoints plus ``/sim/*`` test hooks.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or SSE), ``GET /v1/models``, ``GET /health``,
``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``, ``POST /v1/embeddings`` (deterministic vectors),
``POST /v1/audio/transcriptions`` and ``/translations`` (multipart; the text describes the file received),
``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's Messages API as vLLM serves it:
`simengine.messages`), ``GET /load``, ``GET /version``, ``POST /reset_prefix_cache``, ``GET /sim/stats``,
``GET|POST /sim/faults``. Errors are OpenAI-shaped (Anthropic-shaped on the Messages API). The ``X-Request-Id``
request header is echoed on every response. Handlers are cancelled when the client disconnects
(``handler_cancellation=True``), which is how a dropped request stops generating.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from simengine import messages
from simengine.config import Faults, SimConfig
from simengine.engine import OverloadedError, SimEngine, SimFaultError
from simengine.kv_events import KVEventPublisher
from simengine.protocol import (
    GenRequest,
    Kind,
    OpenAIError,
    ResponseWriter,
    bad_request,
    chat_tokens,
    check_model,
    dumps,
    error_body,
    parse_generation,
    prompt_tokens,
    responses_messages,
    usage,
)
from simengine.tokenize import detokenize, tokenize_text

SIM_VERSION = "0.0.0+kvgate.sim"
ENGINE_KEY = web.AppKey("sim_engine", SimEngine)
_DONE = b"data: [DONE]\n\n"


def _json(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=dumps)


def _error(status: int, message: str, err_type: str | None = None) -> web.Response:
    return _json(error_body(status, message, err_type or HTTPStatus(status).phrase.replace(" ", "") + "Error"), status)


async def _body(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors_mw(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except OpenAIError as exc:
        request.app[ENGINE_KEY].note_rejected()
        return _json(exc.body(), exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.reason)


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    rid = request.headers.get("X-Request-Id")
    if rid is not None:
        response.headers["X-Request-Id"] = rid
    for name, value in request.app[ENGINE_KEY].config.response_headers.items():
        response.headers.setdefault(name, value)
    traceparent = request.headers.get("traceparent")
    if traceparent is not None:  # what vLLM would parent its request spans on (--otlp-traces-endpoint)
        request.app[ENGINE_KEY].traceparents.append(traceparent)


# --- generation ----------------------------------------------------------------------------------------------
async def _generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    req = parse_generation(kind, await _body(request), engine.config, engine.adapters)
    if not engine.cache.can_ever_fit(len(req.tokens) + req.max_tokens):
        raise bad_request(
            f"prompt + max_tokens ({len(req.tokens) + req.max_tokens} tokens) exceeds the KV cache "
            f"({engine.config.num_blocks} blocks of {engine.config.block_size})",
            "max_tokens",
        )
    hashes = engine.cache.block_hashes(req.tokens)
    writer = ResponseWriter(req, engine.new_id("chatcmpl" if kind == "chat" else "cmpl"))
    engine.in_flight += 1
    try:
        if req.stream:
            return await _stream(request, engine, req, hashes, writer)
        parts: list[str] = []

        async def collect(words: Sequence[str], cached: int) -> None:
            parts.extend(words)

        res = await engine.generate(req.tokens, hashes, req.max_tokens, collect, save_kv=req.remote_decode)
        answer = writer.full("".join(parts), usage(res.prompt_tokens, res.completion_tokens, res.cached_tokens))
        if req.remote_decode and engine.transfer is not None:  # as vLLM's connector answers a prefill step
            answer["kv_transfer_params"] = {"do_remote_prefill": True, "remote_engine_id": engine.config.model}
        return _json(answer)
    except SimFaultError as exc:
        return _error(500, f"simulated engine failure: {exc}", "InternalServerError")
    except OverloadedError as exc:
        return _error(503, str(exc), "ServiceUnavailableError")
    finally:
        engine.in_flight -= 1


async def _stream(
    request: web.Request, engine: SimEngine, req: GenRequest, hashes: Sequence[int], writer: ResponseWriter
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
    prompt_len = len(req.tokens)
    sent = 0
    stalled = False
    interval, role_first = engine.config.stream_interval, engine.config.role_in_first_token
    pending: list[str] = []  # tokens held for the next event (stream_interval > 1)
    role_due = role_first  # the role still to be sent with a token

    async def emit(words: Sequence[str], cached: int) -> None:
        nonlocal sent, stalled, role_due
        out: list[str] = []
        if not resp.prepared:  # first byte only once the request runs: faults and queueing precede it
            await resp.prepare(request)
            out.append(writer.first_event(prompt_len, role_first))
        for word in words:
            sent += 1
            pending.append(word)
            last = sent == req.max_tokens
            if len(pending) >= interval or last:
                use = usage(prompt_len, sent, cached) if req.continuous_usage else None
                out.append(writer.token_event("".join(pending), last, use, with_role=role_due))
                pending.clear()
                role_due = False
        if not out:
            return
        await resp.write("".join(out).encode())
        faults = engine.faults
        if faults.cut_after_tokens is not None and sent >= faults.cut_after_tokens and request.transport:
            request.transport.abort()  # what a killed engine's socket does
            raise ConnectionResetError("injected cut")
        if faults.stall_after_tokens is not None and sent >= faults.stall_after_tokens and not stalled:
            stalled = True  # once per stream, also when the fault is set while the stream runs
            await asyncio.sleep(faults.stall_s)

    res = await engine.generate(req.tokens, hashes, req.max_tokens, emit)
    tail = writer.usage_event(usage(prompt_len, res.completion_tokens, res.cached_tokens)) if req.include_usage else ""
    await resp.write(tail.encode() + _DONE)
    await resp.write_eof()
    return resp


async def anthropic_messages(request: web.Request) -> web.StreamResponse:
    return await messages.create(request, request.app[ENGINE_KEY])


async def anthropic_count_tokens(request: web.Request) -> web.StreamResponse:
    return await messages.count_tokens(request, request.app[ENGINE_KEY])


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


# --- everything else ---------------------------------------------------------------------------------------------
async def _json_object(request: web.Request) -> tuple[SimEngine, dict[str, Any], str]:
    """The engine, the request's JSON object and the model it names (404 for another model)."""
    engine = request.app[ENGINE_KEY]
    body = await _body(request)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return engine, body, check_model(body, engine.config, engine.adapters)


async def tokenize(request: web.Request) -> web.Response:
    engine, body, _ = await _json_object(request)
    if "messages" in body:
        tokens = chat_tokens(body)
    elif isinstance(body.get("prompt"), str):
        tokens = prompt_tokens(body, allow_ids=False)
    else:
        raise bad_request("send either 'prompt' (a string) or 'messages'", "prompt")
    return _json({"count": len(tokens), "max_model_len": engine.config.max_model_len, "tokens": tokens})


EMBEDDING_DIM = 8


async def embeddings(request: web.Request) -> web.Response:
    """OpenAI's embeddings: one vector per input string, a deterministic function of its tokens (unit length)."""
    _, body, model = await _json_object(request)
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
    return _json({"object": "list", "model": model, "data": data, "usage": usage})


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
    return _json({"text": f"{len(data)} bytes, sum {sum(data) % 65536}", "usage": {"type": "duration", "seconds": 1}})


RESPONSES = web.AppKey("sim_responses", dict)  # stored responses of this engine (bounded below)


async def responses(request: web.Request) -> web.StreamResponse:
    """OpenAI's Responses API as vLLM serves it: `instructions` and `input` (a string or message items) rendered
    by the chat template after the conversation of `previous_response_id` (stored here: 404 when this engine does
    not hold it), prefix-cached as chat is; the answer is stored here, as vLLM stores it where it ran. Streamed as
    `response.created`, `response.output_text.delta` per token and `response.completed` events."""
    engine, body, model = await _json_object(request)
    stored = request.app[RESPONSES]
    previous = body.get("previous_response_id")
    history: list[dict[str, Any]] = []
    if previous is not None:
        if previous not in stored:
            raise OpenAIError(404, f"Response with id '{previous}' not found.", "NotFoundError", "previous_response_id")
        history = list(stored[previous]["_messages"])
    messages = history + responses_messages(body)
    tokens = chat_tokens({"messages": messages})
    max_tokens = int(body.get("max_output_tokens") or 8)
    rid = engine.new_id("resp")
    words: list[str] = []
    stream = body.get("stream") is True
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})

    def event(kind: str, payload: dict[str, Any]) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n".encode()

    async def emit(new: Sequence[str], cached: int) -> None:
        words.extend(new)
        if stream:
            if not resp.prepared:
                await resp.prepare(request)
                await resp.write(event("response.created", {"response": {"id": rid, "status": "in_progress"}}))
            await resp.write(b"".join(event("response.output_text.delta", {"delta": w}) for w in new))

    try:
        res = await engine.generate(tokens, engine.cache.block_hashes(tokens), max_tokens, emit)
    except SimFaultError as exc:
        return _error(500, f"simulated engine failure: {exc}", "InternalServerError")
    except OverloadedError as exc:
        return _error(503, str(exc), "ServiceUnavailableError")
    text = "".join(words)
    answer = {
        "id": rid, "object": "response", "model": model, "status": "completed",
        "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}],
        "usage": {
            "input_tokens": res.prompt_tokens, "output_tokens": res.completion_tokens,
            "total_tokens": res.prompt_tokens + res.completion_tokens,
            "input_tokens_details": {"cached_tokens": res.cached_tokens},
        },
    }  # fmt: skip
    stored[rid] = {**answer, "_messages": [*messages, {"role": "assistant", "content": text}]}
    while len(stored) > 1000:
        stored.pop(next(iter(stored)))
    if not stream:
        return _json(answer)
    await resp.write(event("response.completed", {"response": answer}))
    await resp.write_eof()
    return resp


async def _ignore(words: Sequence[str], cached: int) -> None:
    return None


async def stored_response(request: web.Request) -> web.Response:
    answer = request.app[RESPONSES].get(request.match_info["response_id"])
    if answer is None:
        raise OpenAIError(404, "Response not found", "NotFoundError", "response_id")
    if request.path.endswith("/cancel"):
        answer["status"] = "cancelled"
    return _json({k: v for k, v in answer.items() if k != "_messages"})


async def detokenize_handler(request: web.Request) -> web.Response:
    _, body, _ = await _json_object(request)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("'tokens' must be a list of integers", "tokens")
    try:
        return _json({"prompt": detokenize(tokens)})
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
    return _json({"object": "list", "data": [card, *adapters]})


async def load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's runtime LoRA API (VLLM_ALLOW_RUNTIME_LORA_UPDATING): the adapter's folder must exist (vLLM reads its
    weights: a missing one fails at once); loading takes `lora_load_ms`; a name already loaded is refused as vLLM
    refuses it."""
    engine = request.app[ENGINE_KEY]
    body = await _body(request)
    name, path = (body.get("lora_name"), body.get("lora_path")) if isinstance(body, dict) else (None, None)
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        return _error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
    if name in engine.adapters:
        return _error(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
    if not await asyncio.to_thread(os.path.isdir, path):
        return _error(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
    await asyncio.sleep(engine.config.lora_load_ms / 1000)
    engine.adapters[name] = path
    engine.stats.lora_loads += 1
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await _body(request)
    name = body.get("lora_name") if isinstance(body, dict) else None
    if not isinstance(name, str) or name not in engine.adapters:
        return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
    del engine.adapters[name]
    engine.stats.lora_unloads += 1
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def health(request: web.Request) -> web.Response:
    return web.Response(status=503 if request.app[ENGINE_KEY].faults.fail_health else 200)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[ENGINE_KEY].render_metrics()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def load(request: web.Request) -> web.Response:
    return _json({"server_load": request.app[ENGINE_KEY].in_flight})


async def version(request: web.Request) -> web.Response:
    return _json({"version": SIM_VERSION})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    if not request.app[ENGINE_KEY].reset_prefix_cache():
        return _error(409, "blocks are in use by running requests", "ConflictError")
    return web.Response(status=200)


async def sim_stats(request: web.Request) -> web.Response:
    return _json(request.app[ENGINE_KEY].stats_dict())


async def sim_faults(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if request.method == "POST":
        body = await _body(request)
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        try:
            engine.set_faults(Faults.model_validate(engine.faults.model_dump() | body))
        except ValidationError as exc:
            raise bad_request(f"invalid faults: {exc.errors(include_url=False)}") from exc
    return _json(engine.faults.model_dump())


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
