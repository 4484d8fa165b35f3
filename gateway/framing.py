"""What the listener reads of a connection's raw bytes beside aiohttp's parser, which exposes neither a chunk's
announced size nor where a request ended: the first chunk-size line of a chunked request body, so that a body
announced over `server.max_body_bytes` is refused at once instead of being waited for; and how many bytes of the next
head follow a request that ended in a segment (`after_request`), for `server.max_head_bytes`.

The body starts after the head's end, the first CRLF CRLF in the segment the head ended in (a head holds no other;
the 3 bytes kept from the segment before find one split across two). `gateway.listener` uses it only where the
segment's bytes are known to be that request's (the only request whose head ended in it, nothing parsed earlier left
unread); elsewhere the limit applies as the body is read. A guess that is wrong reads a line that is not hex (a
request line, a header) and is ignored. Cost: one `bytes.find` on a segment in which a chunked head ended, then a
few bytes kept per segment until the line ends; at most `MAX_LINE` bytes are kept.
And what of a parsed head makes its request one the gateway will not serve (`faulty`): its HTTP version, its body's
coding, Transfer-Encoding in HTTP/1.0. Cost: a few header lookups per request.
"""

from __future__ import annotations

from aiohttp import HttpVersion10, HttpVersion11
from aiohttp.http_parser import RawRequestMessage

from gateway.errors import (
    BadRequest,
    GatewayError,
    HttpVersionNotSupported,
    UnsupportedEncoding,
    UnsupportedTransferCoding,
)

_BLANK_LINE = b"\r\n\r\n"
CARRY = len(_BLANK_LINE) - 1  # bytes of a segment kept for the next one's `body_start`
MAX_LINE = 1024  # a longer chunk-size line (extensions) is not read: the limit then applies as the body arrives
_HEX = frozenset(b"0123456789abcdefABCDEF")


def body_start(carry: bytes, data: bytes) -> int | None:
    """Where in `data` the body starts: just after the first CRLF CRLF of `carry + data`; None when there is none."""
    end = (carry + data).find(_BLANK_LINE)
    return None if end < 0 else end + len(_BLANK_LINE) - len(carry)


def after_request(data: bytes, body_len: int) -> int:
    """Bytes at the end of `data` after a request that ended in it with a body of `body_len` bytes (the start of the
    next head): what follows the last CRLF CRLF that leaves room for that body. A body holding CRLF CRLF can only
    make it fewer than there are (never more); 0 when no head ends in `data`. One `bytes.rfind`."""
    if body_len > len(data) - len(_BLANK_LINE):
        return 0
    end = data.rfind(_BLANK_LINE, 0, len(data) - body_len)
    return 0 if end < 0 else len(data) - end - len(_BLANK_LINE) - body_len


def announced_size(line: bytes) -> int | None:
    """The size a chunk-size line (`HEX[;ext...]`, without its CRLF) announces; None when it is not one."""
    digits = line.split(b";", 1)[0].strip(b" \t")
    if not digits or not _HEX.issuperset(digits):
        return None
    return int(digits, 16)


class ChunkLine:
    """Collects the first line of a chunked body from its raw bytes, fed in order from the body's first byte."""

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        self._kept = b""

    def feed(self, data: bytes) -> tuple[bool, int | None]:
        """(whether the line is over, the size it announces); (True, None): not a size line or too long to read."""
        self._kept += data[: MAX_LINE + 2 - len(self._kept)]
        end = self._kept.find(b"\r\n")
        if end >= 0:
            return True, announced_size(self._kept[:end])
        return len(self._kept) > MAX_LINE, None


DECODED = "gzip, deflate"  # the request Content-Encodings the gateway decodes (aiohttp's, without extras)
_CODINGS = frozenset({"", "identity", "gzip", "x-gzip", "deflate"})


def faulty(message: RawRequestMessage) -> GatewayError | None:
    """What makes a parsed request one the gateway will not serve, though aiohttp's parser took it: an HTTP version
    other than 1.0 and 1.1 (505, as nginx answers), a body in a coding it would pass on undecoded as if plain (415),
    a transfer coding other than chunked (501, RFC 9112 6.1), and Transfer-Encoding in an HTTP/1.0 request, whose
    framing RFC 9112 6.1 says to distrust (a request-smuggling shape; 400, and the connection closes)."""
    if message.version not in (HttpVersion10, HttpVersion11):  # HTTP/2 or 0.9 in HTTP/1.1's syntax: neither
        return HttpVersionNotSupported(
            f"HTTP/{message.version.major}.{message.version.minor} is not supported: use HTTP/1.1"
        )
    coding = ", ".join(message.headers.getall("Content-Encoding", ())).strip().lower()  # every line of it
    if coding not in _CODINGS:
        return UnsupportedEncoding(f"the request body's Content-Encoding {coding[:40]!r} is not supported ({DECODED})")
    coded = message.headers.get("Transfer-Encoding")
    if coded is not None and coded.strip().lower() != "chunked" and message.version >= HttpVersion11:
        # RFC 9112 6.1: a coding the server does not understand (aiohttp ignored it, decoding chunks)
        return UnsupportedTransferCoding(f"Transfer-Encoding {coded[:40]!r} is not supported: only chunked")
    if message.version < HttpVersion11 and "Transfer-Encoding" in message.headers:
        return BadRequest(
            "malformed HTTP request: Transfer-Encoding in an HTTP/1.0 request", code="invalid_http_request"
        )
    return None
