"""Routing benchmark (issue 4): kvgate's cache-aware vs round-robin vs least-load on simulated engines.

    python -m bench.bench_routing            # full run, ~13 min on 2 shared cores; rewrites docs/routing.md
    python -m bench.bench_routing --quick    # smoke, ~2-3 min, prints only

Setup per workload: `--replicas` simulated engines (separate processes, `kvgate sim-engine`, costs in
`routing_procs.SimCosts`: prefill 200 us/token, decode 10 ms + 0.5 ms per running sequence, max_num_seqs 16, KV
capacity sized per workload) and, per arrival process, one kvgate process per policy in front of them (fresh, so
the cache-aware gateway's index starts empty). Each (workload, arrival, policy) run resets the engines' prefix
caches, then drives the same seeded workload through that gateway from this process (`loadgen.runner`,
streaming chat, TTFT measured by the client) and scrapes the engines' `vllm:prefix_cache_{hits,queries}_total`
before and after. Policies run one after the other, never at the same time. With `--repeat N` every
(workload, arrival) runs N times with fresh gateways and the rows show medians (throughput and TTFT p99 with their
min-max range: on a shared 2-core machine one run's difference of a few percent is noise).
CPUs: by default every process shares all CPUs; `--pin` gives the gateway under test the last CPU to itself and the
engines and the client the others (on 2 CPUs that leaves one core for four engines and the client, which then
saturates: every policy slows, so the default is not to pin).

Reported per run: engine hit rate, the workload's best possible hit rate (`routing_workloads.best_hit_rate`),
TTFT p50/p99, output tok/s and req/s, the gateway's CPU milliseconds per request, per-replica request share (from
`x-kvgate-replica`). Target checks are in `routing_report`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.routing_procs import SGLANG, SimCosts, cpu_seconds, gateways, sim_pool, split_cpus
from bench.routing_report import SECONDS, render_markdown, target_checks, update_docs
from bench.routing_workloads import Workload, best_hit_rate, rebuild_prompts, trace_workload, workloads
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
    gw_cpu_ms: float = 0.0  # the gateway process's CPU per request (tokenizing, hashing, relaying)
    repeats: int = 1
    out_tok_s_range: tuple[float, float] = (0.0, 0.0)  # min, max over the repeats
    ttft_p99_range: tuple[float, float] = (0.0, 0.0)


async def _reset(http: aiohttp.ClientSession, sims: Sequence[str]) -> None:
    for s in sims:
        async with http.post(f"{s}/reset_prefix_cache") as resp:
            if resp.status != 200:
                raise RuntimeError(f"{s}: reset_prefix_cache answered {resp.status}")


async def _warm(sims: Sequence[str], per_engine: int = 8) -> None:
    """A few streamed chat requests of distinct 256-word prompts straight to each engine before any measured run,
    as a pool in service has served some: a gateway's first scrape of an engine then gives it the engine's prefill
    cost (`policies.queue_price`), where on engines that served nothing the first run's gateway routes its first
    seconds by token constants and whichever policy ran first paid for it (at 5x documents-users' rate on 8
    replicas: 85.3-90.1% hits first, 90.5-91.7% later). The runs reset the engines' caches, so nothing cached
    here carries over."""
    async with aiohttp.ClientSession() as http:

        async def one(url: str, i: int) -> None:
            prompt = f"warm {i} up " * 128
            body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "stream": True}
            async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                await resp.read()

        await asyncio.gather(*(one(s, i) for s in sims for i in range(per_engine)))


async def _reasons(http: aiohttp.ClientSession, gw: str) -> dict[str, int]:
    """kvgate_routing_decisions by reason, from the gateway's /metrics (best effort)."""
    async with http.get(f"{gw}/metrics") as resp:
        text = await resp.text()
    out: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("kvgate_routing_decisions_total{") and 'reason="' in line:
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0) + int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("kvgate_routing_seconds_decisions_total{"):  # of those, priced in predicted seconds
            out[SECONDS] = out.get(SECONDS, 0) + int(float(line.rsplit(" ", 1)[1]))
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


def _measure_row(
    w: Workload, arrival_name: str, arrival: Arrival, policy: str, gw: str, pid: int, sims: Sequence[str],
    args: argparse.Namespace, costs: SimCosts,
) -> Row:  # fmt: skip
    t0, cpu0 = time.monotonic(), cpu_seconds(pid)
    res, cache, reasons = _run(measure(gw, sims, w, arrival, args.seed))
    gw_cpu_ms = 1e3 * (cpu_seconds(pid) - cpu0) / max(1, len(res.results))
    s = summarize(res.results, res.wall_s)
    prompts = rebuild_prompts(w.factory, args.seed, res.results)
    ports = [u.rsplit(":", 1)[1] for u in sims]
    counts = [sum(1 for r in res.results if (r.replica or "").endswith(f":{p}")) for p in ports]
    n = max(1, sum(counts))
    pool_blocks = w.num_blocks * args.replicas
    row = Row(
        workload=w.name, arrival=arrival_name, policy=policy, requests=s.requests, failed=s.failed,
        hit_rate=cache["hit_rate"] or 0.0,
        best_hit_rate=best_hit_rate(prompts, costs.block_size, pool_blocks, MODEL),
        best_unbounded=best_hit_rate(prompts, costs.block_size, None, MODEL),
        ttft_p50_ms=1e3 * (s.ttft_s["p50"] or 0.0), ttft_p99_ms=1e3 * (s.ttft_s["p99"] or 0.0),
        out_tok_s=s.output_tok_per_s, req_s=s.req_per_s, share=[c / n for c in counts] if sum(counts) else [],
        reasons=reasons, gw_cpu_ms=gw_cpu_ms,
    )  # fmt: skip
    errors = s.errors and f" {s.errors}"
    print(
        f"  {w.name:<17} {arrival_name:<8} {policy:<12} hit {row.hit_rate:6.1%} "
        f"(best {row.best_hit_rate:6.1%}) ttft p50 {row.ttft_p50_ms:7.1f} p99 {row.ttft_p99_ms:7.1f} ms "
        f"{row.out_tok_s:7.1f} tok/s {row.req_s:6.1f} req/s gw {gw_cpu_ms:.2f} ms CPU/req "
        f"fail {row.failed}{errors or ''} [{time.monotonic() - t0:.1f} s]",
        flush=True,
    )
    return row


def combine(runs: Sequence[Row]) -> Row:
    """One row from repeated runs of the same (workload, arrival, policy): the median of every figure, the range
    of throughput and TTFT p99 kept to show the run-to-run noise, failures and route reasons summed."""
    med = statistics.median
    first = runs[0]
    reasons: dict[str, int] = {}
    for r in runs:
        for k, v in r.reasons.items():
            reasons[k] = reasons.get(k, 0) + v
    return Row(
        workload=first.workload, arrival=first.arrival, policy=first.policy, requests=first.requests,
        failed=sum(r.failed for r in runs), hit_rate=med(r.hit_rate for r in runs),
        best_hit_rate=med(r.best_hit_rate for r in runs), best_unbounded=med(r.best_unbounded for r in runs),
        ttft_p50_ms=med(r.ttft_p50_ms for r in runs), ttft_p99_ms=med(r.ttft_p99_ms for r in runs),
        out_tok_s=med(r.out_tok_s for r in runs), req_s=med(r.req_s for r in runs),
        share=[statistics.fmean(s) for s in zip(*(r.share for r in runs), strict=True)], reasons=reasons,
        gw_cpu_ms=med(r.gw_cpu_ms for r in runs), repeats=len(runs),
        out_tok_s_range=(min(r.out_tok_s for r in runs), max(r.out_tok_s for r in runs)),
        ttft_p99_range=(min(r.ttft_p99_ms for r in runs), max(r.ttft_p99_ms for r in runs)),
    )  # fmt: skip


def run_workload(
    w: Workload,
    args: argparse.Namespace,
    costs: SimCosts,
    ca_params: dict[str, Any],
) -> list[Row]:
    """Every (arrival, policy) of one workload, `args.repeat` times with fresh gateways each time (a gateway's
    learned index must not outlive the engine cache reset), policies interleaved within a repeat and their order
    rotated from one repeat to the next (no policy always runs first, on the freshest engines)."""
    rows: list[Row] = []
    arrivals = {
        "closed": Arrival("closed", concurrency=w.concurrency),
        "poisson": Arrival("poisson", rate=w.rate * args.rate_scale),
        "trace": Arrival("trace", max_inflight=4096),  # a trace's own timestamps
    }
    specs = [args.variants.get(p, (p, ca_params if p == "cache-aware" else {})) for p in args.policies]
    specs = [(SGLANG, {"python": args.sglang_python}) if p == SGLANG else (p, params) for p, params in specs]
    gw_cpus, other_cpus = split_cpus(args.pin)
    with sim_pool(args.replicas, costs, w.num_blocks, MODEL, other_cpus, args.hide_capacity) as sims:
        _run(_warm(sims))
        # a trace (or a flash crowd) is replayed at its own timestamps; the other workloads have none
        for arrival_name in ["trace"] if w.timed else [a for a in args.arrivals if a != "trace"]:
            runs: dict[str, list[Row]] = {p: [] for p in args.policies}
            for rep in range(args.repeat):
                with gateways(sims, specs, None if args.hide_slots else costs.max_num_seqs, gw_cpus) as gws:
                    order = list(zip(args.policies, gws, strict=True))
                    k = rep % len(order)
                    for policy, (gw, pid) in order[k:] + order[:k]:
                        row = _measure_row(w, arrival_name, arrivals[arrival_name], policy, gw, pid, sims, args, costs)
                        runs[policy].append(row)
            rows += [combine(runs[p]) for p in args.policies]
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.bench_routing", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke: scale 0.3, no docs update unless --docs")
    p.add_argument("--scale", type=float, default=None, help="request-count multiplier (default 1, quick 0.3)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiplier on every Poisson rate")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--repeat", type=int, default=1, help="runs per (workload, arrival, policy); rows show medians")
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
        help="an extra cache-aware run labelled NAME with these params (before/after tuning); a key 'routing' in "
        'them sets other routing keys instead (e.g. \'{"routing": {"max_weighed": 16}}\')',
    )
    p.add_argument(
        "--hide-slots", action="store_true", help="attach the engines without telling kvgate their max_num_seqs"
    )
    p.add_argument(
        "--hide-capacity",
        action="store_true",
        help="engines publish no vllm:cache_config_info: kvgate knows neither their block size nor KV capacity",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="give the gateway under test the last CPU to itself, the engines and the client the others",
    )
    p.add_argument("--trace", default=None, help="a Mooncake-format JSONL trace: workload 'trace', at its timestamps")
    p.add_argument(
        "--sglang-python",
        default=None,
        help="the Python of a virtualenv with sglang-router (`pip install sglang-router==0.3.2`): its cache_aware "
        "policy runs beside kvgate's as policy 'sglang-router'",
    )
    p.add_argument("--trace-requests", type=int, default=None, help="replay only the trace's first N requests")
    p.add_argument("--trace-cache-ratio", type=float, default=2.3, help="the trace's working set / the pool's KV")
    p.add_argument("--json", dest="json_out", default=None, help="also write the rows as JSON here")
    p.add_argument("--docs", default=None, help="markdown file to update (default docs/routing.md on a full run)")
    p.add_argument("--no-docs", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    gw_cpus, other_cpus = split_cpus(args.pin)
    if other_cpus:
        os.sched_setaffinity(0, other_cpus)  # the client shares the engines' CPUs, never the gateway's
    scale = args.scale if args.scale is not None else (0.3 if args.quick else 1.0)
    args.arrivals = [a for a in args.arrivals.split(",") if a]
    args.policies = [p for p in args.policies.split(",") if p]
    if args.sglang_python:
        args.policies.append(SGLANG)
    ca_params: dict[str, Any] = json.loads(args.ca_params)
    args.variants = {}
    for v in args.variant:
        name, _, params = v.partition("=")
        args.variants[name] = ("cache-aware", json.loads(params or "{}"))
        args.policies.append(name)
    chosen = set(filter(None, args.workloads.split(",")))
    every = workloads(scale)
    if args.trace:
        every.append(trace_workload(args.trace, args.replicas, args.trace_cache_ratio, requests=args.trace_requests))
    ws = [w for w in every if not chosen or w.name in chosen]
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
        f"{platform.machine()}, {os.cpu_count()} CPUs shared with other jobs (load average at the end "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}), Python {platform.python_version()}, {platform.system()}; "
        + (
            f"gateway under test pinned to CPU {sorted(gw_cpus)}, engines and client to {sorted(other_cpus)}"
            if gw_cpus and other_cpus
            else "no CPU pinning"
        )
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


if __name__ == "__main__":
    sys.exit(main())
