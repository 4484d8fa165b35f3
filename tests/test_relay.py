"""A stream's events out of an engine's chunks, on literal bytes."""

from __future__ import annotations

import json

import pytest

from engine_pool.http_client import UpstreamConnectionError
from gateway.answers import split_usage
from gateway.errors import UpstreamUnavailable, error_event
from gateway.relay import MAX_EVENT_BYTES, SseSplitter, sequence_number


def test_an_engine_chunk_of_one_event_is_that_event() -> None:
    assert SseSplitter().feed(b'data: {"a":1}\n\n') == [b'data: {"a":1}\n\n']


def test_events_split_and_joined_across_chunks_come_out_whole() -> None:
    s = SseSplitter()
    assert s.feed(b"\n") == []  # a lone line end is no event
    assert s.feed(b"data: 1\n\ndata: ") == [b"\ndata: 1\n\n"]
    assert s.feed(b"2\n") == []
    assert s.feed(b"\ndata: 3\n\n") == [b"data: 2\n\n", b"data: 3\n\n"]
    assert s.feed(b"event: x\ndata: 4\n\ndata: 5\n\n") == [b"event: x\ndata: 4\n\n", b"data: 5\n\n"]


def test_a_large_event_in_many_chunks_is_joined_once_and_a_boundless_one_fails() -> None:
    """A 100 MiB event in 64 KiB chunks was re-joined and re-scanned for every chunk: 99 s of the event loop. Now
    its pieces are joined once, at its end, and an event past the bound fails the stream as cut instead of growing
    without end."""
    s = SseSplitter()
    chunk = b"x" * 65536
    for _ in range(100):
        assert s.feed(chunk) == []
    assert s.feed(b"\n") == [] and s.feed(b"\ndata: 2\n\n") == [b"x" * 6553600 + b"\n\n", b"data: 2\n\n"]
    with pytest.raises(UpstreamConnectionError, match="more than"):
        for _ in range(MAX_EVENT_BYTES // len(chunk) + 2):
            s.feed(chunk)


def test_a_token_events_running_usage_is_taken_out_and_every_other_field_kept() -> None:
    usage = b'{"prompt_tokens":5,"total_tokens":6,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}'
    head = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]'
    assert split_usage(head + b',"usage":' + usage + b"}\n\n") == (head + b"}\n\n", usage)
    first = head + b',"usage":' + usage + b',"prompt_token_ids":[1,2,3],"prompt_text":"hi"}\n\n'  # vLLM's first event
    assert split_usage(first) == (head + b',"prompt_token_ids":[1,2,3],"prompt_text":"hi"}\n\n', usage)
    assert split_usage(head + b',"usage":null}\n\n') == (head + b"}\n\n", b"null")
    final = b'data: {"id":"c","choices":[],"usage":' + usage + b"}\n\n"  # the answer's usage: not a running count
    assert split_usage(final) is None
    assert split_usage(head + b"}\n\n") is None


def test_a_responses_stream_ends_with_its_own_typed_error_event_numbered_after_the_last() -> None:
    last = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":7}\n\n'
    assert sequence_number(last) == 7 and sequence_number(b"data: {}\n\n") is None
    failure = UpstreamUnavailable("replica r failed mid-stream", code="upstream_reset")
    event = error_event(failure, "openai", responses_after=7)
    assert event.startswith(b"event: error\ndata: ")
    assert json.loads(event.split(b"data: ", 1)[1]) == {
        "type": "error", "code": "upstream_reset", "message": "replica r failed mid-stream", "param": None,
        "sequence_number": 8,
    }  # fmt: skip
    assert json.loads(error_event(failure).removeprefix(b"data: "))["error"]["code"] == "upstream_reset"  # chat's
