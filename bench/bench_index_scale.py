"""Routing CPU per request and the prefix index's memory against the number of replicas.

    python -m bench.bench_index_scale                  # 4, 16, 64, 256 replicas of 4,096 blocks; ~1 min
    python -m bench.bench_index_scale --replicas 4 1024 --blocks 32768   # the issue's 1,024 x 32,768; ~4 min
    python -m bench.bench_index_scale --replicas 4 1024 --max-candidates 1000000   # without candidate pruning
    python -m bench.bench_index_scale --replicas 16 --blocks 32768 --kv-events     # replicas with KV events

In process, the gateway's own routing step without HTTP, as the shipped defaults take it: `Router.request_info`
(sim tokenizer, a ~1,300-token chat prompt: tokenizing and hashing), admission's verdict on the latency targets
(`LatencyGate.judge`: the candidates, their finalists, a prediction per finalist) and the hold it places, then
`Router.choose` (snapshots, overlap, offloaded, footprint, latency views, `decide`, `on_routed`) within the verdict's
preferred replicas when it names some, else those it weighed (as `gateway.proxy` does), and `on_finished` and the
hold's release, over a real `ReplicaSet` of N replicas (all
pointed at one instant simulated engine, so they are healthy). `--no-targets`: without the verdict. The index is
filled first as a running pool's would be: 64 prefix groups (a 1,200-word system prompt each) x 3 questions routed
across the replicas; the measured requests are new questions on those groups, so every lookup walks a real leading
run on its holders. Then every replica's
index is filled as a busy pool's would be: twice its capacity in distinct blocks routed there within the hot
window (seeded), so its cache is full and so is the hot window's record of what it evicted. Memory: what the index
allocated for that (tracemalloc, numpy's arrays included, around the fill), per block of capacity (replicas x
blocks). Routing CPU: median of 5 rounds of 400 requests on the full index; the ratio to the first replica count
is the issue's target (flat).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import tracemalloc

import numpy as np
from prometheus_client import CollectorRegistry

from cacheindex.config import CacheConfig
from cacheindex.kv_index import KvIndex, StoredBlocks
from cacheindex.state import CacheAwareState
from engine_pool.http_client import UpstreamClient
from engine_pool.replica import Replica
from engine_pool.replica_set import ReplicaSet
from gateway.admission.auth import Identity
from gateway.admission.config import AdmissionConfig
from gateway.admission.metrics import AdmissionMetrics
from gateway.admission.targets import LatencyGate, place
from gateway.context import RequestContext
from gateway.metrics import GatewayMetrics
from gateway.router import Router
from policies.cache_aware import CacheAware
from policies.latency import Targets
from simengine import SimConfig, run_sim_engine

GROUPS = 64
TARGETS = Targets(ttft_s=2.0, tpot_s=0.1)  # the shipped default targets
IDENTITY = Identity("t", 1, "standard")


def body(group: int, question: int) -> dict[str, object]:
    system = f"group {group} " + "word " * 1200
    messages = [{"role": "system", "content": system}, {"role": "user", "content": f"q {question} " * 40}]
    return {"model": "m", "messages": messages}


def fill_one(index: KvIndex, rid: str, blocks: int, kv_events: bool, rng: np.random.Generator) -> None:
    """Route 2 x `blocks` distinct blocks to the replica in prompts of 512 (with `kv_events`, after a capacity's
    worth stored by events, so the engine-hash map is full too)."""
    if kv_events:
        index.add_replica(rid, capacity_blocks=blocks, precise=True)
        engine = rng.integers(1, 2**63, blocks, dtype=np.uint64).tolist()
        tokens = rng.integers(0, 32_000, blocks * 16).tolist()
        for at in range(0, blocks, 512):
            parent = engine[at - 1] if at else None
            index.apply_stored(
                rid, StoredBlocks(engine[at : at + 512], parent, tokens[at * 16 : (at + 512) * 16], 16), 1
            )
    for chunk in np.array_split(rng.integers(1, 2**63, 2 * blocks, dtype=np.uint64), max(1, blocks // 256)):
        index.record_routed(rid, tuple(chunk.tolist()))


def fill(st: CacheAwareState, n: int, blocks: int, kv_events: bool) -> float:
    """Fill every replica's index (`fill_one`); the bytes per block of capacity allocated for it, after the same
    on a throwaway index (what the first use imports is not the index's)."""
    warm = KvIndex()
    warm.add_replica("w", capacity_blocks=512)
    fill_one(warm, "w", 512, kv_events, np.random.default_rng(1))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    rng = np.random.default_rng(7)
    for i in range(n):
        fill_one(st.index, f"r{i}", blocks, kv_events, rng)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / (n * blocks)


async def per_request_us(
    url: str, n: int, blocks: int, rounds: int, requests: int, max_candidates: int, kv_events: bool, targets: bool
) -> tuple[float, float]:
    registry = CollectorRegistry()
    st = CacheAwareState(CacheConfig(tokenizers={"m": "sim"}, kv_events=False), registry)
    client = UpstreamClient()
    replicas = ReplicaSet(client, interval_s=3600, metrics_interval_s=3600)
    for i in range(n):
        replicas.add(Replica(f"r{i}", url, "m"))
        st.add_replica(f"r{i}", model="m", block_size=16, num_blocks=blocks, kv_events_endpoint=None, tokenizer="sim")
        if i % 64 == 63 or i == n - 1:  # a batch's first health probes answered before the next (no connect flood)
            for r in replicas:
                while True:
                    if r.healthy:
                        break
                    await asyncio.sleep(0.05)
    await st.tokenizer("sim")
    router = Router(CacheAware(), replicas, GatewayMetrics(registry), st, max_candidates=max_candidates)
    gate = LatencyGate(AdmissionConfig(), replicas, router, AdmissionMetrics(registry))

    async def route(b: dict[str, object]) -> None:
        info = await router.request_info(model="m", endpoint="chat", body=b, tenant="t", session_key=None)
        ctx, prefer = RequestContext("bench", "chat"), tuple[str, ...]()
        if targets:  # as gateway.admission.controller and gateway.proxy do
            verdict = gate.judge(info, info.prompt_tokens, None, TARGETS)
            if verdict.best is not None and (held := replicas.get(verdict.best.replica)) is not None:
                gate.hold(ctx, held, verdict.best, info.prompt_tokens, None)
            prefer, ctx.predictions = verdict.prefer, verdict.predictions
            prefer = prefer or tuple([p.replica for p in verdict.predictions])  # the candidates it weighed
        replica, _ = await router.choose(info, hold=ctx.hold, only=prefer)
        place(ctx, replica, replicas)
        st.on_finished(info, replica.id, None)
        gate.finish(ctx, IDENTITY, None)

    per_block = fill(st, n, blocks, kv_events)
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
    await replicas.close()
    client.close()
    await st.stop()
    return statistics.median(times), per_block


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="*", default=[4, 16, 64, 256])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--blocks", type=int, default=4096, help="KV capacity of each replica, in blocks")
    p.add_argument("--max-candidates", type=int, default=16, help="routing.max_candidates (a huge value: off)")
    p.add_argument("--kv-events", action="store_true", help="replicas with KV events (the engine-hash map too)")
    p.add_argument("--no-targets", action="store_true", help="without admission's verdict (targets off)")
    args = p.parse_args()
    base = None
    targets = "off" if args.no_targets else "on (the default)"
    print(f"max_candidates {args.max_candidates}, {args.blocks} blocks per replica, latency targets {targets}")
    print("replicas  index bytes/block  routing CPU us/request  ratio to first")
    async with run_sim_engine(SimConfig(model="m", instant=True)) as sim:
        for n in args.replicas:
            us, per_block = await per_request_us(
                sim.url, n, args.blocks, args.rounds, args.requests, args.max_candidates, args.kv_events,
                not args.no_targets,
            )  # fmt: skip
            base = base or us
            print(f"{n:8d}  {per_block:17.1f}  {us:22.1f}  {us / base:14.2f}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
