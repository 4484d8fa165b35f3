"""The cache index: what the gateway knows of the engines' KV caches, and the I/O that keeps it current.

Prompt tokenizers (and their thread pool), chained block hashes, the per-replica KV block index, the KV-event
subscriber (ZMQ), session affinity, chat rendering, the index's metrics and the hooks through which several gateways
share it (`shared`); `state.CacheAwareState` is the one object the gateway holds. A layer of its own between
`gateway` (which wires it to the replica set and the fleet) and `policies` (whose pure decisions read what it
computes: `RequestInfo`, overlaps, footprints); it imports neither `gateway` nor `engine_pool`.
"""
