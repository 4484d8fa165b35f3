"""What a hostile or careless client can do to the HTTP front, through raw sockets on loopback (issue 33): requests
pipelined before a malformed one are all answered, in order, before its 400; a declared body over the limit
(Content-Length, or the first chunk-size line of a chunked body) is refused with 413 without being waited for; a
request head over `server.max_head_bytes` in total gets 431 at once; an API key that is not UTF-8 is a 401."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from gateway.keys import COMPLETIONS
from simengine import SimConfig
from tests.conftest import gateway_over_sims, wait_for
from tests.test_http_server import COMPLETION, RawClient, assert_openai_error, get, post

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


@pytest.mark.parametrize("before", [1, 2, 5])
async def test_requests_pipelined_before_a_malformed_one_are_answered_in_order(before: int) -> None:
    async with gateway_over_sims([SIM]) as (gw, sims):
        async with connected(gw.port) as conn:
            ids = [f"ok{i}" for i in range(before)]
            await conn.send(b"".join(completion(i) for i in ids) + MALFORMED + completion("after"))  # one segment
            answers = [await conn.response() for _ in ids]
            assert [(a.status, a.headers["x-request-id"]) for a in answers] == [(200, i) for i in ids]
            assert all(json.loads(a.body)["usage"]["completion_tokens"] == 3 for a in answers)
            assert assert_openai_error(await conn.response(), 400, request_id=False)["code"] == "invalid_http_request"
            assert await conn.closed_by_server()  # the one after the malformed request is not served
            assert sims[0].engine.stats.started == before


async def test_a_get_pipelined_with_a_malformed_one_is_answered_first() -> None:
    async with gateway_over_sims([SIM]) as (gw, _):
        async with connected(gw.port) as conn:
            await conn.send(get("/health") + b"GARBAGE\r\n\r\n")
            health = await conn.response()
            assert health.status == 200 and json.loads(health.body) == {"status": "ok"}
            assert_openai_error(await conn.response(), 400, request_id=False)
            assert await conn.closed_by_server()


async def test_connection_close_then_another_request_in_the_same_write() -> None:
    async with gateway_over_sims([SIM]) as (gw, sims):
        async with connected(gw.port) as conn:
            await conn.send(post("/v1/completions", COMPLETION, "Connection: close") + completion("second"))
            first = await conn.response()
            assert first.status == 200 and json.loads(first.body)["usage"]["completion_tokens"] == 3
            assert await conn.closed_by_server()
            assert conn.done == [] and sims[0].engine.stats.started == 1


@pytest.mark.parametrize("declared", [52_428_800, 10 * 1024**3])
async def test_a_declared_length_over_the_limit_is_413_without_the_body(declared: int) -> None:
    async with gateway_over_sims([SIM], server=QUICK_408) as (gw, sims):  # max_body_bytes at its default (8 MiB)
        async with connected(gw.port) as conn:
            head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n"
            await conn.send(head.encode())  # and no body
            assert assert_openai_error(await conn.response(), 413)["code"] == "request_too_large"
            assert await conn.closed_by_server()
            assert sims[0].engine.stats.started + sims[0].engine.stats.rejected == 0


CHUNKED_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    "writes",
    [
        [CHUNKED_HEAD + b"3200000\r\n"],  # 50 MiB announced, with the head
        [CHUNKED_HEAD + b"280000000;ext=1\r\n" + b'{"model"'],  # 10 GiB, an extension and a little data
        [CHUNKED_HEAD, b"3200000\r\n"],  # the size line in a later segment
        [CHUNKED_HEAD, b"32", b"00000\r\n"],  # ... split across segments
    ],
    ids=["with-head", "extension-and-data", "later", "split"],
)
async def test_a_first_chunk_announced_over_the_limit_is_413(writes: list[bytes]) -> None:
    async with gateway_over_sims([SIM], server=QUICK_408) as (gw, sims):
        async with connected(gw.port) as conn:
            for data in writes:
                await conn.send(data)
            assert assert_openai_error(await conn.response(), 413)["code"] == "request_too_large"
            assert await conn.closed_by_server()
            assert sims[0].engine.stats.started == 0


async def test_small_chunks_and_a_large_declared_limit_still_pass() -> None:
    async with gateway_over_sims([SIM], server={"max_body_bytes": 0x3200000}) as (gw, _):
        async with connected(gw.port) as conn:
            body = json.dumps({"model": "sim", "prompt": "hi", "max_tokens": 2}).encode()
            await conn.send(CHUNKED_HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
            assert (await conn.response()).status == 200
            head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
            await conn.send(head.encode() + body)  # the connection lives on
            assert (await conn.response()).status == 200


@pytest.mark.parametrize(
    "rest",
    [b"zz\r\n", b"4\r\nabcdefgh\r\n"],
    ids=["size-not-hex", "data-longer-than-its-size"],
)
async def test_a_malformed_chunk_in_a_body_being_read_is_400_at_once(rest: bytes) -> None:
    async with gateway_over_sims([SIM], server=QUICK_408) as (gw, sims):
        async with connected(gw.port) as conn:
            await conn.send(CHUNKED_HEAD + b'8\r\n{"model"\r\n')
            await wait_for(lambda: gw.app[COMPLETIONS].in_flight == 1, what="the handler reading the body")
            await conn.send(rest)
            assert assert_openai_error(await conn.response(), 400)["code"] == "invalid_http_request"
            assert await conn.closed_by_server()
            assert conn.done == [] and sims[0].engine.stats.started == 0


@pytest.mark.parametrize("pipelined", [False, True])
async def test_a_head_over_its_total_bound_is_431_at_once(pipelined: bool) -> None:
    async with gateway_over_sims([SIM], server={"max_head_bytes": 16_384}) as (gw, _):
        async with connected(gw.port) as conn:
            if pipelined:
                await conn.send(completion("first"))
            await conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            for i in range(40):  # 40 lines of 1 KiB, each well under the line limit, and no blank line
                await conn.send(f"x-pad-{i}: {'a' * 1000}\r\n".encode())
            if pipelined:
                assert (await conn.response()).headers["x-request-id"] == "first"
            error = assert_openai_error(await conn.response(), 431, request_id=False)
            assert error["code"] == "request_header_too_large"
            assert await conn.closed_by_server()


async def test_a_whole_head_over_its_total_bound_in_one_write_is_431() -> None:
    """A complete head of 40 KiB (40 lines under the line limit) arriving in one read: refused, not served."""
    async with gateway_over_sims([SIM], server={"max_head_bytes": 16_384}) as (gw, sims):
        async with connected(gw.port) as conn:
            pads = [f"x-pad-{i}: {'a' * 1000}" for i in range(40)]
            await conn.send(post("/v1/completions", COMPLETION, *pads))
            error = assert_openai_error(await conn.response(), 431, request_id=False)
            assert error["code"] == "request_header_too_large"
            assert await conn.closed_by_server()
            assert sims[0].engine.stats.started == 0


async def test_a_head_under_its_total_bound_is_served() -> None:
    async with gateway_over_sims([SIM], server={"max_head_bytes": 16_384}) as (gw, _):
        async with connected(gw.port) as conn:
            pads = [f"x-pad-{i}: {'a' * 1000}" for i in range(12)]
            for _ in range(3):  # the bound is per head, not per connection
                await conn.send(post("/v1/completions", COMPLETION, *pads))
                assert (await conn.response()).status == 200


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
