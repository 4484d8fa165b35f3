"""The Anthropic Messages API of the simulated engine, as vLLM serves it (`vllm/entrypoints/anthropic/`).

``POST /v1/messages`` (JSON or SSE) and ``POST /v1/messages/count_tokens``. The request is turned into chat messages
the way vLLM does (top-level `system` first, text blocks, `tool_use` as an assistant turn whose calls the simulator's
template does not render, `tool_result` in a user message as a `tool` message before it, images dropped: the
simulator has no vision and its template renders text only) and tokenized with the simulator's chat template, so a
Messages prompt caches as the chat prompt it stands for. Answers in Anthropic's shape, as vLLM writes them: usage
with `input_tokens` the uncached prompt tokens and `cache_read_input_tokens` the cached ones; a stream is
`message_start` (the prompt's usage without its cache split: vLLM builds it from the first chunk's usage, which
has no prompt details yet), `content_block_start`, one `content_block_delta` per token,
`content_block_stop`, `message_delta` (stop reason and usage), `message_stop`. With `tool_choice` `{"type": "any"}`
(the first of `tools`) or `{"type": "tool", "name": ...}` the answer is that tool's call instead of text, as vLLM's
guided tool choice makes it: a `tool_use` block whose input is `{"input": "<the generated text>"}` (streamed as
`input_json_delta` pieces), stop reason `tool_use`. Errors are Anthropic-shaped
(`{"type": "error", "error": {"type", "message"}}`). The `cut_after_tokens` fault aborts a stream's connection as
for chat. Written independently of the gateway (it imports nothing of the product). Cost: O(body) per request.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from simengine.engine import OverloadedError, SimEngine, SimFaultError
from simengine.protocol import OpenAIError, check_model
from simengine.tokenize import tokenize_chat

_BILLING = "x-anthropic-billing-header"
_TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "api_error", 503: "overloaded_error"}
_BLOCK_TYPES = {"text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking"}


class MessagesError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error(status: int, message: str) -> web.Response:
    body = {"type": "error", "error": {"type": _TYPES.get(status, "api_error"), "message": message}}
    return web.json_response(body, status=status)


def _text(content: Any, where: str) -> str:
    """A system prompt's text: a string, or its text blocks joined (Claude Code's billing header left out)."""
    if isinstance(content, str):
        return "" if content.startswith(_BILLING) else content
    if not isinstance(content, list):
        raise MessagesError(400, f"{where}: must be a string or a list of blocks")
    return "".join(
        b["text"]
        for b in content
        if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        and b["text"] and not b["text"].startswith(_BILLING)
    )  # fmt: skip


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages vLLM renders for a Messages body (text content only: what the simulator's template
    renders); MessagesError(400) on a malformed body."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise MessagesError(400, "messages: must be a non-empty list")
    out: list[dict[str, Any]] = []
    if body.get("system") is not None and (system := _text(body["system"], "system")):
        out.append({"role": "system", "content": system})
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ("user", "assistant", "system"):
            raise MessagesError(400, f"messages.{i}.role: must be 'user', 'assistant' or 'system'")
        content = msg.get("content")
        if role == "system":
            if text := _text(content, f"messages.{i}.content"):
                out.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise MessagesError(400, f"messages.{i}.content: must be a string or a list of blocks")
        texts: list[str] = []
        parts = 0  # content parts vLLM keeps (text and images); a user message without any is dropped
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in _BLOCK_TYPES:
                raise MessagesError(400, f"messages.{i}.content: unknown block type {kind!r}")
            assert isinstance(block, dict)
            if kind == "text" and isinstance(block.get("text"), str) and block["text"]:
                texts.append(block["text"])
                parts += 1
            elif kind == "image" and block.get("source"):
                parts += 1
            elif kind == "tool_result" and role == "user":
                out.extend(_tool_messages(block.get("content")))
            elif kind == "tool_result":
                result = block.get("content")
                texts.append(f"Tool result: {str(result) if result else ''}")
                parts += 1
        if parts or role == "assistant":
            out.append({"role": role, "content": "".join(texts)})
    return out


def _tool_messages(result: Any) -> list[dict[str, Any]]:
    """A user's tool_result: a tool message (its text items joined by newlines), then an empty user message for its
    images and an empty tool message for its tool references, as vLLM adds them (rendered without them here)."""
    if not isinstance(result, list):
        return [{"role": "tool", "content": result if isinstance(result, str) else ""}]
    items = [item for item in result if isinstance(item, dict)]
    text = "\n".join(str(item.get("text", "")) for item in items if item.get("type") == "text")
    out: list[dict[str, Any]] = [{"role": "tool", "content": text}]
    if any(item.get("type") == "image" for item in items):
        out.append({"role": "user", "content": ""})
    if any(item.get("type") == "tool_reference" and (item.get("tool_name") or item.get("name")) for item in items):
        out.append({"role": "tool", "content": ""})
    return out


def forced_tool(body: dict[str, Any]) -> str | None:
    """The tool a Messages request makes the model call (`tool_choice` any: the first of `tools`; tool: the named
    one); None when the model may answer in text."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not isinstance(tools, list) or not tools or not isinstance(choice, dict):
        return None
    if choice.get("type") == "any":
        name = tools[0].get("name") if isinstance(tools[0], dict) else None
    elif choice.get("type") == "tool":
        name = choice.get("name")
    else:
        return None
    if not isinstance(name, str) or not name:
        raise MessagesError(400, "tool_choice: a forced tool call needs a tool name")
    return name


def _usage(prompt: int, completion: int, cached: int) -> dict[str, int]:
    return {"input_tokens": prompt - cached, "output_tokens": completion, "cache_read_input_tokens": cached}


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, separators=(',', ':'))}\n\n".encode()


def _block(tool: str | None, call_id: str, text: str | None) -> dict[str, Any]:
    """The answer's content block: its text, or the forced tool's call with the text as its input (None: the block
    as a stream opens it, empty)."""
    if tool is None:
        return {"type": "text", "text": text or ""}
    return {"type": "tool_use", "id": call_id, "name": tool, "input": {} if text is None else {"input": text}}


def _json_delta(piece: str) -> bytes:
    return _event("content_block_delta", {"index": 0, "delta": {"type": "input_json_delta", "partial_json": piece}})


async def _read(request: web.Request, engine: SimEngine) -> tuple[dict[str, Any], str]:
    engine.anthropic_headers.append(
        (request.headers.get("anthropic-version", ""), request.headers.get("anthropic-beta", ""))
    )
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MessagesError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise MessagesError(400, "the request body must be a JSON object")
    try:
        model = check_model(body, engine.config, engine.adapters)
    except OpenAIError as exc:
        raise MessagesError(exc.status, exc.message) from None
    return body, model


async def count_tokens(request: web.Request, engine: SimEngine) -> web.Response:
    try:
        body, _ = await _read(request, engine)
        tokens = tokenize_chat(chat_messages(body))
    except MessagesError as exc:
        return error(exc.status, exc.message)
    n = len(tokens)
    return web.json_response({"input_tokens": n, "context_management": {"original_input_tokens": n}})


async def create(request: web.Request, engine: SimEngine) -> web.StreamResponse:
    try:
        body, model = await _read(request, engine)
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise MessagesError(400, "max_tokens: must be a positive integer")
        stream = body.get("stream", False)
        if stream is not None and not isinstance(stream, bool):
            raise MessagesError(400, "stream: must be a boolean")
        tool = forced_tool(body)
        tokens = tokenize_chat(chat_messages(body))
        if len(tokens) >= engine.config.max_model_len:
            raise MessagesError(400, f"the prompt ({len(tokens)} tokens) exceeds max_model_len")
    except MessagesError as exc:
        engine.note_rejected()
        return error(exc.status, exc.message)
    max_tokens = min(max_tokens, engine.config.max_model_len - len(tokens))
    rid = engine.new_id("chatcmpl")
    call_id = "toolu_" + rid.removeprefix("chatcmpl-")
    hashes = engine.cache.block_hashes(tokens)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
    words: list[str] = []
    sent = 0

    async def emit(new: Sequence[str], cached: int) -> None:
        nonlocal sent
        words.extend(new)
        if not stream:
            return
        out: list[bytes] = []
        if not resp.prepared:
            await resp.prepare(request)
            message: dict[str, Any] = {"id": rid, "type": "message", "role": "assistant", "content": [], "model": model,
                       "stop_reason": None, "stop_sequence": None,
                       "usage": {"input_tokens": len(tokens), "output_tokens": 0}}  # fmt: skip
            out.append(_event("message_start", {"message": message}))
            out.append(_event("content_block_start", {"index": 0, "content_block": _block(tool, call_id, None)}))
            if tool is not None:
                out.append(_json_delta('{"input":"'))
        for word in new:
            sent += 1
            if tool is None:
                out.append(_event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": word}}))
            else:
                out.append(_json_delta(json.dumps(word)[1:-1]))
        await resp.write(b"".join(out))
        cut = engine.faults.cut_after_tokens
        if cut is not None and sent >= cut and request.transport:
            request.transport.abort()  # what a killed engine's socket does
            raise ConnectionResetError("injected cut")

    engine.in_flight += 1
    try:
        res = await engine.generate(tokens, hashes, max_tokens, emit)
    except SimFaultError as exc:
        return error(500, f"simulated engine failure: {exc}")
    except OverloadedError as exc:
        return error(503, str(exc))
    finally:
        engine.in_flight -= 1
    use = _usage(res.prompt_tokens, res.completion_tokens, res.cached_tokens)
    stop = "max_tokens" if tool is None else "tool_use"
    if not stream:
        content = [_block(tool, call_id, "".join(words))]
        answer = {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
                  "stop_reason": stop, "stop_sequence": None, "usage": use}  # fmt: skip
        return web.json_response(answer)
    tail = [
        *([_json_delta('"}')] if tool is not None else []),
        _event("content_block_stop", {"index": 0}),
        _event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None}, "usage": use}),
        _event("message_stop", {}),
    ]
    if engine.faults.cut_before_end and request.transport:
        await resp.write(b"".join(tail[:-1]))
        request.transport.abort()
        raise ConnectionResetError("injected cut")
    await resp.write(b"".join(tail))
    await resp.write_eof()
    return resp
