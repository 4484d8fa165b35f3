"""What the gateway reads in an engine's answers: errors, usage, the ids of stored responses.

Costs: `usage_of` parses only the usage object of a whole answer (a reverse search for `"usage"` and the braces
that close it; the whole answer only when that slice is not JSON: a string in it held a brace); `usage_event` parses
one SSE event, only those that carry usage; `answer_id` one JSON object; `ends_in_tool_call` one regex search of
an answer or event (run only for requests of a session). A continued stream's events (`gateway.migration`): the
running usage moved out of a token event by a few searches (`split_usage`, no parsing), a continuation's role
dropped (`without_role`, one event parsed) and its usage told as the whole answer's (`whole_usage`). One codec:
orjson.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from engine_pool.http_client import UpstreamResponse
from gateway.context import RequestContext
from gateway.errors import UpstreamError

# an answer (or stream event) that ends in a tool call: chat's finish_reason, the Messages API's stop_reason, a
# Responses output item of type function_call
_TOOL_CALL = re.compile(rb'"(?:finish|stop)_reason"\s*:\s*"(?:tool_calls|tool_use)"|"type"\s*:\s*"function_call"')


def ends_in_tool_call(data: bytes) -> bool:
    """The answer (or the stream event) says the model called a tool: the agent will be back with its result."""
    return _TOOL_CALL.search(data) is not None


_ERROR_BYTES = 1024 * 1024  # an engine's error body read at most (its message is cut at 1 KiB anyway)


async def upstream_error(upstream: UpstreamResponse) -> UpstreamError:
    """The engine's error answer as an OpenAI-shaped error (its own body when it has one), read within 5 s and
    `_ERROR_BYTES` (a longer one is not read on: the client gets the status alone)."""
    upstream.set_timeout(5.0)
    try:
        raw = await upstream.read(_ERROR_BYTES)
        body: Any = orjson.loads(raw)
    except (orjson.JSONDecodeError, TimeoutError, ConnectionError):
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        msg = str(body["error"].get("message", "upstream error"))
        return UpstreamError(msg, status=upstream.status, upstream_body=body)
    if isinstance(body, dict) and "message" in body:  # vLLM's older flat error shape
        wrapped: dict[str, object] = {
            "error": {
                "message": str(body["message"]),
                "type": str(body.get("type", "upstream_error")),
                "param": body.get("param"),
                "code": body.get("code", upstream.status),
            }
        }
        return UpstreamError(str(body["message"]), status=upstream.status, upstream_body=wrapped)
    if isinstance(body, dict) and "detail" in body:  # FastAPI's own errors (an unserved route's 404, a form's 422)
        detail = body["detail"]
        message = detail if isinstance(detail, str) else orjson.dumps(detail).decode()
        return UpstreamError(message[:1024], status=upstream.status)
    return UpstreamError(f"engine answered HTTP {upstream.status}", status=upstream.status)


def usage_event(event: bytes, ctx: RequestContext, strip_usage: bool, tokens_before: int = 0) -> bytes:
    """Record usage from a usage-carrying event; drop the final usage-only event unless the client asked. A
    continuation's usage (`tokens_before` delivered by earlier engines) is rewritten as the whole answer's."""
    try:
        payload = orjson.loads(event[event.index(b"{") :])
    except ValueError:  # no object, or not JSON (orjson's error is a ValueError)
        return event
    if isinstance(payload, dict) and isinstance(payload.get("response"), dict):  # the Responses API's events
        ctx.set_usage(payload["response"].get("usage"))
        return event
    if isinstance(payload, dict) and isinstance(payload.get("message"), dict):  # the Messages API's message_start
        ctx.set_usage(payload["message"].get("usage"))
        return event
    if not isinstance(payload, dict) or not isinstance(payload.get("usage"), dict):
        return event
    if tokens_before:
        payload["usage"] = whole_usage(payload["usage"], tokens_before, ctx.prompt_tokens)
        event = b"data: " + orjson.dumps(payload) + b"\n\n"
    ctx.set_usage(payload["usage"])
    if strip_usage and not payload.get("choices"):
        return b""
    return event


def answer_id(raw: bytes) -> str | None:
    """The `id` of a stored response: a whole answer's own, or the `response.id` of a stream's event."""
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if isinstance(payload, dict) and isinstance(payload.get("response"), dict):
        payload = payload["response"]
    found = payload.get("id") if isinstance(payload, dict) else None
    return found if isinstance(found, str) and len(found) <= 256 else None


def usage_of(raw: bytes) -> object:
    """The `usage` object of a completion response, parsing only that object rather than the whole body: its end
    is the brace that closes it (usage holds numbers and nested objects of numbers; anything else is read by the
    standard library's decoder from the object's start)."""
    idx = raw.rfind(b'"usage"')
    if idx < 0:
        return None
    start = raw.find(b"{", idx)
    if start < 0:
        return None
    end = raw.find(b"}", start)
    nested = raw.find(b"{", start + 1, end)
    while nested >= 0 and end >= 0:  # a nested object closes first: the usage object ends at a later brace
        nested = raw.find(b"{", nested + 1, end)
        end = raw.find(b"}", end + 1)
    try:
        return orjson.loads(raw[start : end + 1])
    except orjson.JSONDecodeError:
        pass
    try:
        whole = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return whole.get("usage") if isinstance(whole, dict) else None


def without_role(event: bytes) -> bytes:
    """A continuation's chat event without the assistant role the client already has: the field is removed and
    the event kept when it carries anything else (its first token, a finish reason); b"" when the role was all."""
    try:
        payload = orjson.loads(event[event.index(b"{") :])
        choices = payload["choices"]
    except (ValueError, KeyError, TypeError):
        return event
    kept = False
    for choice in choices if isinstance(choices, list) else ():
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict):
            delta.pop("role", None)
            kept = kept or any(v not in (None, "") for v in delta.values()) or choice.get("finish_reason") is not None
    if not kept and not payload.get("usage"):
        return b""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


_USAGE_KEY = b',"usage":'


def split_usage(event: bytes) -> tuple[bytes, bytes] | None:
    """A token event's usage (continuous usage stats): (the event without it, the usage object's bytes), by a few
    searches and no parsing, wherever the key stands (vLLM writes it last but for the first event's
    `prompt_token_ids` / `prompt_text`, which stay); None for any other shape, and for the final usage-only event (no
    choices), which is the answer's usage, not a running count."""
    cut = event.rfind(_USAGE_KEY)
    if cut < 0 or not event.endswith(b"}\n\n") or b'"choices":[]' in event:
        return None
    start = cut + len(_USAGE_KEY)
    end = _object_end(event, start)
    if end < 0 or event.find(b'"choices"', end) >= 0:
        return None
    return event[:cut] + event[end:], event[start:end]


def _object_end(data: bytes, start: int) -> int:
    """Where the JSON object (or null) at `start` ends, -1 if none does; objects without strings that hold braces,
    as usage is: each `{` met before the current closing `}` moves it to the next one."""
    if data.startswith(b"null", start):
        return start + 4
    if not data.startswith(b"{", start):
        return -1
    after, close = start + 1, data.find(b"}", start)
    while close >= 0 and (inner := data.find(b"{", after, close)) >= 0:
        after, close = inner + 1, data.find(b"}", close + 1)
    return close + 1 if close >= 0 else -1


def whole_usage(usage: dict[str, Any], tokens_before: int, prompt_tokens: int | None = None) -> dict[str, Any]:
    """A continuation's usage as the whole answer's: its prompt held the tokens delivered before. The completion
    count is exact; the prompt's is the first engine's (`prompt_tokens`, from its running usage or the Messages
    API's message_start), else the continuation's less those tokens (inexact: the continuation's prompt is rendered
    with the answer so far, and a BPE tokenizer may merge the text at the seam differently)."""
    out = dict(usage)
    if prompt_tokens is not None:
        out["prompt_tokens"] = prompt_tokens
    elif isinstance(out.get("prompt_tokens"), int):
        out["prompt_tokens"] = max(0, out["prompt_tokens"] - tokens_before)
    if isinstance(out.get("completion_tokens"), int):
        out["completion_tokens"] += tokens_before
    if isinstance(out.get("prompt_tokens"), int) and isinstance(out.get("completion_tokens"), int):
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    details = out.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        out["prompt_tokens_details"] = {**details, "cached_tokens": min(details["cached_tokens"], out["prompt_tokens"])}
    return out
