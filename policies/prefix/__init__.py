"""Cache-aware routing support: prompt tokenizers, chained block hashes, the per-replica KV block index, the KV
events subscriber, session affinity and `CacheAwareState`, the one object the gateway holds."""
