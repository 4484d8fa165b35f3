"""KV-event publishers read from an engine's `/kv_event_sources` answer (vLLM 0.32's shape), on literal answers."""

from __future__ import annotations

from typing import Any

import pytest

from engine_pool.kv_sources import KvEventSource, kv_event_source

ZMQ = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events", "buffer_steps": 10000}


def rank(**fields: Any) -> dict[str, Any]:
    return {"0": {**ZMQ, **fields}}


def test_a_wildcard_bind_is_the_engines_own_host() -> None:
    answer = rank(endpoint="tcp://*:5557", replay_endpoint="tcp://0.0.0.0:5558")
    assert kv_event_source(answer, "10.0.0.5") == KvEventSource(
        "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "kv-events"
    )
    assert kv_event_source(answer, "fd00::5") == KvEventSource(
        "tcp://[fd00::5]:5557", "tcp://[fd00::5]:5558", "kv-events"
    )


@pytest.mark.parametrize(
    ("endpoint", "host", "expected"),
    [
        ("tcp://127.0.0.1:5557", "127.0.0.1", "tcp://127.0.0.1:5557"),  # the engine on this machine
        ("tcp://127.0.0.1:5557", "10.0.0.5", None),  # its loopback is not ours
        ("ipc:///tmp/kv.sock", "localhost", "ipc:///tmp/kv.sock"),
        ("ipc:///tmp/kv.sock", "10.0.0.5", None),
        ("tcp://10.0.0.7:5557", "engine.example", "tcp://10.0.0.7:5557"),  # bound on a named interface
        ("tcp://*", "10.0.0.5", None),  # no port
        ("inproc://x", "127.0.0.1", None),
    ],
)
def test_endpoints_kvgate_can_reach_and_those_it_cannot(endpoint: str, host: str, expected: str | None) -> None:
    source = kv_event_source(rank(endpoint=endpoint, replay_endpoint=None), host)
    assert (source.endpoint if source else None) == expected
    if source:
        assert source.replay_endpoint is None


@pytest.mark.parametrize(
    "answer",
    [
        {},  # an engine started without KV events
        rank(endpoint="tcp://*:5557", enable_kv_cache_events=False),
        rank(endpoint="tcp://*:5557", publisher="null"),
        {"0": {**ZMQ, "endpoint": "tcp://*:5557"}, "1": {**ZMQ, "endpoint": "tcp://*:5558"}},  # two ranks, two caches
        [],
        {"0": "tcp://*:5557"},
    ],
)
def test_no_source_from_answers_without_one_usable_publisher(answer: Any) -> None:
    assert kv_event_source(answer, "127.0.0.1") is None


def test_the_publishers_topic_is_kept_even_empty() -> None:
    source = kv_event_source(rank(endpoint="tcp://*:5557", topic=""), "127.0.0.1")
    assert source is not None and source.topic == ""


def test_each_data_parallel_rank_takes_its_own_publisher() -> None:
    """vLLM offsets each rank's ports by its rank (rank 1 of tcp://*:5557 binds 5558) and lists them all."""
    answer = {
        "1": {**ZMQ, "endpoint": "tcp://*:5558", "replay_endpoint": "tcp://*:5568"},
        "0": {**ZMQ, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5567"},
    }
    assert kv_event_source(answer, "10.0.0.5", 0) == KvEventSource(
        "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5567", "kv-events"
    )
    assert kv_event_source(answer, "10.0.0.5", 1) == KvEventSource(
        "tcp://10.0.0.5:5558", "tcp://10.0.0.5:5568", "kv-events"
    )
    assert kv_event_source(answer, "10.0.0.5", 2) is None  # a rank the engine does not list
    assert kv_event_source(answer, "10.0.0.5") is None  # not a rank: two caches are not one
