"""Validation of OpenAI request bodies: just enough to route and to reject bad input with a clear 400.

Everything the gateway does not need is passed through to the engine untouched (the original bytes are forwarded
unless the gateway itself has to change a field). The body is decoded once (`decode`: orjson, the standard library
only for what orjson refuses or would read inexactly), and a body the gateway changes is written from that one
decoding (`engine_fields`, `encode`), never read again.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import TypeAdapter, ValidationError

from gateway.body import nested_deeper, scan_value, too_deep
from gateway.errors import ApiShape, BadRequest

BodyKind = Literal["chat", "completions", "json", "multipart", "held"]  # see gateway.endpoints


@dataclass(slots=True)
class ParsedRequest:
    kind: BodyKind
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool  # client asked for stream_options.include_usage (always True for "json": nothing stripped)
    max_tokens: int | None
    stdlib_json: bool = False  # decoded by the standard library (orjson refused it, or would round a big integer)
    continuous_usage: bool = False  # client asked for stream_options.continuous_usage_stats
    content_type: str = "application/json"  # sent to the engine with the body
    records_id: bool = False  # remember which replica answered the answer's `id` (gateway.endpoints)
    api: ApiShape = "openai"  # the shape of the route's answers, errors and stream events (gateway.endpoints)

    @property
    def stores_answer(self) -> bool:
        """The answer's `id` names state its replica keeps: a stored response (`store` is true unless false), whose
        replica is remembered (and shared with the fleet); one with `store: false` is kept nowhere."""
        return self.records_id and self.body.get("store") is not False


_INT_BOUND = 2**31 - 1  # what the gateway counts of an integer field at most (no context is longer)
_INT, _BOOL = TypeAdapter(int), TypeAdapter(bool)


def as_int(value: object) -> int | None:
    """`value` as vLLM's request models read an integer field (pydantic's lax int: 4, 4.0, "4", true); None when
    they would refuse it. The gateway is no stricter than the engine it fronts."""
    if type(value) is int:
        return value
    if type(value) is float and value.is_integer() and abs(value) < 2**63:  # pydantic's reading, without its
        return int(value)  # call (token ids are read an item at a time)
    try:
        return _INT.validate_python(value)
    except ValidationError:
        return None


def _flag(body: dict[str, Any], key: str, param: str | None = None) -> bool:
    """A boolean field as vLLM's request models read it (pydantic's lax bool: true, "true", 1, "yes"; "false", 0,
    "no" false), absent or null false; 400 for what they would refuse."""
    value = body.get(key)
    if value is None or type(value) is bool:
        return bool(value)
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        name = param or key
        raise BadRequest(f"'{name}' must be a boolean", param=name) from None


def _check_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    number = as_int(value)
    if number is None or number < minimum:
        raise BadRequest(f"'{key}' must be an integer >= {minimum}", param=key)
    return min(number, _INT_BOUND)  # the body goes on as sent: the engine caps it at the context left


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


def _token_ids(items: list[Any]) -> list[int] | None:
    """`items` as token ids the way vLLM's prompt field reads them (pydantic's lax int: 5, 5.0, true; strings are a
    batch of text prompts), else None, at the first item that is not one (a body of junk is refused without reading
    it all). O(items)."""
    ids: list[int] = []
    for item in items:
        token = None if isinstance(item, str) else as_int(item)
        if token is None:
            return None
        ids.append(token)
    return ids


def _prompt(prompt: Any) -> Any:
    """The prompt as vLLM reads it: a string, a batch of strings, token ids or a batch of them (as ints); 400 else."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return prompt
        if (ids := _token_ids(prompt)) is not None:
            return ids
        if all(isinstance(p, list) and p for p in prompt):
            batch = [_token_ids(p) for p in prompt]
            if all(b is not None for b in batch):
                return batch
    raise BadRequest("'prompt' must be a string, an array of strings, or an array of token ids", param="prompt")


# fields kvgate reads (for routing, quotas, isolation): a body that names one twice could mean one thing to kvgate
# and another to an engine whose parser keeps the first value. Found as keys (the name, then a colon) in one regex
# pass led by the quote (O(body); a conversation's "role": "user" values are not keys)
_READ_KEYS = re.compile(rb'"(model|cache_salt|messages|prompt|stream|max_tokens|user)"\s*:')


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
    """400 for a body with a duplicate key anywhere, checked exactly (the standard library's parser, every object)
    only when one of the fields kvgate reads is a key more than once in the text: most bodies pass on the scan."""
    keys = _READ_KEYS.findall(raw)
    if len(keys) != len(set(keys)):
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
    for part in raw.split(b"--" + boundary.encode("utf-8", "surrogateescape")):  # the header's bytes
        head, sep, value = part.partition(b"\r\n\r\n")
        if not sep or b"filename=" in head:
            continue
        for name in (b"model", b"stream"):
            if b'name="' + name + b'"' in head:
                fields[name.decode()] = value.rstrip(b"\r\n").decode("utf-8", "replace")
    model = fields.get("model") or ""  # absent: the pool's only model (the caller resolves it)
    try:  # as the engine's form model reads it (lax: "true", "1", "yes"); what it refuses, it answers
        stream = _BOOL.validate_python(fields.get("stream", "false"))
    except ValidationError:
        stream = False
    body = {"model": model} if model else {}
    return ParsedRequest("multipart", body, model, stream, True, None, content_type=content_type)


def multipart_with_model(raw: bytes, content_type: str, model: str) -> bytes:
    """The form with its `model` field's value replaced (an alias resolved); the other parts byte for byte. O(body)."""
    boundary = b"--" + content_type.partition("boundary=")[2].split(";")[0].strip().strip('"').encode(
        "utf-8", "surrogateescape"
    )
    parts = raw.split(boundary)
    for i, part in enumerate(parts):
        head, sep, value = part.partition(b"\r\n\r\n")
        if sep and b"filename=" not in head and b'name="model"' in head:
            parts[i] = head + sep + model.encode() + value[len(value.rstrip(b"\r\n")) :]
    return boundary.join(parts)


# Arrays and objects (counted as brackets, those in strings too) up to which a decoded body is walked for its depth
# and rounded numbers (`scan_value`: about 0.5 us each, 30 ms at most); past it, the text is checked (gateway.body).
_WALK_MAX = 65_536
# 19 digits in a row: the shortest integer literal orjson may read as a float, rounded (it reads integers beyond 64
# bits so). Found as 19 zeros once every digit is a zero: two C passes, about 1 ns a byte.
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"0" * 9)
_LONG_DIGITS = b"0" * 19


def decode(raw: bytes, max_depth: int) -> tuple[Any, bool]:
    """(the JSON value, whether the standard library read it): orjson (about 10x the standard library's speed),
    unless it refuses the text (UTF-16, a byte order mark, NaN, lone surrogates) or may have rounded a number in it
    (an integer beyond 64 bits); then the standard library, which reads those exactly. BadRequest when neither can,
    or when arrays and objects nest deeper than `max_depth` (gateway.body): checked on orjson's value (which also
    tells a rounded number) unless the body has too many to walk, else on the text before any parser reads it."""
    if raw.count(b"[") + raw.count(b"{") > _WALK_MAX:
        if nested_deeper(raw, max_depth):
            raise too_deep(max_depth)
        if _LONG_DIGITS not in raw.translate(_DIGITS_AS_ZERO):
            with contextlib.suppress(orjson.JSONDecodeError):
                return orjson.loads(raw), False
        return _stdlib(raw), True
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    else:
        deep, rounded = scan_value(value, max_depth)
        if deep:
            raise too_deep(max_depth)
        if not rounded:
            return value, False
    if nested_deeper(raw, max_depth):
        raise too_deep(max_depth)
    return _stdlib(raw), True


def _stdlib(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None


def encode(body: dict[str, Any], parsed: ParsedRequest) -> bytes:
    """A body the gateway changed, written by the codec that read the client's (so every value is kept exactly)."""
    if parsed.stdlib_json:
        return json.dumps(body, separators=(",", ":")).encode()
    return orjson.dumps(body)


def parse_request(kind: BodyKind, raw: bytes, *, max_depth: int, model_optional: bool = False) -> ParsedRequest:
    """The body decoded once (`decode`) and checked as far as routing, quotas and isolation need."""
    body, stdlib = decode(raw, max_depth)
    _refuse_duplicate_keys(raw)  # (its exact check parses again, with the standard library: after the depth check)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if model in (None, "") and model_optional:  # vLLM takes an empty name as none
        model = ""  # the pool's only model (the caller resolves it); the engine uses its own
    elif not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    if kind == "json":  # any other vLLM endpoint: the engine validates the rest
        return ParsedRequest(kind, body, model, _flag(body, "stream"), True, None, stdlib)
    if kind == "chat":
        _check_messages(body.get("messages"))
    elif body.get("prompt") is None and body.get("prompt_embeds") is not None:
        pass  # embeddings for a prompt (vLLM's --enable-prompt-embeds): the engine reads them; no prefix to route by
    else:
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", param="prompt")
        if (prompt := _prompt(body["prompt"])) is not body["prompt"]:
            body["prompt"] = prompt  # its token ids as ints, for the gateway's reading (the engine gets the bytes)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    options = options or {}
    include_usage = _flag(options, "include_usage", "stream_options.include_usage")
    max_tokens = _check_int(body, "max_tokens", 0)
    max_completion = _check_int(body, "max_completion_tokens", 0)
    _check_int(body, "n", 1)
    limit = max_tokens if max_tokens is not None else max_completion
    continuous = include_usage and _flag(options, "continuous_usage_stats", "stream_options.continuous_usage_stats")
    return ParsedRequest(kind, body, model, stream, include_usage, limit, stdlib, continuous_usage=continuous)


def generate_as_prompt(body: dict[str, Any]) -> dict[str, Any] | None:
    """A `/inference/v1/generate` body as the completions prompt of its `token_ids` (hashed as they are, with its
    `cache_salt`); None when they are not a list of token ids (the engine answers 400)."""
    tokens = body.get("token_ids")
    if not isinstance(tokens, list) or not tokens or not all(type(t) is int for t in tokens):
        return None
    return {"prompt": tokens, "cache_salt": body.get("cache_salt")}


_USAGE_OPTION = b'"stream_options":{"include_usage":true},'
_USAGE_STATS_OPTION = b'"stream_options":{"include_usage":true,"continuous_usage_stats":true},'


def engine_fields(parsed: ParsedRequest, *, usage_stats: bool = False) -> dict[str, Any]:
    """The body as the engine gets it, as a new dict: the client's fields (with the tenant's `cache_salt` where
    the gateway set it), the model the gateway routes to, and a stream's usage options (`usage_stats`: the running
    usage too, which a stream that may migrate needs)."""
    body = {**parsed.body, "model": parsed.model} if "model" in parsed.body else dict(parsed.body)
    if parsed.stream and (not parsed.include_usage or usage_stats):
        options = {**(body.get("stream_options") or {}), "include_usage": True}
        if usage_stats:
            options["continuous_usage_stats"] = True
        body["stream_options"] = options
    return body


def engine_body(parsed: ParsedRequest, raw: bytes, *, salted: bool, usage_stats: bool = False) -> bytes:
    """The body sent to the engine: the client's bytes untouched, unless the gateway must ask for a stream's usage
    (`stream_options`), set the tenant's `cache_salt` (`salted`) or name the model it routes to (an alias or a
    fallback: `parsed.model` is not the body's). Stream options alone are spliced in after the opening brace when
    the client sent none (UTF-8 bodies); otherwise the body is written from its one decoding (`engine_fields`)."""
    wants_usage = parsed.stream and not parsed.include_usage  # include_usage is True for "json" bodies
    wants_stats = usage_stats and parsed.stream and not parsed.continuous_usage
    renamed = parsed.body.get("model", parsed.model) != parsed.model
    if not (wants_usage or wants_stats or salted or renamed):
        return raw
    if not (salted or renamed) and not parsed.stdlib_json and "stream_options" not in parsed.body:
        start = raw.index(b"{") + 1
        return raw[:start] + (_USAGE_STATS_OPTION if usage_stats else _USAGE_OPTION) + raw[start:]
    return encode(engine_fields(parsed, usage_stats=usage_stats), parsed)
