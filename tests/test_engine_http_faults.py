"""The engine client's framing against an engine that controls every byte (engine_pool.http_exchange): an interim
1xx answer is skipped and the final one awaited (never taken as the answer, so never read as the next request's); a
101 fails; bytes after an answer or on an idle connection fail that connection instead of answering the next
request; a response head over `MAX_HEAD_BYTES` fails after at most that many bytes, whatever the engine sends; a
body delimited by the connection's close ends there normally, while a framed body cut by a close still fails.

The fake engine is a raw asyncio TCP server: each request's answer is written by the test, byte for byte. Where the
order of the client's reads matters (an interim answer alone in a segment), the engine waits until the client's
connection has received the bytes so far (`Received`), not for a time."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from engine_pool import http_exchange
from engine_pool.http_client import UpstreamClient, UpstreamConnectionError

HANG_GUARD_S = 10  # only a hang ends here; every wait below is on a condition

Answer = Callable[[asyncio.StreamWriter, str], Awaitable[bool]]  # (writer, path) -> keep the connection open


def answer(name: str, *, version: bytes = b"1.1", extra: bytes = b"") -> bytes:
    body = b"answer-for-" + name.encode()
    return b"HTTP/%s 200 OK\r\n%bContent-Length: %d\r\n\r\n%b" % (version, extra, len(body), body)


class Engine:
    """Reads each request (its head, then its Content-Length body) and lets `respond` write the answer."""

    def __init__(self, respond: Answer) -> None:
        self.respond = respond
        self.connections = 0
        self.paths: list[str] = []
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                path = head.split(" ", 2)[1]
                length = next(
                    int(line.split(":", 1)[1])
                    for line in head.split("\r\n")
                    if line.lower().startswith("content-length:")
                )
                await reader.readexactly(length)
                self.paths.append(path)
                if not await self.respond(writer, path):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed or aborted the connection
        finally:
            writer.close()


@asynccontextmanager
async def engine(respond: Answer) -> AsyncIterator[tuple[Engine, str]]:
    fake = Engine(respond)
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    fake.port = server.sockets[0].getsockname()[1]
    try:
        yield fake, f"http://127.0.0.1:{fake.port}"
    finally:
        server.close()


class Received:
    """Bytes the client's connections have received, for an engine that must know its last write was read."""

    def __init__(self) -> None:
        self.total = 0
        self._more = asyncio.Event()

    def add(self, size: int) -> None:
        self.total += size
        self._more.set()

    async def reach(self, total: int) -> None:
        async with asyncio.timeout(HANG_GUARD_S):
            while self.total < total:
                self._more.clear()
                await self._more.wait()


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    """The engine client, its connections closed after the test (the engine's handlers then end)."""
    upstream = UpstreamClient()
    try:
        yield upstream
    finally:
        upstream.close()


@pytest.fixture
def received(monkeypatch: pytest.MonkeyPatch) -> Received:
    seen = Received()
    feed = http_exchange.EngineConnection.data_received

    def counted(conn: http_exchange.EngineConnection, data: bytes) -> None:
        seen.add(len(data))
        feed(conn, data)

    monkeypatch.setattr(http_exchange.EngineConnection, "data_received", counted)
    return seen


async def fetch(client: UpstreamClient, url: str) -> tuple[int, bytes]:
    return await client.fetch("POST", url, b"{}", timeout_s=HANG_GUARD_S)


# --- interim 1xx answers ----------------------------------------------------------------------------------------------
INTERIMS = {
    "103": b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n",
    "100": b"HTTP/1.1 100 Continue\r\n\r\n",
    "two": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n",
}


@pytest.mark.parametrize("interim", INTERIMS.values(), ids=INTERIMS.keys())
async def test_an_interim_answer_alone_in_its_segment_is_skipped_and_not_read_as_the_next_answer(
    interim: bytes, received: Received, client: UpstreamClient
) -> None:
    """The engine's interim answer reaches the client on its own, then the final one: the request gets the final
    answer, and the next request on the kept-alive connection gets its own (the 1xx taken as the answer would
    have pooled the connection with the final answer still to come: the next client's)."""

    async def respond(writer: asyncio.StreamWriter, path: str) -> bool:
        if path == "/alice":
            writer.write(interim)
            await received.reach(received.total + len(interim))
        writer.write(answer(path[1:]))
        return True

    async with engine(respond) as (fake, url):
        assert await fetch(client, url + "/alice") == (200, b"answer-for-alice")
        assert await fetch(client, url + "/bob") == (200, b"answer-for-bob")
        assert fake.connections == 1  # the connection was kept, after the final answer


async def test_the_response_is_the_final_answers_when_an_interim_one_comes_in_the_same_segment(
    client: UpstreamClient,
) -> None:
    """Status, headers and body are the final answer's: the interim one's headers are dropped with it."""

    async def respond(writer: asyncio.StreamWriter, path: str) -> bool:
        writer.write(INTERIMS["103"] + answer(path[1:], extra=b"X-Final: yes\r\n"))
        return True

    async with engine(respond) as (fake, url):
        pool = client.pool("127.0.0.1", fake.port)
        resp = await pool.request("POST", "/alice", b"{}", {}, connect_timeout_s=HANG_GUARD_S)
        async with asyncio.timeout(HANG_GUARD_S):
            await resp.headers_ready
            body = await resp.read(1000)
        assert (resp.status, body) == (200, b"answer-for-alice")
        assert [name for name, _ in resp.headers] == [b"X-Final", b"Content-Length"]
        resp.release()
        assert await fetch(client, url + "/bob") == (200, b"answer-for-bob")


async def test_a_switch_of_protocols_fails_the_request_and_the_next_gets_its_own_answer(client: UpstreamClient) -> None:
    async def respond(writer: asyncio.StreamWriter, path: str) -> bool:
        if path == "/alice":
            writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
            writer.write(b"\x81\x05hello")  # what the engine would then speak
            return True
        writer.write(answer(path[1:]))
        return True

    async with engine(respond) as (fake, url):
        with pytest.raises(UpstreamConnectionError, match="101"):
            await fetch(client, url + "/alice")
        assert await fetch(client, url + "/bob") == (200, b"answer-for-bob")
        assert fake.connections == 2  # the switched connection was not reused


# --- bytes that answer no request -------------------------------------------------------------------------------------
async def test_an_answer_after_the_answer_in_the_same_segment_is_not_the_clients_or_the_next_ones(
    client: UpstreamClient,
) -> None:
    async def respond(writer: asyncio.StreamWriter, path: str) -> bool:
        writer.write(answer(path[1:]) + (answer("nobody") if path == "/alice" else b""))
        return True

    async with engine(respond) as (fake, url):
        assert await fetch(client, url + "/alice") == (200, b"answer-for-alice")
        assert await fetch(client, url + "/bob") == (200, b"answer-for-bob")
        assert fake.connections == 2


async def test_an_answer_on_an_idle_pooled_connection_closes_it_instead_of_answering_the_next_request(
    received: Received, client: UpstreamClient
) -> None:
    first_done = asyncio.Event()

    async def respond(writer: asyncio.StreamWriter, path: str) -> bool:
        writer.write(answer(path[1:]))
        if path == "/alice":
            await received.reach(received.total + len(answer("alice")))
            await first_done.wait()  # the connection is back in the pool
            writer.write(answer("nobody"))
            await received.reach(received.total + len(answer("nobody")))
        return True

    async with engine(respond) as (fake, url):
        assert await fetch(client, url + "/alice") == (200, b"answer-for-alice")
        first_done.set()
        await received.reach(len(answer("alice")) + len(answer("nobody")))
        assert await fetch(client, url + "/bob") == (200, b"answer-for-bob")
        assert fake.connections == 2


# --- the bound on a head ----------------------------------------------------------------------------------------------
async def test_an_endless_header_fails_within_the_heads_bound(received: Received, client: UpstreamClient) -> None:
    """The engine would send 16 MiB of one header line; the client stops after `MAX_HEAD_BYTES` (plus what one
    read brought), fails the request, and the next request gets its own answer on a new connection."""
    piece = b"a" * 65536

    async def respond(writer: asyncio.StreamWriter, path: str) -> bool:
        if path == "/bob":
            writer.write(answer("bob"))
            return True
        writer.write(b"HTTP/1.1 200 OK\r\nX-Endless: ")
        for _ in range(256):
            writer.write(piece)
            await writer.drain()  # raises once the client aborted
        return True

    async with engine(respond) as (fake, url):
        with pytest.raises(UpstreamConnectionError, match="head"):
            await fetch(client, url + "/alice")
        assert received.total <= http_exchange.MAX_HEAD_BYTES + 256 * 1024  # the bound, and at most one read more
        assert await fetch(client, url + "/bob") == (200, b"answer-for-bob")
        assert fake.connections == 2


@pytest.mark.parametrize("one_write", [True, False])
async def test_a_whole_megabyte_header_fails_and_is_not_relayed(one_write: bool, client: UpstreamClient) -> None:
    big = b"X-Big: " + b"b" * (1024 * 1024) + b"\r\n"

    async def respond(writer: asyncio.StreamWriter, path: str) -> bool:
        if path == "/bob":
            writer.write(answer("bob"))
        elif one_write:
            writer.write(b"HTTP/1.1 200 OK\r\n" + big + b"Content-Length: 2\r\n\r\nok")
        else:
            writer.writelines([b"HTTP/1.1 200 OK\r\n", big[:100], big[100:], b"Content-Length: 2\r\n\r\nok"])
        return True

    async with engine(respond) as (_, url):
        with pytest.raises(UpstreamConnectionError, match="head"):
            await fetch(client, url + "/alice")
        assert await fetch(client, url + "/bob") == (200, b"answer-for-bob")


async def test_endless_interim_answers_count_against_the_heads_bound(client: UpstreamClient) -> None:
    async def respond(writer: asyncio.StreamWriter, path: str) -> bool:
        for _ in range(100_000):  # about 5 MiB of interim answers, never a final one
            writer.write(INTERIMS["103"])
            await writer.drain()
        return True

    async with engine(respond) as (_, url):
        with pytest.raises(UpstreamConnectionError, match="head"):
            await fetch(client, url + "/alice")


@pytest.mark.parametrize("over", [0, 1])
async def test_a_head_at_the_bound_passes_and_one_byte_more_fails(over: int, client: UpstreamClient) -> None:
    """The bound is on the head's bytes alone: a head of exactly `MAX_HEAD_BYTES` with a large body in the same
    write is read whole."""
    start = b"HTTP/1.1 200 OK\r\nContent-Length: 300000\r\nX-Pad: "
    pad = b"p" * (http_exchange.MAX_HEAD_BYTES - len(start) - len(b"\r\n\r\n") + over)
    body = b"z" * 300_000

    async def respond(writer: asyncio.StreamWriter, path: str) -> bool:
        writer.write(answer("bob") if path == "/bob" else start + pad + b"\r\n\r\n" + body)
        return True

    async with engine(respond) as (_, url):
        if over:
            with pytest.raises(UpstreamConnectionError, match="head"):
                await fetch(client, url + "/alice")
        else:
            assert await fetch(client, url + "/alice") == (200, body)
        assert await fetch(client, url + "/bob") == (200, b"answer-for-bob")


# --- a body that ends at the connection's close -----------------------------------------------------------------------
CLOSE_DELIMITED = {
    "http10": b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n",
    "http11_unframed": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n",
    "http11_close": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n",
    "not_chunked_coding": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\n",
}


@pytest.mark.parametrize("head", CLOSE_DELIMITED.values(), ids=CLOSE_DELIMITED.keys())
async def test_a_body_delimited_by_the_close_is_whole_and_its_connection_not_reused(
    head: bytes, client: UpstreamClient
) -> None:
    async def respond(writer: asyncio.StreamWriter, path: str) -> bool:
        if path == "/bob":
            writer.write(answer("bob"))
            return True
        writer.write(head + b"answer-")
        await writer.drain()
        writer.write(b"for-alice")
        return False  # the close (FIN) ends the body

    async with engine(respond) as (fake, url):
        assert await fetch(client, url + "/alice") == (200, b"answer-for-alice")
        assert await fetch(client, url + "/bob") == (200, b"answer-for-bob")
        assert fake.connections == 2


async def test_a_streamed_body_delimited_by_the_close_ends_there(client: UpstreamClient) -> None:
    events = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]

    async def respond(writer: asyncio.StreamWriter, path: str) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        for event in events:
            writer.write(event)
            await writer.drain()
        return False

    async with engine(respond) as (fake, _):
        resp = await client.pool("127.0.0.1", fake.port).request(
            "POST", "/stream", b"{}", {}, connect_timeout_s=HANG_GUARD_S
        )
        async with asyncio.timeout(HANG_GUARD_S):
            await resp.headers_ready
            got = b"".join([chunk async for chunk in resp.iter_chunks()])
        assert (resp.status, got, resp.complete, resp.error) == (200, b"".join(events), True, None)
        resp.release()


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


CUT_SHORT = {
    "content_length": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nanswer-",
    "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7\r\nanswer-\r\n",
    "content_length_http10": b"HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\nanswer-",
    "head_only": b"HTTP/1.1 200 OK\r\nContent-Ty",
    "interim_only": INTERIMS["103"],
}


@pytest.mark.parametrize("sent", CUT_SHORT.values(), ids=CUT_SHORT.keys())
async def test_a_framed_body_or_a_head_cut_by_the_close_still_fails(sent: bytes, client: UpstreamClient) -> None:
    async def respond(writer: asyncio.StreamWriter, path: str) -> bool:
        writer.write(sent)
        return False

    async with engine(respond) as (_, url):
        with pytest.raises(UpstreamConnectionError, match="closed"):
            await fetch(client, url + "/alice")


async def test_a_body_delimited_by_the_close_cut_by_a_reset_fails(client: UpstreamClient) -> None:
    async def respond(writer: asyncio.StreamWriter, path: str) -> bool:
        writer.write(CLOSE_DELIMITED["http10"] + b"answer-")
        await writer.drain()
        _reset(writer)
        return False

    async with engine(respond) as (_, url):
        with pytest.raises(UpstreamConnectionError):
            await fetch(client, url + "/alice")
