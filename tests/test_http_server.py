"""The gateway's HTTP server (aiohttp behind `gateway.listener`) through real sockets on loopback, as an attacker
and an old client would use it: framing, pipelining, limits, timeouts, smuggling shapes, connection cap, shutdown."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import socket
import zlib
from typing import Any

import httptools
import openai
import pytest

from gateway.embedded import running_gateway
from gateway.keys import REPLICAS, UPSTREAM
from simengine import SimConfig, run_sim_engine
from tests.conftest import TcpRelay, gateway_config, gateway_over_sims, wait_for

SIM = SimConfig(model="sim", instant=True)
COMPLETION = json.dumps({"model": "sim", "prompt": "hello", "max_tokens": 3}).encode()


class Response:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        self.complete = False


class RawClient:
    """A raw HTTP/1.1 connection: write any bytes, read responses in order as httptools parses them."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[Response] = []
        self.current: Response | None = None

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    def on_message_begin(self) -> None:
        self.current = Response()

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.current is not None
        self.current.headers[name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        assert self.current is not None
        self.current.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        assert self.current is not None
        self.current.body += body

    def on_message_complete(self) -> None:
        assert self.current is not None
        self.current.complete = True
        self.done.append(self.current)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self) -> Response:
        while not self.done:
            data = await self.reader.read(65536)
            assert data, "connection closed before a whole response"
            self.parser.feed_data(data)
        return self.done.pop(0)

    async def closed_by_server(self) -> bool:
        """True when the server closed the connection (EOF, or a reset after it closed)."""
        try:
            return await self.reader.read(65536) == b""
        except ConnectionResetError:
            return True

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


def post(path: str, body: bytes, *extra: str, version: str = "1.1") -> bytes:
    head = [f"POST {path} HTTP/{version}", "Host: x", "Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join([*head, *extra]) + "\r\n\r\n").encode() + body


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def assert_openai_error(resp: Response, status: int, *, request_id: bool = True) -> dict[str, Any]:
    """An OpenAI-shaped error; `request_id`: the answer belongs to a request (a refused connection has none)."""
    assert resp.status == status, resp.body
    payload = json.loads(resp.body)
    assert set(payload) == {"error"} and {"message", "type", "param", "code"} <= set(payload["error"])
    assert bool(resp.headers.get("x-request-id")) or not request_id
    return dict(payload["error"])


async def test_one_connection_serves_every_route() -> None:
    async with gateway_over_sims([SIM]) as (gw, _):
        conn = await RawClient.connect(gw.port)
        await conn.send(post("/v1/completions", COMPLETION))
        first = await conn.response()
        assert first.status == 200 and json.loads(first.body)["usage"]["completion_tokens"] == 3
        assert first.headers["x-request-id"]
        await conn.send(get("/metrics"))
        metrics = await conn.response()
        assert metrics.status == 200 and b'kvgate_requests_total{endpoint="completions"' in metrics.body
        await conn.send(get("/v1/models"))
        models = await conn.response()
        assert [m["id"] for m in json.loads(models.body)["data"]] == ["sim"]
        await conn.send(get("/no/such/route"))
        assert assert_openai_error(await conn.response(), 404)["code"] == "not_found"
        await conn.send(post("/v1/completions", COMPLETION))  # the connection lives on after an error answer
        assert (await conn.response()).status == 200
        await conn.close()


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with gateway_over_sims([SIM]) as (gw, _):
        conn = await RawClient.connect(gw.port)
        bodies = [json.dumps({"model": "sim", "prompt": "p", "max_tokens": n}).encode() for n in (5, 1, 2)]
        ids = ["first", "second", "third"]
        pipelined = [post("/v1/completions", b, f"x-request-id: {i}") for b, i in zip(bodies, ids, strict=True)]
        await conn.send(b"".join(pipelined))
        answers = [await conn.response() for _ in ids]
        assert [a.headers["x-request-id"] for a in answers] == ids
        assert [json.loads(a.body)["usage"]["completion_tokens"] for a in answers] == [5, 1, 2]
        await conn.send(post("/v1/completions", bodies[1]) + get("/health") + post("/v1/completions", bodies[2]))
        hot, health, last = [await conn.response() for _ in range(3)]
        assert hot.status == 200 and json.loads(health.body) == {"status": "ok"}
        assert last.status == 200 and json.loads(last.body)["usage"]["completion_tokens"] == 2
        await conn.close()


async def test_pipelining_in_segments_that_never_end_on_a_request_boundary() -> None:
    async with gateway_over_sims([SIM]) as (gw, _):
        conn = await RawClient.connect(gw.port)
        requests = [post("/v1/completions", COMPLETION, f"x-request-id: r{i}") for i in range(12)]
        data = b"".join(requests) + get("/health")
        for i in range(0, len(data), 97):  # 97 bytes per write: boundaries fall mid-segment
            await conn.send(data[i : i + 97])
            await asyncio.sleep(0)
        answers = [await conn.response() for _ in range(13)]
        assert [a.headers["x-request-id"] for a in answers[:12]] == [f"r{i}" for i in range(12)]
        assert all(a.status == 200 for a in answers) and json.loads(answers[12].body) == {"status": "ok"}
        await conn.close()


async def test_a_burst_of_pipelined_requests_does_not_stall_other_connections() -> None:
    """3,000 requests in one write on one connection: they are answered in order, while a request on another
    connection is answered before the burst is through (the server parses a bounded number ahead)."""
    async with gateway_over_sims([SIM]) as (gw, _):
        burst = await RawClient.connect(gw.port)
        n = 3000
        await burst.send(b"".join(post("/v1/completions", COMPLETION, f"x-request-id: b{i}") for i in range(n)))
        await burst.response()  # the burst is being served
        other = await RawClient.connect(gw.port)
        await other.send(post("/v1/completions", COMPLETION, "x-request-id: other"))
        answer = await other.response()
        assert answer.status == 200 and answer.headers["x-request-id"] == "other"
        served_before = len(burst.done) + 1
        rest = [await burst.response() for _ in range(n - 1)]
        assert served_before < n, "the other connection waited for the whole burst"
        assert [r.headers["x-request-id"] for r in rest] == [f"b{i}" for i in range(1, n)]
        await burst.close()
        await other.close()


async def test_chunked_request_body() -> None:
    async with gateway_over_sims([SIM]) as (gw, _):
        conn = await RawClient.connect(gw.port)
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
        chunks = [body[:10], body[10:]]
        await conn.send(head + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n")
        resp = await conn.response()
        assert resp.status == 200 and json.loads(resp.body)["object"] == "chat.completion"
        await conn.close()


@pytest.mark.parametrize("chunked", [False, True])
async def test_body_over_the_limit_is_413(chunked: bool) -> None:
    async with gateway_over_sims([SIM], server={"max_body_bytes": 1000}) as (gw, _):
        conn = await RawClient.connect(gw.port)
        big = json.dumps({"model": "sim", "prompt": "x" * 5000}).encode()
        if chunked:
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            await conn.send(head + b"%x\r\n%s\r\n" % (len(big), big))  # no terminator: refused before the end
        else:
            await conn.send(post("/v1/completions", big))
        error = assert_openai_error(await conn.response(), 413)
        assert error["code"] == "request_too_large"
        await conn.close()


async def test_a_compressed_body_over_the_limit_is_not_inflated_to_be_discarded() -> None:
    """A 256 KB gzip body that inflates to 256 MiB: 413 once the limit is inflated, and the connection closes with the
    answer. aiohttp read a refused body's rest to discard it, inflating it as it went (a few such bodies held the
    event loop for seconds and the process at hundreds of MB), and kept the connection open after."""
    squeeze = zlib.compressobj(1, zlib.DEFLATED, 31)  # gzip
    bomb = b"".join([squeeze.compress(b" " * (1 << 20)) for _ in range(256)]) + squeeze.flush()
    async with gateway_over_sims([SIM], server={"max_body_bytes": 1 << 20}) as (gw, _):
        conn = await RawClient.connect(gw.port)
        await conn.send(post("/v1/completions", bomb, "Content-Encoding: gzip"))
        resp = await conn.response()
        assert resp.status == 413 and resp.headers["connection"] == "close"
        assert await asyncio.wait_for(conn.closed_by_server(), 10)
        await conn.close()


@pytest.mark.parametrize(
    ("path", "header"),
    [
        ("/v1/completions", b"x-kvgate-via: \xff"),  # a byte outside UTF-8 in a header the engine gets
        ("/v1/messages", b"anthropic-version: \xff\xfe"),
        ("/v1/messages", "anthropic-beta: caf\u00e9".encode()),  # UTF-8: passed on as sent, not as Latin-1
    ],
)
async def test_header_bytes_beyond_ascii_are_passed_on_as_sent(path: str, header: bytes) -> None:
    """RFC 9110 lets a field value carry bytes beyond ASCII (obs-text): passed on to the engine as the client sent
    them (they were a 500 with a traceback, or re-encoded as Latin-1)."""
    async with gateway_over_sims([SIM]) as (gw, _):
        conn = await RawClient.connect(gw.port)
        body = (
            COMPLETION
            if path == "/v1/completions"
            else json.dumps({"model": "sim", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).encode()
        )
        request = post(path, body)
        head_end = request.index(b"\r\n\r\n")
        await conn.send(request[:head_end] + b"\r\n" + header + request[head_end:])
        assert (await conn.response()).status == 200
        await conn.close()


async def test_a_form_boundary_beyond_ascii_splits_the_form_as_the_client_did() -> None:
    boundary = "caf\u00e9-b"
    form = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nsim\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        f"Content-Type: audio/wav\r\n\r\nRIFF....\r\n--{boundary}--\r\n"
    ).encode()
    async with gateway_over_sims([SIM]) as (gw, _):
        conn = await RawClient.connect(gw.port)
        head = f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(form)}\r\n"
        head += f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n"
        await conn.send(head.encode() + form)
        resp = await conn.response()
        assert resp.status == 200, resp.body
        await conn.close()


async def test_an_absolute_form_target_reaches_the_engine_in_origin_form() -> None:
    """`POST http://evil.com/v1/completions`: the engine gets `POST /v1/completions?...` (RFC 9112 3.2.1: to an
    origin server, origin form), not the client's authority (a proxy between them would route on it)."""
    async with run_sim_engine(SIM) as sim, TcpRelay(sim.port) as relay:
        async with running_gateway(gateway_config([f"http://127.0.0.1:{relay.port}"])) as gw:
            await wait_for(lambda: all(r.routable(0.0) for r in gw.app[REPLICAS]), what="the engine ready")
            conn = await RawClient.connect(gw.port)
            await conn.send(post("http://evil.com/v1/completions?stream=false", COMPLETION))
            assert (await conn.response()).status == 200
            await conn.close()
        assert b"POST /v1/completions?stream=false HTTP/1.1\r\n" in relay.sent and b"evil.com" not in relay.sent


async def test_expect_100_continue() -> None:
    async with gateway_over_sims([SIM], server={"max_body_bytes": 1000}) as (gw, _):
        conn = await RawClient.connect(gw.port)
        head = post("/v1/completions", COMPLETION, "Expect: 100-continue")[: -len(COMPLETION)]
        await conn.send(head)
        interim = await conn.reader.readuntil(b"\r\n\r\n")
        assert interim.startswith(b"HTTP/1.1 100 Continue")
        await conn.send(COMPLETION)
        assert (await conn.response()).status == 200
        # a body declared over the limit is refused before the client sends it
        await conn.send(post("/v1/completions", b"x" * 5000, "Expect: 100-continue")[:-5000])
        assert assert_openai_error(await conn.response(), 413)["code"] == "request_too_large"
        assert await conn.closed_by_server()
        await conn.close()
        # an expectation the gateway does not meet: 417, with a request id it may echo (not a 2,000-byte header)
        conn = await RawClient.connect(gw.port)
        await conn.send(post("/v1/completions", COMPLETION, "Expect: bogus", "x-request-id: " + "r" * 2000))
        refused = await conn.response()
        assert refused.status == 417 and len(refused.headers["x-request-id"]) < 100
        await conn.close()


@pytest.mark.parametrize("shape", ["one-huge-header", "too-many-headers"])
async def test_oversized_head_is_431_and_closes(shape: str) -> None:
    async with gateway_over_sims([SIM]) as (gw, _):
        conn = await RawClient.connect(gw.port)
        if shape == "one-huge-header":
            extra = [f"x-pad: {'a' * 10_000}"]  # over server.max_header_bytes (8190)
        else:
            extra = [f"x-pad-{i}: 1" for i in range(200)]  # over server.max_headers (128)
        await conn.send(post("/v1/completions", COMPLETION, *extra))
        assert_openai_error(await conn.response(), 431, request_id=False)
        assert await conn.closed_by_server()
        await conn.close()


@pytest.mark.parametrize(
    "head",
    [
        "Content-Length: nope",
        "Content-Length: 5\r\nTransfer-Encoding: chunked",  # smuggling: which one frames the body?
        "Content-Length: 5\r\nContent-Length: 7",  # smuggling: duplicate lengths
        "Transfer-Encoding: gzip, chunked, identity",
    ],
)
async def test_malformed_and_ambiguous_framing_is_400_and_closes(head: str) -> None:
    async with gateway_over_sims([SIM]) as (gw, sims):
        conn = await RawClient.connect(gw.port)
        await conn.send(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{head}\r\n\r\nhello".encode())
        error = assert_openai_error(await conn.response(), 400, request_id=False)
        assert error["code"] == "invalid_http_request"
        assert await conn.closed_by_server()
        assert sims[0].engine.stats.started + sims[0].engine.stats.rejected == 0  # nothing reached the engine
        await conn.close()


async def test_a_chunked_http10_request_is_refused_and_nothing_after_it_is_read() -> None:
    """RFC 9112 6.1: Transfer-Encoding in an HTTP/1.0 request is faulty framing (a smuggling shape: aiohttp decoded
    the chunks, kept the connection alive and served the request written after the body)."""
    async with gateway_over_sims([SIM]) as (gw, sims):
        conn = await RawClient.connect(gw.port)
        head = "POST /v1/completions HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked"
        await conn.send(
            f"{head}\r\n\r\n{len(COMPLETION):x}\r\n".encode() + COMPLETION + b"\r\n0\r\n\r\n" + get("/v1/models")
        )
        error = assert_openai_error(await conn.response(), 400, request_id=False)
        assert error["code"] == "invalid_http_request" and "HTTP/1.0" in error["message"]
        assert await conn.closed_by_server() and conn.done == []  # the smuggled GET was not served
        assert sims[0].engine.stats.started == 0
        await conn.close()


async def test_a_transfer_coding_other_than_chunked_is_501() -> None:
    """RFC 9112 6.1: a transfer coding the server does not understand is 501 (aiohttp ignored the gzip of
    `gzip, chunked` and read the chunks as if plain)."""
    async with gateway_over_sims([SIM]) as (gw, sims):
        conn = await RawClient.connect(gw.port)
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked"
        await conn.send(f"{head}\r\n\r\n{len(COMPLETION):x}\r\n".encode() + COMPLETION + b"\r\n0\r\n\r\n")
        error = assert_openai_error(await conn.response(), 501, request_id=False)
        assert error["code"] == "unsupported_transfer_encoding"
        assert await asyncio.wait_for(conn.closed_by_server(), 10)
        assert sims[0].engine.stats.started == 0
        await conn.close()


async def test_a_request_id_sent_twice_is_400() -> None:
    async with gateway_over_sims([SIM]) as (gw, sims):
        conn = await RawClient.connect(gw.port)
        await conn.send(post("/v1/completions", COMPLETION, "X-Request-Id: a-1", "X-Request-Id: b-2"))
        error = assert_openai_error(await conn.response(), 400)
        assert error["param"] == "x-request-id" and sims[0].engine.stats.started == 0
        await conn.close()


@pytest.mark.parametrize("line", ["GET /health HTTP/2.0", "GET /health HTTP/0.9"])
async def test_an_http_version_other_than_1_0_and_1_1_is_505(line: str) -> None:
    """A request line of HTTP/2 (or 0.9) in HTTP/1.1's syntax is answered 505 and the connection closed (it was
    served, with a status line of that version in HTTP/1.1's syntax)."""
    async with gateway_over_sims([SIM]) as (gw, _):
        conn = await RawClient.connect(gw.port)
        await conn.send(f"{line}\r\nHost: x\r\n\r\n".encode())
        data = await asyncio.wait_for(conn.reader.read(65536), 10)
        assert data.split(b" ", 2)[1] == b"505", data[:80]
        assert b'"code":"http_version_not_supported"' in data
        assert await asyncio.wait_for(conn.closed_by_server(), 10)
        await conn.close()


@pytest.mark.parametrize("coding", ["br", "zstd", "foo", "gzip, br", "gzip|gzip", "identity|br"])  # |: two lines
async def test_a_body_in_a_coding_the_gateway_does_not_decode_is_415(coding: str) -> None:
    """A Content-Encoding kvgate does not decode is 415 in OpenAI's shape (not a 400 naming a package to install,
    nor a body passed on as if plain)."""
    async with gateway_over_sims([SIM]) as (gw, sims):
        conn = await RawClient.connect(gw.port)
        await conn.send(post("/v1/completions", COMPLETION, *[f"Content-Encoding: {c}" for c in coding.split("|")]))
        error = assert_openai_error(await conn.response(), 415, request_id=False)
        assert error["code"] == "unsupported_content_encoding" and "install" not in error["message"]
        assert sims[0].engine.stats.started == 0
        await conn.close()


@pytest.mark.parametrize("sent", [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b""], ids=["part", "nothing"])
async def test_a_head_that_never_completes_is_timed_out(sent: bytes) -> None:
    """Part of a head and nothing more, or a connection that sends nothing at all (it would hold one of the
    gateway's connections for keepalive_timeout_s, an hour)."""
    async with gateway_over_sims([SIM], server={"head_timeout_s": 0.3}) as (gw, _):
        conn = await RawClient.connect(gw.port)
        await conn.send(sent)
        error = assert_openai_error(await asyncio.wait_for(conn.response(), 10), 408, request_id=False)
        assert error["code"] == "request_timeout"
        assert await conn.closed_by_server()
        await conn.close()


async def test_a_body_that_never_completes_is_timed_out() -> None:
    async with gateway_over_sims([SIM], server={"body_timeout_s": 0.3}) as (gw, sims):
        conn = await RawClient.connect(gw.port)
        await conn.send(post("/v1/completions", COMPLETION)[:-5])  # the last 5 bytes never come
        error = assert_openai_error(await asyncio.wait_for(conn.response(), 10), 408)
        assert error["code"] == "request_timeout"
        assert await asyncio.wait_for(conn.closed_by_server(), 10)
        assert sims[0].engine.stats.started + sims[0].engine.stats.rejected == 0
        await conn.close()


async def test_an_idle_keep_alive_connection_gives_its_place_to_a_new_one_at_the_cap() -> None:
    """Three connections at a cap of three, each idle after a request (an hour's keep-alive): a new connection is
    served, and the one idle the longest is closed for it; a client whose connections are all busy is refused."""
    async with gateway_over_sims([SIM], server={"max_connections": 3}) as (gw, _):
        held = [await RawClient.connect(gw.port) for _ in range(3)]
        for conn in held:
            await conn.send(get("/health"))
            assert (await conn.response()).status == 200
        await held[2].send(get("/health"))  # the last one used most recently: the first is idle the longest
        assert (await held[2].response()).status == 200
        extra = await RawClient.connect(gw.port)
        await extra.send(post("/v1/completions", COMPLETION))
        assert (await extra.response()).status == 200
        assert await asyncio.wait_for(held[0].closed_by_server(), 10)
        await held[1].send(get("/health"))  # the others still served
        assert (await held[1].response()).status == 200
        await extra.send(get("/metrics"))
        assert b"kvgate_client_connections_reclaimed_total 1.0" in (await extra.response()).body
        for conn in [*held, extra]:
            await conn.close()


async def test_connections_over_the_cap_are_refused_with_503() -> None:
    async with gateway_over_sims([SIM], server={"max_connections": 3}) as (gw, _):
        held = [await RawClient.connect(gw.port) for _ in range(3)]
        for conn in held:
            await conn.send(get("/health"))
            assert (await conn.response()).status == 200
            await conn.send(b"GET /health HTTP/1.1\r\n")  # a next request begun: busy, not idle
        extra = await RawClient.connect(gw.port)
        error = assert_openai_error(await extra.response(), 503, request_id=False)
        assert error["code"] == "too_many_connections" and extra.done == []
        assert await extra.closed_by_server()
        await extra.close()
        await held[0].send(b"Host: x\r\n\r\n" + get("/metrics"))
        assert (await held[0].response()).status == 200
        scraped = (await held[0].response()).body
        assert b"kvgate_client_connections_refused_total 1.0" in scraped and b"kvgate_client_connections 3.0" in scraped
        await held.pop().close()
        await wait_for(lambda: gw.listener.open_connections < 3, what="a slot to free up")
        again = await RawClient.connect(gw.port)
        await again.send(post("/v1/completions", COMPLETION))
        assert (await again.response()).status == 200
        for conn in [*held, again]:
            await conn.close()


@pytest.mark.parametrize("variant", ["http10", "connection-close"])
async def test_http10_and_connection_close_close_the_connection(variant: str) -> None:
    async with gateway_over_sims([SIM]) as (gw, _):
        conn = await RawClient.connect(gw.port)
        if variant == "http10":
            await conn.send(post("/v1/completions", COMPLETION, version="1.0"))
        else:
            await conn.send(post("/v1/completions", COMPLETION, "Connection: close"))
        resp = await conn.response()
        assert resp.status == 200 and int(resp.headers["content-length"]) == len(resp.body)
        assert await conn.closed_by_server()
        await conn.close()


async def test_http10_keep_alive_is_honoured() -> None:
    async with gateway_over_sims([SIM]) as (gw, _):
        conn = await RawClient.connect(gw.port)
        for _ in range(2):
            await conn.send(post("/v1/completions", COMPLETION, "Connection: keep-alive", version="1.0"))
            resp = await conn.response()
            assert resp.status == 200 and resp.headers["connection"].lower() == "keep-alive"
        await conn.close()


async def test_a_client_that_stops_reading_backs_up_into_the_engine_not_the_gateway() -> None:
    """Flow control end to end: the client stops reading a long stream; the server's writes wait, the upstream
    connection stops reading at its high-water mark, and the gateway holds a bounded amount of the stream (the
    rest waits in the engine and the kernel). Then the client reads it all, intact."""
    sim = SimConfig(model="sim", instant=True, max_model_len=400_000, num_blocks=30_000)
    async with gateway_over_sims([sim]) as (gw, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port, limit=1 << 26)
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
        body = json.dumps({"model": "sim", "prompt": "hello", "max_tokens": 300_000, "stream": True}).encode()
        writer.write(post("/v1/completions", body))
        await writer.drain()
        reader._transport.pause_reading()  # type: ignore[attr-defined]  # stop reading: the socket fills
        sim_port = int(gw.app[REPLICAS].for_model("sim")[0].port)
        pool = gw.app[UPSTREAM].pool("127.0.0.1", sim_port)
        await wait_for(lambda: pool.read_pauses > 0, timeout_s=60, what="the upstream read to pause")
        server = gw.listener.runner.server
        assert server is not None
        for handler in server.connections:
            assert handler.transport is not None
            assert handler.transport.get_write_buffer_size() <= 1 << 20
        reader._transport.resume_reading()  # type: ignore[attr-defined]
        raw = await asyncio.wait_for(reader.readuntil(b"data: [DONE]\n\n\r\n"), 120)
        assert raw.count(b'"text":') == 300_000  # every token arrived, in one intact stream
        writer.close()


async def test_streaming_with_openai() -> None:
    async with gateway_over_sims([SIM]) as (gw, _):
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
            raw = await client.chat.completions.with_raw_response.create(
                model="sim",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
            assert raw.headers.get("transfer-encoding") == "chunked"
            chunks = [chunk async for chunk in raw.parse()]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


async def test_shutdown_finishes_running_requests_and_closes_idle_connections() -> None:
    slow = SimConfig(model="sim", overhead_ms=0, prefill_us_per_token=0, decode_ms=20)
    async with gateway_over_sims([slow]) as (gw, sims):
        idle = await RawClient.connect(gw.port)
        await idle.send(post("/v1/completions", COMPLETION))
        assert (await idle.response()).status == 200
        busy = await RawClient.connect(gw.port)
        await busy.send(post("/v1/completions", json.dumps({"model": "sim", "prompt": "x", "max_tokens": 20}).encode()))
        await wait_for(lambda: sims[0].engine.running == 1, what="request running")
        stopping = asyncio.create_task(gw.listener.stop())
        assert await idle.closed_by_server()
        resp = await busy.response()
        assert resp.status == 200 and json.loads(resp.body)["usage"]["completion_tokens"] == 20
        await stopping
        await idle.close()
        await busy.close()


async def test_every_garbage_collection_is_timed_as_the_pause_it_is() -> None:
    """A collection stops the event loop and so every request in flight: the gateway's metrics time each one by
    generation, from its start to its end, and stop timing when the gateway stops."""
    before = list(gc.callbacks)
    async with gateway_over_sims([SIM]) as (gw, _):
        gc.collect()
        conn = await RawClient.connect(gw.port)
        await conn.send(get("/metrics"))
        scraped = (await conn.response()).body.decode()
        await conn.close()
    assert gc.callbacks == before
    full = re.search(r'^kvgate_gc_pause_seconds_count\{generation="2"\} (\S+)$', scraped, re.M)
    total = re.search(r'^kvgate_gc_pause_seconds_sum\{generation="2"\} (\S+)$', scraped, re.M)
    assert full and float(full.group(1)) >= 1 and total and float(total.group(1)) > 0


MESSAGE = json.dumps({"model": "sim", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (post("/v1/messages?beta=true", MESSAGE, "X-Long: " + "a" * 9000), 431),
        (post("/v1/messages", MESSAGE, *[f"X-{i}: y" for i in range(200)]), 431),
        (post("/v1/messages", MESSAGE, "Content-Encoding: br"), 415),
        (post("/v1/messages", MESSAGE, "Content-Length: 3"), 400),
        (post("/v1/messages", MESSAGE, version="2.0"), 505),
    ],
    ids=["header-too-long", "too-many-headers", "encoding", "framing", "version"],
)
async def test_a_protocol_error_on_the_messages_route_is_in_anthropics_shape(request_bytes: bytes, status: int) -> None:
    """Claude Code and the anthropic SDK read `error.type` of Anthropic's shape: these came in OpenAI's."""
    async with gateway_over_sims([SIM]) as (gw, sims):
        conn = await RawClient.connect(gw.port)
        await conn.send(request_bytes)
        resp = await conn.response()
        payload = json.loads(resp.body)
        assert resp.status == status and payload["type"] == "error", resp.body
        assert set(payload["error"]) >= {"type", "message"} and sims[0].engine.stats.started == 0
        await conn.close()


async def test_a_client_that_takes_none_of_a_whole_answer_gives_its_connection_up() -> None:
    """A multi-megabyte answer (the token ids of a 2 MB prompt) to a client that reads 200 bytes and stops: the
    connection waited for it forever (aiohttp's drain has no deadline), one of `max_connections` never given back."""
    async with gateway_over_sims([SIM], server={"send_timeout_s": 1.0}) as (gw, _):
        conn = await RawClient.connect(gw.port)
        prompt = json.dumps({"model": "sim", "prompt": "word " * 1_500_000}).encode()
        await conn.send(post("/tokenize", prompt))
        assert len(await conn.reader.read(200)) > 0  # the answer began; nothing more is read
        await wait_for(lambda: gw.listener.open_connections == 0, timeout_s=30, what="the connection given up")
        await conn.close()
