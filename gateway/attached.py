"""The replicas of `engines[]` entries: an attached engine (`url`) and the DNS discovery of one given by `dns`."""

from __future__ import annotations

from engine_pool.discovery import DnsTarget
from engine_pool.replica import Replica, ReplicaSettings, build_replica
from gateway.engine_urls import replica_id
from gateway.engines_config import EngineConfig


def engine_settings(engine: EngineConfig) -> ReplicaSettings:
    return ReplicaSettings(
        engine.model, engine.tokenizer, engine.max_concurrency, engine.max_num_seqs, engine.role
    )  # fmt: skip


def attached_replica(engine: EngineConfig) -> Replica:
    assert engine.url is not None
    return build_replica(
        replica_id(engine.url, engine.name), engine.url, engine_settings(engine), managed=False,
        metrics_url=engine.metrics_url, kv_events_endpoint=engine.kv_events_endpoint,
        kv_events_replay_endpoint=engine.kv_events_replay_endpoint,
    )  # fmt: skip


def dns_target(engine: EngineConfig) -> DnsTarget:
    """The discovery of an `engines[]` entry with `dns`: its fields, and the entry's replica settings."""
    d = engine.dns
    assert d is not None
    return DnsTarget(
        id=engine.name or d.name, name=d.name, port=d.port, srv=d.srv, scheme=d.scheme,
        settings=engine_settings(engine), kv_events_port=d.kv_events_port,
        kv_events_replay_port=d.kv_events_replay_port,
        interval_s=d.interval_s, timeout_s=d.timeout_s, nameserver=d.nameserver, drain_timeout_s=d.drain_timeout_s,
        warmup_timeout_s=d.warmup_timeout_s, max_endpoints=d.max_endpoints,
    )  # fmt: skip
