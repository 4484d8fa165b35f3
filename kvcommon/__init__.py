"""Small helpers the product's layers and the tools share, importing nothing of the project (import-linter):
the Prometheus text reader (`promtext`), the hot-path metric types (`fastmetrics`) and exponential back-off
(`backoff`). Outside the layers: `gateway`, `cacheindex`, `engine_pool` and `loadgen` may all use it."""
