"""The replicas of `engines[]` entries: an attached engine (`url`) and the DNS discovery of one given by `dns`."""

from __future__ import annotations

from engine_pool.discovery import DnsTarget
from engine_pool.replica import Replica
from gateway.config import EngineConfig
from gateway.engine_urls import replica_id


def attached_replica(engine: EngineConfig) -> Replica:
    assert engine.url is not None
    return Replica(
        replica_id(engine.url, engine.name),
        engine.url,
        engine.model,
        metrics_url=engine.metrics_url,
        kv_events_endpoint=engine.kv_events_endpoint,
        kv_events_replay_endpoint=engine.kv_events_replay_endpoint,
        tokenizer=engine.tokenizer,
        max_concurrency=engine.max_concurrency,
        max_num_seqs=engine.max_num_seqs,
        managed=False,
        role=engine.role,
    )


def dns_target(engine: EngineConfig) -> DnsTarget:
    """The discovery of an `engines[]` entry with `dns`: its fields, and the entry's replica settings."""
    d = engine.dns
    assert d is not None
    return DnsTarget(
        id=engine.name or d.name, name=d.name, port=d.port, srv=d.srv, scheme=d.scheme, model=engine.model,
        tokenizer=engine.tokenizer, kv_events_port=d.kv_events_port, kv_events_replay_port=d.kv_events_replay_port,
        max_concurrency=engine.max_concurrency, max_num_seqs=engine.max_num_seqs, role=engine.role,
        interval_s=d.interval_s, timeout_s=d.timeout_s, nameserver=d.nameserver, drain_timeout_s=d.drain_timeout_s,
        warmup_timeout_s=d.warmup_timeout_s, max_endpoints=d.max_endpoints,
    )  # fmt: skip
