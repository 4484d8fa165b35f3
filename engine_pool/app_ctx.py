"""The gateway's `cleanup_ctx` step for the engine pool: launch the configured engines, stop them on shutdown.

Runs after the replica set exists (the pool adds its replicas to it, `managed=True`, and marks them warm after
warm-up) and before the router. On shutdown the HTTP server has already let in-flight requests finish (up to
`server.shutdown_grace_s`), then this step stops every engine process group.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from engine_pool.degradation import ErrorSource
from engine_pool.pool import EnginePool
from gateway.fastmetrics import FastCounter
from gateway.keys import CLIENT, CONFIG, METRICS, POOL, REGISTRY, REPLICAS
from gateway.metrics import GatewayMetrics


def replica_answers(metrics: GatewayMetrics) -> ErrorSource:
    """(attempts, failed attempts) on a replica: answers it gave with status < 500 plus failed upstream attempts
    (`kvgate_upstream_errors`; a retried failure counts against the replica that failed, not the one that answered)."""

    def count(counter: FastCounter, replica_id: str, ok_only: bool) -> float:
        total = 0.0
        for family in counter.collect():
            for sample in family.samples:
                if not sample.name.endswith("_total") or sample.labels.get("replica") != replica_id:
                    continue
                if not ok_only or not sample.labels.get("status", "").startswith("5"):
                    total += sample.value
        return total

    def source(replica_id: str) -> tuple[float, float]:
        failed = count(metrics.upstream_errors, replica_id, False)
        return count(metrics.requests, replica_id, True) + failed, failed

    return source


async def pool_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG].pool
    if cfg is None or not cfg.models:
        yield
        return
    pool = EnginePool(cfg, app[REPLICAS], app[CLIENT], app[REGISTRY], error_source=replica_answers(app[METRICS]))
    app[POOL] = pool
    try:
        await pool.start()
        yield
    finally:
        await pool.stop()
