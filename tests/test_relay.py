"""A stream's events out of an engine's chunks, on literal bytes."""

from __future__ import annotations

from gateway.relay import SseSplitter


def test_an_engine_chunk_of_one_event_is_that_event() -> None:
    assert SseSplitter().feed(b'data: {"a":1}\n\n') == [b'data: {"a":1}\n\n']


def test_events_split_and_joined_across_chunks_come_out_whole() -> None:
    s = SseSplitter()
    assert s.feed(b"\n") == []  # a lone line end is no event
    assert s.feed(b"data: 1\n\ndata: ") == [b"\ndata: 1\n\n"]
    assert s.feed(b"2\n") == []
    assert s.feed(b"\ndata: 3\n\n") == [b"data: 2\n\n", b"data: 3\n\n"]
    assert s.feed(b"event: x\ndata: 4\n\ndata: 5\n\n") == [b"event: x\ndata: 4\n\n", b"data: 5\n\n"]
