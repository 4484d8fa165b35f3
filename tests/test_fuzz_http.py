"""Fuzzing the real server on loopback: hypothesis builds request heads and bodies (methods, paths, header names
and values, framing headers that lie, JSON that is almost right, bytes that are not JSON); each is sent raw over a
socket to one running gateway. Every request must get an answer (or a clean close) within a bound, never a 5xx,
and a good request right after it must succeed. Pipelined: good requests, then fuzzed ones and more good ones, all
in one write on one connection: every good request before the first fuzzed one is answered, in order. The gateway
runs on its own event loop in a thread, so the test itself is plain synchronous hypothesis (seeded:
`derandomize=True`)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httptools
import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simengine import SimConfig
from tests.conftest import gateway_over_sims

ANSWER_WITHIN_S = 10.0  # every bound the gateway applies (head/body timeouts below) is far shorter
GOOD = json.dumps({"model": "sim", "prompt": "hello", "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    ready: list[int] = []
    started = threading.Event()
    loop = uvloop.new_event_loop()
    stop = asyncio.Event()

    async def serve() -> None:
        limits = {"head_timeout_s": 0.5, "body_timeout_s": 0.5, "max_body_bytes": 65_536}
        async with gateway_over_sims([SimConfig(model="sim", instant=True)], server=limits) as (gw, _):
            ready.append(gw.port)
            started.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(30), "the gateway did not start"
    yield ready[0]
    loop.call_soon_threadsafe(stop.set)
    thread.join(30)
    loop.close()


class _Answer:
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.complete = False
        self.status = 0

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_message_complete(self) -> None:
        self.complete = True


def exchange(port: int, data: bytes) -> int | None:
    """Send `data`, read the first answer: its status, or None when the server closed without one."""
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_WITHIN_S) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server refused early (and closed): its answer may still be readable
        answer = _Answer()
        while not answer.complete:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return answer.status or None
            try:
                answer.parser.feed_data(chunk)
            except httptools.HttpParserError:
                pytest.fail(f"the server's answer is not HTTP: {chunk[:200]!r}")
        return answer.status


def answers(port: int, data: bytes, count: int) -> list[tuple[int, str]]:
    """Send `data` in one write and read `count` answers in order: (status, x-request-id) each; fewer when the
    server closed first."""
    done: list[tuple[int, str]] = []

    class Reader(_Answer):
        def __init__(self) -> None:
            super().__init__()
            self.request_id = ""

        def on_header(self, name: bytes, value: bytes) -> None:
            if name.lower() == b"x-request-id":
                self.request_id = value.decode("latin-1")

        def on_message_complete(self) -> None:
            done.append((self.parser.get_status_code(), self.request_id))
            self.request_id = ""

    reader = Reader()
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_WITHIN_S) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        while len(done) < count:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                break
            try:
                reader.parser.feed_data(chunk)
            except httptools.HttpParserError:
                pytest.fail(f"the server's answer is not HTTP: {chunk[:200]!r}")
    return done[:count]


def good_request(request_id: str) -> bytes:
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nx-request-id: {request_id}\r\n"
    return f"{head}Content-Length: {len(GOOD)}\r\n\r\n".encode() + GOOD


def good_request_succeeds(port: int) -> bool:
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(GOOD)}\r\n\r\n".encode()
    return exchange(port, head + GOOD) == 200


token = st.text(st.characters(codec="latin-1", exclude_characters="\r\n"), max_size=20)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
near_miss = st.fixed_dictionaries(
    {"model": st.sampled_from(["sim", "", "other"]) | json_value},
    optional={
        "prompt": json_value,
        "messages": st.lists(st.dictionaries(st.sampled_from(["role", "content"]), json_value), max_size=3),
        "max_tokens": st.integers(-5, 5) | json_value,
        "stream": st.booleans() | json_value,
        "n": st.integers(-1, 3),
    },
)
# Many brackets, then a string that never closes (with escapes in it): what once sent the nesting check's regex
# into exponential backtracking.
unterminated = st.builds(
    lambda brackets, letters: b"[]" * brackets + b'"' + letters,
    st.integers(33, 200),
    st.binary(max_size=60).map(lambda b: b.replace(b'"', b"a")) | st.sampled_from([b"a" * 40, b"\\a" * 20]),
)
body = (
    near_miss.map(lambda d: json.dumps(d).encode())
    | json_value.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=300)
    | unterminated
)
method = st.sampled_from(["POST", "GET", "PUT", "DELETE", "OPTIONS", "PATCH"]) | token
path = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/admin/reload"]) | (
    token.map(lambda t: "/" + t.replace(" ", ""))
)
framing = st.sampled_from(["exact", "none", "short", "long", "chunked", "both", "twice"])
header = st.tuples(
    st.sampled_from(["x-request-id", "Authorization", "Expect", "Content-Type", "x-session-id"]) | token, token
)


def raw_request(method: str, path: str, headers: list[tuple[str, str]], body: bytes, framing: str) -> bytes:
    lines = [f"{method} {path or '/'} HTTP/1.1", "Host: x", *(f"{k}: {v}" for k, v in headers)]
    payload = body
    if framing == "exact":
        lines.append(f"Content-Length: {len(body)}")
    elif framing == "short":
        lines.append(f"Content-Length: {max(0, len(body) - 3)}")
    elif framing == "long":
        lines.append(f"Content-Length: {len(body) + 7}")  # the body never completes: the body timeout answers
    elif framing in ("chunked", "both"):
        lines.append("Transfer-Encoding: chunked")
        if framing == "both":
            lines.append(f"Content-Length: {len(body)}")
        payload = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    elif framing == "twice":
        lines += [f"Content-Length: {len(body)}", f"Content-Length: {len(body) + 1}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload


@settings(
    max_examples=120, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(method, path, st.lists(header, max_size=4), body, framing)
def test_no_input_gets_a_5xx_or_a_hang(
    port: int, method: str, path: str, headers: list[tuple[str, str]], body: bytes, framing: str
) -> None:
    status = exchange(port, raw_request(method, path, headers, body, framing))
    assert status is None or status < 500, (status, method, path, headers, body[:80], framing)
    assert good_request_succeeds(port)


fuzzed_request = st.builds(raw_request, method, path, st.lists(header, max_size=3), body, framing) | st.binary(
    min_size=1, max_size=80
)


@settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 4), st.lists(st.none() | fuzzed_request, min_size=1, max_size=4))
def test_good_requests_pipelined_before_a_bad_one_are_all_answered(
    port: int, good_first: int, rest: list[bytes | None]
) -> None:
    """`good_first` good requests, then a fuzzed one, then fuzzed and good ones (None), in one write."""
    rest = [b"GARBAGE\r\n\r\n" if rest[0] is None else rest[0], *rest[1:]]
    later = [good_request(f"later{i}") if item is None else item for i, item in enumerate(rest)]
    data = b"".join(good_request(f"good{i}") for i in range(good_first)) + b"".join(later)
    got = answers(port, data, good_first)
    assert got == [(200, f"good{i}") for i in range(good_first)], (got, rest)
    assert good_request_succeeds(port)


def test_the_fuzz_fixture_serves(port: int) -> None:
    assert good_request_succeeds(port)
    data: dict[str, Any] = {"model": "sim", "prompt": "x"}
    assert exchange(port, raw_request("POST", "/v1/completions", [], json.dumps(data).encode(), "exact")) == 200
