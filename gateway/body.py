"""Reading a request body, the one way every route does it: bounded in size (`server.max_body_bytes`, enforced by
aiohttp's `client_max_size`, 413) and in time (`server.body_timeout_s` from when the handler starts reading, 408).

`expect_handler` answers `Expect: 100-continue` for every route (aiohttp calls it before the handler): 413 at once
when the declared Content-Length is over the limit, so the client need not send the body; otherwise
"100 Continue"; another expectation gets 417. Cost: one `request.read()` under one timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.errors import GatewayError, PayloadTooLarge, RequestTimeout, error_response
from gateway.ids import IdSource


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body, or PayloadTooLarge / RequestTimeout raised."""
    try:
        if request.content.is_eof():  # all of it arrived with the head (the common case): nothing to wait for
            return await request.read()
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge("request body exceeds the configured limit") from None
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s") from None


class ExpectationFailed(GatewayError):
    status = 417
    type = "invalid_request_error"
    code = "expectation_failed"


ExpectHandler = Callable[[web.Request], Awaitable[web.StreamResponse | None]]


def expect_handler(max_body_bytes: int, ids: IdSource) -> ExpectHandler:
    async def handle(request: web.Request) -> web.StreamResponse | None:
        err: GatewayError | None = None
        if request.headers.get("Expect", "").lower() != "100-continue":
            err = ExpectationFailed(f"unsupported Expect: {request.headers.get('Expect')!r}")
        elif request.content_length is not None and request.content_length > max_body_bytes:
            err = PayloadTooLarge("request body exceeds the configured limit")
        if err is not None:
            response = error_response(err, request_id=request.headers.get("x-request-id") or ids.next())
            response.force_close()  # the body may follow anyway: it is not read
            return response
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the answer's own head is still to come
        return None

    return handle
