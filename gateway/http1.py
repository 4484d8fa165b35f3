"""HTTP/1.1 helpers for the fast path: response heads, the Date header, and finding request boundaries.

`request_boundary` answers "where does the n-th request in these bytes end?", which httptools (llhttp) does not
expose. It re-parses the bytes with a fresh parser in `step`-byte feeds until the n-th request completes, then again
one byte at a time within that last step: O(len) parser work plus at most `step` one-byte feeds. The fast path only
needs it when a connection is handed to aiohttp while earlier pipelined requests shared its buffered bytes (rare).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from email.utils import formatdate
from http import HTTPStatus
from types import MappingProxyType

import httptools

REASONS: Mapping[int, str] = MappingProxyType({s.value: s.phrase for s in HTTPStatus})


class DateHeader:
    """`Date: ...\\r\\n`, formatted at most once a second."""

    __slots__ = ("_line", "_second")

    def __init__(self) -> None:
        self._second = -1
        self._line = ""

    def line(self) -> str:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._line = f"Date: {formatdate(now, usegmt=True)}\r\n"
        return self._line


def response_head(status: int, headers: Mapping[str, str], date: str, tail: str) -> bytes:
    """Status line, `headers`, the Date line and `tail` (framing and Connection lines, ending with a blank line)."""
    fields = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    return f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\n{fields}{date}{tail}".encode("latin-1")


_SEARCH: dict[str, bytes] = {}  # header name -> what `RawHeaders.get` searches for


class RawHeaders(Mapping[str, str]):
    """A request's header block, looked up by lower-case name without parsing every header: one lower-cased copy,
    then one `find` per lookup (a request needs about five). The first of repeated headers wins, as aiohttp's
    `get`. `block` is the head after the request line, starting with CRLF and without the final blank line."""

    __slots__ = ("_block", "_lower")

    def __init__(self, block: bytes) -> None:
        self._block = block
        self._lower = block.lower()

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        key = _SEARCH.get(name)
        if key is None:
            key = b"\r\n" + name.encode("latin-1") + b":"
            if len(_SEARCH) < 256:  # names come from the code and the config
                _SEARCH[name] = key
        at = self._lower.find(key)
        if at < 0:
            return default
        start = at + len(key)
        end = self._block.find(b"\r\n", start)
        return self._block[start : end if end >= 0 else None].strip(b" \t").decode("latin-1")

    def __getitem__(self, name: str) -> str:
        value = self.get(name.lower())
        if value is None:
            raise KeyError(name)
        return value

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name.lower()) is not None

    def __iter__(self) -> Iterator[str]:
        names = (line.partition(b":")[0].decode("latin-1") for line in self._lower.split(b"\r\n")[1:])
        return iter(dict.fromkeys(names))

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _Count:
    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def on_message_complete(self) -> None:
        self.n += 1


def request_boundary(raw: bytes, n: int, step: int = 4096) -> int:
    """Offset just past the n-th complete request in `raw`, which must start at a request boundary; -1 when `raw`
    holds fewer than n complete requests."""
    if n <= 0:
        return 0
    count = _Count()
    parser = httptools.HttpRequestParser(count)
    pos = 0
    while True:
        if pos >= len(raw):
            return -1
        try:
            parser.feed_data(raw[pos : pos + step])
        except httptools.HttpParserError:
            if count.n < n:
                return -1
        if count.n >= n:
            break
        pos += step
    count = _Count()
    parser = httptools.HttpRequestParser(count)
    if pos:
        parser.feed_data(raw[:pos])
    for i in range(pos, min(pos + step, len(raw))):
        parser.feed_data(raw[i : i + 1])
        if count.n >= n:
            return i + 1
    return -1
