"""Validation of OpenAI request bodies: just enough to route and to reject bad input with a clear 400.

Everything the gateway does not need is passed through to the engine untouched (the original bytes are forwarded
unless the gateway itself has to change a field).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from gateway.errors import BadRequest

BodyKind = Literal["chat", "completions", "json", "multipart", "held"]  # see gateway.endpoints


@dataclass(slots=True)
class ParsedRequest:
    endpoint: BodyKind
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool  # client asked for stream_options.include_usage (always True for "json": nothing stripped)
    max_tokens: int | None
    stdlib_json: bool = False  # parsed by the standard library (orjson refused it: perhaps not UTF-8)
    content_type: str = "application/json"  # sent to the engine with the body
    records_id: bool = False  # remember which replica answered the answer's `id` (gateway.endpoints)


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


# fields kvgate reads (for routing, quotas, isolation): a body that names one twice could mean one thing to kvgate
# and another to an engine whose parser keeps the first value
_READ_FIELDS = (b'"model"', b'"cache_salt"', b'"messages"', b'"prompt"', b'"stream"', b'"max_tokens"', b'"user"')


def _pairs_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise BadRequest(f"the key {key!r} appears twice in one object", param=key, code="duplicate_key")
            seen.add(key)
    return out


def _refuse_duplicate_keys(raw: bytes) -> None:
    """400 for a body with a duplicate key anywhere, checked exactly only when one of the fields kvgate reads
    occurs more than once in the text (two `bytes.count` per field otherwise: most bodies)."""
    if any(raw.count(name) > 1 for name in _READ_FIELDS):
        try:
            json.loads(raw, object_pairs_hook=_pairs_without_duplicates)
        except (ValueError, UnicodeDecodeError):
            pass  # not JSON: the parser below says so


def parse_multipart(raw: bytes, content_type: str) -> ParsedRequest:
    """A multipart/form-data body (audio): only its `model` and `stream` fields are read, by splitting on the
    boundary; the engine gets the client's bytes and Content-Type. O(body) in `bytes.split` (C)."""
    ctype, _, params = content_type.partition(";")
    boundary = next(
        (v.strip().strip('"') for k, _, v in (p.partition("=") for p in params.split(";")) if k.strip() == "boundary"),
        "",
    )
    if ctype.strip().lower() != "multipart/form-data" or not boundary:
        raise BadRequest("this endpoint takes a multipart/form-data body", code="invalid_content_type")
    fields: dict[str, str] = {}
    for part in raw.split(b"--" + boundary.encode("latin-1")):
        head, sep, value = part.partition(b"\r\n\r\n")
        if not sep or b"filename=" in head:
            continue
        for name in (b"model", b"stream"):
            if b'name="' + name + b'"' in head:
                fields[name.decode()] = value.rstrip(b"\r\n").decode("utf-8", "replace")
    model = fields.get("model")
    if not model:
        raise BadRequest("'model' is required (a form field)", param="model")
    stream = fields.get("stream", "false").lower() == "true"
    return ParsedRequest("multipart", {"model": model}, model, stream, True, None, content_type=content_type)


def parse_request(endpoint: BodyKind, raw: bytes, *, model_optional: bool = False) -> ParsedRequest:
    """The body parsed by orjson (about 10x the standard library's speed); what orjson refuses (UTF-16 bodies, a
    byte order mark, NaN, lone surrogates) is read by the standard library, so nothing that parsed before is
    refused now. The parsed body is for validation and routing: the engine gets the client's bytes
    (`upstream_body`), so orjson reading an integer beyond 64 bits as a float changes nothing sent."""
    stdlib = False
    _refuse_duplicate_keys(raw)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        stdlib = True
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if model is None and model_optional:
        model = ""  # the pool's only model (the caller resolves it); the engine uses its own
    elif not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    if endpoint == "json":  # any other vLLM endpoint: the engine validates the rest
        stream = body.get("stream", False)
        if stream is not None and not isinstance(stream, bool):
            raise BadRequest("'stream' must be a boolean", param="stream")
        return ParsedRequest(endpoint, body, model, bool(stream), True, None, stdlib)
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
        endpoint, body, model, stream, include_usage, max_tokens if max_tokens is not None else max_completion, stdlib
    )


_TEXT_PARTS = ("input_text", "output_text", "text")


def responses_as_chat(body: dict[str, Any]) -> dict[str, Any] | None:
    """A Responses API body as the chat request vLLM renders it (for prefix hashing): `instructions` as the system
    message, then `input` (a string, or message items with string or text-part content, parts as chat's text
    parts). None when the prompt is not all in the body (`previous_response_id`: the engine prepends a stored
    conversation; the request goes to its holder anyway) or `input` holds no message. Items after the first that is
    not a message (a function call, its output) are left out: the prefix before them still hashes the same."""
    if body.get("previous_response_id") is not None:
        return None
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                break
            role, content = item.get("role"), item.get("content")
            if isinstance(content, list):
                content = [
                    {"type": "text", "text": p["text"]}
                    for p in content
                    if isinstance(p, dict) and p.get("type") in _TEXT_PARTS and isinstance(p.get("text"), str)
                ]
            if not isinstance(role, str) or not isinstance(content, str | list):
                break
            messages.append({"role": role, "content": content})
    if not messages or messages[-1]["role"] == "system":
        return None
    return {"model": body.get("model"), "messages": messages, "cache_salt": body.get("cache_salt")}


_USAGE_OPTION = b'"stream_options":{"include_usage":true},'


def upstream_body(parsed: ParsedRequest, raw: bytes, salted: bool) -> bytes:
    """The body sent to the engine: the client's bytes untouched, unless the gateway must ask for the usage chunk
    of a stream (`stream_options.include_usage`), set the tenant's `cache_salt` (`salted`) or name the model it
    routes to (an alias or a fallback: `parsed.model` is not the body's). A stream option alone is spliced in after
    the opening brace when the client sent no `stream_options` (UTF-8 bodies); otherwise the body is re-read and
    re-written by the standard library, which keeps every value exactly as sent."""
    wants_usage = parsed.stream and not parsed.include_usage  # include_usage is True for "json" bodies
    renamed = parsed.body.get("model", parsed.model) != parsed.model
    if not (wants_usage or salted or renamed):
        return raw
    if not (salted or renamed) and not parsed.stdlib_json and "stream_options" not in parsed.body:
        start = raw.index(b"{") + 1
        return raw[:start] + _USAGE_OPTION + raw[start:]
    body = json.loads(raw)
    if salted:
        body["cache_salt"] = parsed.body["cache_salt"]
    if renamed:
        body["model"] = parsed.model
    if wants_usage:
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return json.dumps(body, separators=(",", ":")).encode()
