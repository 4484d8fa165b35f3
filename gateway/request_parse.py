"""Validation of OpenAI request bodies: just enough to route and to reject bad input with a clear 400.

Everything the gateway does not need is passed through to the engine untouched (the original bytes are forwarded
unless the gateway itself has to change a field).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from gateway.errors import BadRequest

Endpoint = Literal["chat", "completions"]


@dataclass(slots=True)
class ParsedRequest:
    endpoint: Endpoint
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool  # client asked for stream_options.include_usage
    max_tokens: int | None


def _check_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRequest(f"'{key}' must be an integer >= {minimum}", param=key)
    return value


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages[{i}] must be an object", param=f"messages[{i}]")
        if not isinstance(msg.get("role"), str):
            raise BadRequest(f"messages[{i}].role must be a string", param=f"messages[{i}].role")
        content = msg.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(f"messages[{i}].content must be a string or an array", param=f"messages[{i}].content")


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return
        if all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt
        ):
            return
    raise BadRequest("'prompt' must be a string, an array of strings, or an array of token ids", param="prompt")


def parse_request(endpoint: Endpoint, raw: bytes) -> ParsedRequest:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    if endpoint == "chat":
        _check_messages(body.get("messages"))
    else:
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", param="prompt")
        _check_prompt(body["prompt"])
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    include_usage = bool(options and options.get("include_usage"))
    max_tokens = _check_int(body, "max_tokens", 0)
    max_completion = _check_int(body, "max_completion_tokens", 0)
    _check_int(body, "n", 1)
    return ParsedRequest(
        endpoint, body, model, stream, include_usage, max_tokens if max_tokens is not None else max_completion
    )
