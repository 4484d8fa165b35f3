"""The app's admission step (`cleanup_ctx`): builds the quota store, the metrics and the controller, and owns them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from aiohttp import web

from gateway.admission.config import AdmissionConfig
from gateway.admission.controller import AdmissionController
from gateway.admission.local import LocalQuotaStore
from gateway.admission.metrics import AdmissionMetrics
from gateway.admission.quota import QuotaStore
from gateway.admission.redis_store import RedisQuotaStore
from gateway.config import load_config
from gateway.keys import ADMISSION, CONFIG, CONFIG_PATH, REGISTRY, REPLICAS, ROUTER


def _file_source(path: str) -> Callable[[], AdmissionConfig]:
    def load() -> AdmissionConfig:
        return load_config(path).admission

    return load


async def admission_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG].admission
    metrics = AdmissionMetrics(app[REGISTRY])
    redis_store: RedisQuotaStore | None = None
    store: QuotaStore
    if cfg.redis is not None:
        store = redis_store = RedisQuotaStore(cfg.redis, metrics, max_tenants=cfg.max_tenants)
    else:
        store = LocalQuotaStore(max_tenants=cfg.max_tenants)
    path = app.get(CONFIG_PATH)
    controller = AdmissionController(
        cfg, app[REPLICAS], app[ROUTER], store, metrics, reload_source=_file_source(path) if path else None
    )
    if redis_store is not None:
        redis_store.start()
    controller.start()
    app[ADMISSION] = controller
    try:
        yield
    finally:
        await controller.close()
