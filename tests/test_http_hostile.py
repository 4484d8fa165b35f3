"""What a hostile or careless client can do to the HTTP front, through raw sockets on loopback (issue 33): requests
pipelined before a malformed one are all answered, in order, before its 400; a declared body over the limit
(Content-Length, or the first chunk-size line of a chunked body) is refused with 413 without being waited for; a
request head over `server.max_head_bytes` in total gets 431 at once; an API key that is not UTF-8 is a 401."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from simengine import SimConfig
from tests.conftest import gateway_over_sims
from tests.test_http_server import COMPLETION, RawClient, assert_openai_error, post

SIM = SimConfig(model="sim", instant=True)
# A body that is waited for ends in 408 after this (not the default minute): a wait shows as a wrong status.
QUICK_408 = {"body_timeout_s": 10}
MALFORMED = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n"


@asynccontextmanager
async def connected(port: int) -> AsyncIterator[RawClient]:
    """A raw connection, closed even when the test fails."""
    conn = await RawClient.connect(port)
    try:
        yield conn
    finally:
        await conn.close()


def completion(request_id: str) -> bytes:
    return post("/v1/completions", COMPLETION, f"x-request-id: {request_id}")


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/admin/reload", "/metrics"])
async def test_an_api_key_that_is_not_utf8_is_401(route: str) -> None:
    admission = {"auth": True, "tenants": {"acme": {"keys": ["sha256:" + "0" * 64]}}}
    async with gateway_over_sims([SIM], admission=admission, admin={"key": "adm"}) as (gw, _):
        async with connected(gw.port) as conn:
            for header in (b"Authorization: Bearer sk-\xe9\xff", b"Authorization: Bearer \xff"):
                body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}]}).encode()
                head = f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n".encode()
                if route == "/metrics":
                    head, body = b"GET /metrics HTTP/1.1\r\nHost: x\r\n", b""
                await conn.send(head + header + b"\r\n\r\n" + body)
                assert assert_openai_error(await conn.response(), 401)["type"] == "authentication_error"
