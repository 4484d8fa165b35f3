"""KV-event publishers discovered from the engine: vLLM's `GET /kv_event_sources` (0.32:
`entrypoints/serve/instrumentator/basic.py`) answers each data-parallel rank's KVEventsConfig,
`{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": ...,
"topic": ...}}`, so `engines: [{url: ...}]` alone gives precise routing from an engine that publishes.

The endpoints are the engine's bind addresses: a wildcard host (`*`, `0.0.0.0`, `::`) is the engine's own host as
kvgate reaches it; a loopback host or an `ipc://` path is usable only when the engine is on this machine (its URL's
host is loopback), and dropped otherwise. An engine with several ranks has several caches behind one URL, one
replica per rank here, each taking its own rank's publisher; a replica that is not a rank takes the source only of
an engine with one (several ranks' events merged into one index would mislead routing). Pure: O(ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import ip_address
from typing import Any

_WILDCARD = {"*", "0.0.0.0", "::", "[::]"}


@dataclass(frozen=True, slots=True)
class KvEventSource:
    endpoint: str
    replay_endpoint: str | None
    topic: str


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def reachable(endpoint: object, engine_host: str) -> str | None:
    """The endpoint as kvgate connects to it, or None when it cannot (see the module docstring)."""
    if not isinstance(endpoint, str) or not endpoint:
        return None
    local = _loopback(engine_host)
    if endpoint.startswith("ipc://"):
        return endpoint if local else None
    if not endpoint.startswith("tcp://"):
        return None
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not port.isdigit():
        return None
    if host in _WILDCARD:
        bracketed = f"[{engine_host}]" if ":" in engine_host else engine_host
        return f"tcp://{bracketed}:{port}"
    return endpoint if local or not _loopback(host) else None


def kv_event_source(answer: Any, engine_host: str, rank: int | None = None) -> KvEventSource | None:
    """The publisher of data-parallel rank `rank` in a `/kv_event_sources` answer, or with no rank of a
    single-rank engine's; None when there is none (no events, several ranks and no rank asked, an endpoint kvgate
    cannot reach, an answer of another shape)."""
    if not isinstance(answer, dict) or (rank is None and len(answer) != 1):
        return None
    config = next(iter(answer.values())) if rank is None else answer.get(str(rank))
    if not isinstance(config, dict) or not config.get("enable_kv_cache_events") or config.get("publisher") != "zmq":
        return None
    endpoint = reachable(config.get("endpoint"), engine_host)
    if endpoint is None:
        return None
    topic = config.get("topic")
    return KvEventSource(
        endpoint, reachable(config.get("replay_endpoint"), engine_host), topic if isinstance(topic, str) else ""
    )
