"""Routing benchmark (issue 4): kvgate's cache-aware vs round-robin vs least-load on simulated engines.

    python -m bench.bench_routing            # full run, ~10 min on 2 shared cores; rewrites docs/routing.md
    python -m bench.bench_routing --quick    # smoke, ~2-3 min, prints only

Setup per workload: `--replicas` simulated engines (separate processes, `kvgate sim-engine`, costs in
`routing_procs.SimCosts`: prefill 200 us/token, decode 10 ms + 0.5 ms per running sequence, max_num_seqs 16, KV
capacity sized per workload) and, per arrival process, one kvgate process per policy in front of them (fresh, so
the cache-aware gateway's index starts empty). Each (workload, arrival, policy) run resets the engines' prefix
caches, then drives the same seeded workload through that gateway from this process (`loadgen.runner`,
streaming chat, TTFT measured by the client) and scrapes the engines' `vllm:prefix_cache_{hits,queries}_total`
before and after. Policies run one after the other, never at the same time.

Reported per run: engine hit rate, the workload's best possible hit rate (`routing_workloads.best_hit_rate`),
TTFT p50/p99, output tok/s and req/s, per-replica request share (from `x-kvgate-replica`). Target checks are in
`routing_report`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.routing_procs import SimCosts, gateways, sim_pool
from bench.routing_report import render_markdown, target_checks, update_docs
from bench.routing_workloads import Workload, best_hit_rate, rebuild_prompts, workloads
from loadgen.client import Target
from loadgen.promscrape import prefix_cache_report, scrape_all
from loadgen.runner import Arrival, run_setting
from loadgen.stats import summarize

POLICIES = ("round-robin", "least-load", "cache-aware")
MODEL = "sim"


@dataclass
class Row:
    workload: str
    arrival: str
    policy: str
    requests: int
    failed: int
    hit_rate: float
    best_hit_rate: float
    best_unbounded: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    out_tok_s: float
    req_s: float
    share: list[float] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)


async def _reset(http: aiohttp.ClientSession, sims: Sequence[str]) -> None:
    for s in sims:
        async with http.post(f"{s}/reset_prefix_cache") as resp:
            if resp.status != 200:
                raise RuntimeError(f"{s}: reset_prefix_cache answered {resp.status}")


async def _reasons(http: aiohttp.ClientSession, gw: str) -> dict[str, int]:
    """kvgate_routing_decisions by reason, from the gateway's /metrics (best effort)."""
    async with http.get(f"{gw}/metrics") as resp:
        text = await resp.text()
    out: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("kvgate_routing_decisions_total{") and 'reason="' in line:
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0) + int(float(line.rsplit(" ", 1)[1]))
    return out


async def measure(
    gw: str, sims: Sequence[str], w: Workload, arrival: Arrival, seed: int
) -> tuple[Any, Any, dict[str, int]]:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as http:
        await _reset(http, sims)
        before = await scrape_all(http, [f"{s}/metrics" for s in sims])
        res = await run_setting(http, Target(gw, MODEL, timeout_s=300.0), w.factory, arrival, seed=seed)
        after = await scrape_all(http, [f"{s}/metrics" for s in sims])
        reasons = await _reasons(http, gw)
    return res, prefix_cache_report(before, after), reasons


def _run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def run_workload(
    w: Workload,
    args: argparse.Namespace,
    costs: SimCosts,
    ca_params: dict[str, Any],
) -> list[Row]:
    rows: list[Row] = []
    pool_blocks = w.num_blocks * args.replicas
    arrivals = {
        "closed": Arrival("closed", concurrency=w.concurrency),
        "poisson": Arrival("poisson", rate=w.rate * args.rate_scale),
    }
    with sim_pool(args.replicas, costs, w.num_blocks, MODEL) as sims:
        ports = [s.rsplit(":", 1)[1] for s in sims]
        for arrival_name in args.arrivals:
            arrival = arrivals[arrival_name]
            specs = [args.variants.get(p, (p, ca_params if p == "cache-aware" else {})) for p in args.policies]
            with gateways(sims, specs, None if args.hide_slots else costs.max_num_seqs) as gws:
                for policy, gw in zip(args.policies, gws, strict=True):
                    t0 = time.monotonic()
                    res, cache, reasons = _run(measure(gw, sims, w, arrival, args.seed))
                    s = summarize(res.results, res.wall_s)
                    prompts = rebuild_prompts(w.factory, args.seed, res.results)
                    counts = [sum(1 for r in res.results if (r.replica or "").endswith(f":{p}")) for p in ports]
                    n = max(1, sum(counts))
                    row = Row(
                        workload=w.name, arrival=arrival_name, policy=policy, requests=s.requests, failed=s.failed,
                        hit_rate=cache["hit_rate"] or 0.0,
                        best_hit_rate=best_hit_rate(prompts, costs.block_size, pool_blocks, MODEL),
                        best_unbounded=best_hit_rate(prompts, costs.block_size, None, MODEL),
                        ttft_p50_ms=1e3 * (s.ttft_s["p50"] or 0.0), ttft_p99_ms=1e3 * (s.ttft_s["p99"] or 0.0),
                        out_tok_s=s.output_tok_per_s, req_s=s.req_per_s, share=[c / n for c in counts],
                        reasons=reasons,
                    )  # fmt: skip
                    rows.append(row)
                    errors = s.errors and f" {s.errors}"
                    print(
                        f"  {w.name:<17} {arrival_name:<8} {policy:<12} hit {row.hit_rate:6.1%} "
                        f"(best {row.best_hit_rate:6.1%}) ttft p50 {row.ttft_p50_ms:7.1f} "
                        f"p99 {row.ttft_p99_ms:7.1f} ms "
                        f"{row.out_tok_s:7.1f} tok/s {row.req_s:6.1f} req/s fail {row.failed}{errors or ''} "
                        f"[{time.monotonic() - t0:.1f} s]",
                        flush=True,
                    )
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.bench_routing", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke: scale 0.3, no docs update unless --docs")
    p.add_argument("--scale", type=float, default=None, help="request-count multiplier (default 1, quick 0.3)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiplier on every Poisson rate")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--workloads", default="", help="comma list (default: all)")
    p.add_argument("--arrivals", default="closed,poisson")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--ca-params", default="{}", help="JSON routing.params for cache-aware (tuning experiments)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="an extra cache-aware run labelled NAME with these params (before/after tuning)",
    )
    p.add_argument(
        "--hide-slots", action="store_true", help="attach the engines without telling kvgate their max_num_seqs"
    )
    p.add_argument("--json", dest="json_out", default=None, help="also write the rows as JSON here")
    p.add_argument("--docs", default=None, help="markdown file to update (default docs/routing.md on a full run)")
    p.add_argument("--no-docs", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    scale = args.scale if args.scale is not None else (0.3 if args.quick else 1.0)
    args.arrivals = [a for a in args.arrivals.split(",") if a]
    args.policies = [p for p in args.policies.split(",") if p]
    ca_params: dict[str, Any] = json.loads(args.ca_params)
    args.variants = {}
    for v in args.variant:
        name, _, params = v.partition("=")
        args.variants[name] = ("cache-aware", json.loads(params or "{}"))
        args.policies.append(name)
    chosen = set(filter(None, args.workloads.split(",")))
    ws = [w for w in workloads(scale) if not chosen or w.name in chosen]
    costs = SimCosts()
    started = time.monotonic()
    rows: list[Row] = []
    for w in ws:
        print(f"{w.name}: {w.about}; {w.num_blocks} blocks/replica", flush=True)
        rows += run_workload(w, args, costs, ca_params)
    elapsed = time.monotonic() - started
    argv_used = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m bench.bench_routing", *argv_used])
    load = os.getloadavg()
    machine = (
        f"{platform.machine()}, {_cpus()} CPUs shared with other jobs (load average at the end "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}), Python {platform.python_version()}, {platform.system()}"
    )
    md = render_markdown(rows, ws, costs, args.replicas, command, machine, elapsed, ca_params)
    print()
    print(md)
    print("\n".join(target_checks(rows)))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    docs = args.docs or (None if args.quick else "docs/routing.md")
    if docs and not args.no_docs:
        update_docs(Path(docs), md + "\n\n" + "\n".join(target_checks(rows)))
        print(f"updated {docs}")
    return 0


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    sys.exit(main())
