"""Per-request cache-aware work in-process: request_info (sim tokenizer) + overlap + footprint + decide + on_routed +
on_finished, for a ~1,300-token chat prompt on 4 replicas without KV events; 400 requests x 5 rounds, median.

    python bench/bench_route_cost.py LABEL    # run it in two checkouts side by side to compare commits
"""

import asyncio
import statistics
import sys
import time

from prometheus_client import CollectorRegistry

from cacheindex.config import CacheConfig
from cacheindex.state import CacheAwareState
from policies.base import ReplicaState, RoutingView
from policies.cache_aware import CacheAware


async def main():
    st = CacheAwareState(CacheConfig(tokenizers={"m": "sim"}, kv_events=False), CollectorRegistry())
    ids = [f"r{i}" for i in range(4)]
    for rid in ids:
        st.add_replica(rid, model="m", block_size=16, num_blocks=4096, kv_events_endpoint=None, tokenizer="sim")
    await asyncio.sleep(0.2)
    pol = CacheAware()
    system = "word " * 1200
    bodies = [
        {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q {i} " * 40}]}
        for i in range(400)
    ]
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for b in bodies:
            info = await st.request_info(model="m", endpoint="chat", body=b, tenant="t", session_key=None)
            overlap = st.overlap(info, ids)
            fp = st.footprint(info, ids) if hasattr(st, "footprint") else {}
            snaps = tuple(ReplicaState(id=r, model="m") for r in ids)
            view = RoutingView(info, snaps, overlap, None, 0, fp) if fp else RoutingView(info, snaps, overlap, None, 0)
            d = pol.decide(view)
            st.on_routed(info, d)
            st.on_finished(info, d.replica, overlap.get(d.replica, 0) * 16)
        times.append((time.perf_counter() - t0) / len(bodies) * 1e6)
    print(sys.argv[1], "us/request median of 5 rounds:", round(statistics.median(times), 1), [round(t) for t in times])
    await st.stop()


asyncio.run(main())
