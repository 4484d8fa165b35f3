"""Reading a request body, the one way every route does it: bounded in size (`server.max_body_bytes`: a declared
Content-Length over it is 413 before any of the body is waited for; a chunked body whose first chunk announces more
is refused by the listener as that line arrives, `gateway.framing`; otherwise aiohttp's `client_max_size`, 413), in
time (`server.body_timeout_s` from when the handler starts reading, 408) and in JSON nesting
(`server.max_json_depth`, 400: deep nesting makes parsers recurse). A body the gateway parses with orjson, which
stops at 1,024 levels by itself, is checked on the decoded value (`scan_value`, one step per array or object: about
0.1 ms for a 400 KB agent conversation) while it has at most 65,536 arrays and objects (request_parse.decode);
any other body before a parser sees it (`nested_deeper`). The text check is linear in the body's length whatever
its bytes and uses no regular expression (an earlier one backtracked exponentially on a string that never closes:
170 bytes held the event loop for seconds). It costs two `bytes.count` calls when the body has fewer brackets than
the limit (most bodies); otherwise four C passes (`replace`, `translate`) keep only the quotes and brackets, with
escapes resolved, and numpy walks what is left in chunks of 256 KiB (`deeper_than`): about 0.5 ms for a 200 KB agent
conversation, 0.12 s for 6 MB of `[]` (the value walk took 1 s more on that body than orjson's own 0.65 s).

`expect_handler` answers `Expect: 100-continue` for every route (aiohttp calls it before the handler): 413 at once
when the declared Content-Length is over the limit, so the client need not send the body; otherwise
"100 Continue"; another expectation gets 417. Reading costs one `request.read()`, under a timer only when the body
had not all arrived with the head.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from gateway.errors import ApiShape, BadRequest, GatewayError, PayloadTooLarge, RequestTimeout, error_response
from gateway.ids import IdSource, valid_request_id
from gateway.server_config import ServerConfig


async def read_body(request: web.Request, limits: ServerConfig, *, json: bool = True) -> bytes:
    """The whole body, or PayloadTooLarge / RequestTimeout / BadRequest (nesting of a JSON body) raised."""
    declared = request.content_length
    if declared is not None and declared > limits.max_body_bytes:  # not waited for: the client need not send it
        raise PayloadTooLarge(f"the request body declares {declared} bytes, over the limit ({limits.max_body_bytes})")
    try:
        if request.content.is_eof():  # all of it arrived with the head (the common case): nothing to wait for
            raw = await request.read()
        else:
            async with asyncio.timeout(limits.body_timeout_s):
                raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge("request body exceeds the configured limit") from None
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {limits.body_timeout_s:g} s") from None
    except RequestPayloadError as exc:  # a body its Content-Encoding does not decode: nothing more is read of it
        request.content.feed_eof()
        reason = str(exc).split("message:", 1)[-1].strip()
        raise BadRequest(
            f"the request body cannot be read: {reason}", code="invalid_http_request", headers={"Connection": "close"}
        ) from None
    if json and nested_deeper(raw, limits.max_json_depth):
        raise too_deep(limits.max_json_depth)
    return raw


def too_deep(limit: int) -> BadRequest:
    return BadRequest(f"the JSON body is nested deeper than {limit} levels", code="too_deep")


# A JSON string's escapes, resolved before the quotes are read: an escaped backslash, then an escaped quote.
_ESCAPED_BACKSLASH, _ESCAPED_QUOTE = b"\\\\", b'\\"'
# Every byte but a quote or a bracket: dropped in one pass (`bytes.translate`).
_NOT_STRUCTURE = bytes(range(256)).translate(None, b'"[]{}')
_QUOTE = 0x22


def structure_of(raw: bytes) -> bytes:
    """The quotes and brackets of JSON text that decide its nesting, in order: escapes resolved (pairs of
    backslashes, then escaped quotes, removed left to right as a parser reads them), everything else dropped, and
    adjacent quote pairs removed (each toggles "inside a string" twice). Four passes in C, each linear."""
    unescaped = raw.replace(_ESCAPED_BACKSLASH, b"").replace(_ESCAPED_QUOTE, b"")
    return unescaped.translate(None, _NOT_STRUCTURE).replace(b'""', b"")


# A structure byte's step in depth: +1 for an opening bracket, -1 for a closing one, 0 for a quote.
_STEP = np.zeros(256, np.int32)
_STEP[[0x5B, 0x7B]] = 1
_STEP[[0x5D, 0x7D]] = -1
_CHUNK = 1 << 18  # 256 KiB: a few MB of arrays at a time


def deeper_than(structure: bytes, limit: int) -> bool:
    """Whether brackets outside strings nest deeper than `limit`. A closing bracket at depth 0 is ignored (a parser
    stops there anyway), so any body gets a depth at least the one a parser would reach before it fails. Per chunk,
    in C: the quotes' running count (odd: inside a string), the running sum of the steps outside strings, and the
    depth as that sum above its lowest point so far (a sum that ignores a closing bracket at 0 is the raw sum less
    its running minimum below 0)."""
    data = np.frombuffer(structure, np.uint8)
    inside, walked, lowest = 0, 0, 0  # carried from chunk to chunk
    for at in range(0, len(data), _CHUNK):
        part = data[at : at + _CHUNK]
        quotes = np.cumsum(part == _QUOTE, dtype=np.int32) + inside
        steps = np.where(quotes & 1, 0, _STEP[part])
        walk = np.cumsum(steps) + walked
        lows = np.minimum.accumulate(np.minimum(walk, lowest))
        if int((walk - lows).max()) > limit:
            return True
        inside, walked, lowest = int(quotes[-1]) & 1, int(walk[-1]), int(lows[-1])
    return False


def scan_value(value: Any, limit: int) -> tuple[bool, bool]:
    """Of a decoded JSON value (orjson's: dicts, lists, scalars): whether its arrays and objects nest deeper than
    `limit`, and whether it holds a float that may be an integer literal the decoder rounded (integral, at least
    2^63 in magnitude: orjson reads integers beyond 64 bits as floats). Iterative: one step per array or object, and
    a C pass (`set(map(type, ...))`) over each one's items; stops at the first level past `limit`."""
    rounded = type(value) is float and _rounded(value)
    stack = [(value, 1)] if type(value) is dict or type(value) is list else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True, rounded
        items = node.values() if type(node) is dict else node
        types = set(map(type, items))
        if float in types and not rounded:
            rounded = any(_rounded(x) for x in items if type(x) is float)
        if dict in types or list in types:
            stack.extend((x, depth + 1) for x in items if type(x) is dict or type(x) is list)
    return False, rounded


def _rounded(x: float) -> bool:
    return x.is_integer() and abs(x) >= 2.0**63


def nested_deeper(raw: bytes, limit: int) -> bool:
    """Whether JSON text (valid or not) opens more than `limit` arrays or objects inside each other."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    return deeper_than(structure_of(raw), limit)


class ExpectationFailed(GatewayError):
    status = 417
    type = "invalid_request_error"
    code = "expectation_failed"


ExpectHandler = Callable[[web.Request], Awaitable[web.StreamResponse | None]]


Refusal = Callable[[web.Request, str, GatewayError], None]  # logs and counts a request refused before its handler


def expect_handler(max_body_bytes: int, ids: IdSource, refused: Refusal, api: ApiShape = "openai") -> ExpectHandler:
    async def handle(request: web.Request) -> web.StreamResponse | None:
        err: GatewayError | None = None
        if request.headers.get("Expect", "").lower() != "100-continue":
            err = ExpectationFailed(f"unsupported Expect: {request.headers.get('Expect')!r}")
        elif request.content_length is not None and request.content_length > max_body_bytes:
            err = PayloadTooLarge("request body exceeds the configured limit")
        if err is not None:
            named = request.headers.get("x-request-id")  # echoed only as the middleware would take it
            request_id = named if named and valid_request_id(named) else ids.next()
            refused(request, request_id, err)
            response = error_response(err, request_id=request_id, api=api)
            response.force_close()  # the body may follow anyway: it is not read
            return response
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the answer's own head is still to come
        return None

    return handle
