"""Routing CPU per request against the number of replicas (issue 16: an index that does not grow with the pool).

    python -m bench.bench_index_scale                  # 4, 16, 64, 256 replicas; ~1 min
    python -m bench.bench_index_scale --replicas 4 1024

In process, the cache-aware path of one request as the gateway runs it, without HTTP: `request_info` (sim
tokenizer, ~1,300-token chat prompt: hashing), the router's snapshot of every replica, `overlap`, `offloaded`,
`footprint`, `decide`, `on_routed`, `on_finished`. The index is filled first as a long-running pool would be: 64
prefix groups (a 1,200-word system prompt each) routed across the replicas, each replica near its capacity; the
measured requests are questions on those groups (so every lookup walks a real leading run on its holder). Median
of 5 rounds of 400 requests; the ratio to the first replica count is what the issue's target is about.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from prometheus_client import CollectorRegistry

from engine_pool.replica import Replica
from policies.base import RoutingView
from policies.cache_aware import CacheAware
from policies.prefix.config import CacheConfig
from policies.prefix.state import CacheAwareState

GROUPS = 64


def body(group: int, question: int) -> dict[str, object]:
    system = f"group {group} " + "word " * 1200
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q {question} " * 40}],
    }


async def per_request_us(n: int, rounds: int, requests: int) -> float:
    st = CacheAwareState(CacheConfig(tokenizers={"m": "sim"}, kv_events=False), CollectorRegistry())
    ids = [f"r{i}" for i in range(n)]
    replicas = [Replica(rid, f"http://10.0.0.{i % 250}:{8000 + i}", "m") for i, rid in enumerate(ids)]
    for r in replicas:
        r.healthy = True
    for rid in ids:
        st.add_replica(rid, model="m", block_size=16, num_blocks=4096, kv_events_endpoint=None, tokenizer="sim")
    await st.tokenizer("sim")
    pol = CacheAware()
    seq = 0

    async def route(b: dict[str, object]) -> None:
        nonlocal seq
        info = await st.request_info(model="m", endpoint="chat", body=b, tenant="t", session_key=None)
        now = time.monotonic()
        snaps = tuple([r.snapshot(now) for r in replicas])
        overlap = st.overlap(info, ids)
        offloaded = st.offloaded(info, overlap)
        footprint = st.footprint(info, ids)
        seq += 1
        d = pol.decide(RoutingView(info, snaps, overlap, None, seq, footprint, offloaded))
        st.on_routed(info, d)
        st.on_finished(info, d.replica, overlap.get(d.replica, 0) * 16)

    for g in range(GROUPS):  # the pool's working set
        for q in range(3):
            await route(body(g, q))
    bodies = [body(i % GROUPS, 100 + i) for i in range(requests)]
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for b in bodies:
            await route(b)
        times.append((time.perf_counter() - t0) / len(bodies) * 1e6)
    await st.stop()
    return statistics.median(times)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="*", default=[4, 16, 64, 256])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=400)
    args = p.parse_args()
    base = None
    print("replicas  routing CPU us/request  ratio to first")
    for n in args.replicas:
        us = await per_request_us(n, args.rounds, args.requests)
        base = base or us
        print(f"{n:8d}  {us:22.1f}  {us / base:14.2f}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
