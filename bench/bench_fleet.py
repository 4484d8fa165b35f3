"""Fleet benchmark (issue 16): one kvgate against three behind haproxy, on the same simulated engines.

    python -m bench.bench_fleet                  # ~6 min on 2 shared cores; prints a table, writes --json
    python -m bench.bench_fleet --scale 0.3      # smaller workloads

Setups, each on the same 3 simulated engines (no KV events: the approximate index, where sharing matters) with the
engines' prefix caches reset and Redis emptied before every run, fresh gateways every run:
- `one`: one gateway;
- `three-shared`: three gateways behind haproxy (round robin), sharing their routing through Redis (the default
  when a Redis is configured);
- `three-alone`: the same three with `fleet.share_routing: false` (each learns only from its own routing).
Workloads from `routing_workloads` (shared-prefix, agent-sessions, hot-prefix), closed loop at each workload's
concurrency, streaming chat through `loadgen.runner`. Reported: engine-side prefix hit rate, TTFT p50/p99, the
request share of each replica (what per-gateway in-flight counts do to balance), agent sessions that changed
replica, and the gateways' CPU per request (all of them together).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import redis
import yaml

from bench._procs import free_port, wait_http
from bench.bench_routing import MODEL, _run, measure
from bench.routing_procs import SimCosts, children, cpu_seconds, gateway_yaml, sim_pool
from bench.routing_workloads import Workload, workloads
from loadgen.runner import Arrival
from loadgen.stats import summarize

SETUPS = ("one", "three-shared", "three-alone")
HAPROXY = """
global
    maxconn 4000
defaults
    mode http
    timeout connect 1s
    timeout client 300s
    timeout server 300s
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response
    option http-no-delay
frontend entry
    bind 127.0.0.1:{port}
    default_backend gateways
backend gateways
    balance roundrobin
    option httpchk GET /ready
    default-server inter 500ms
{servers}
"""


@contextmanager
def redis_server() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait()


@contextmanager
def fleet(sims: Sequence[str], setup: str, redis_url: str, max_num_seqs: int) -> Iterator[tuple[str, list[int]]]:
    """The setup's gateways (and haproxy for three): (entry URL, gateway pids)."""
    n = 1 if setup == "one" else 3
    with tempfile.TemporaryDirectory(prefix="kvgate-fleet-bench-") as tmp:
        ports = [free_port() for _ in range(n)]
        specs = []
        for i, port in enumerate(ports):
            cfg = gateway_yaml(sims, "cache-aware", {}, port, max_num_seqs)
            cfg["fleet"] = {"redis_url": redis_url, "share_routing": setup != "three-alone"}
            path = os.path.join(tmp, f"gw{i}.yaml")
            Path(path).write_text(yaml.safe_dump(cfg))
            url = f"http://127.0.0.1:{port}"
            specs.append((["kvgate", "serve", "--config", path, "--log-level", "WARNING"], [f"{url}/ready"]))
        with children(specs) as procs:
            if n == 1:
                yield f"http://127.0.0.1:{ports[0]}", [p.pid for p in procs]
                return
            entry = free_port()
            servers = "\n".join(f"    server gw{i} 127.0.0.1:{p} check" for i, p in enumerate(ports))
            cfg_path = os.path.join(tmp, "haproxy.cfg")
            Path(cfg_path).write_text(HAPROXY.format(port=entry, servers=servers))
            lb = subprocess.Popen(["haproxy", "-db", "-f", cfg_path], stdout=subprocess.DEVNULL)
            try:
                wait_http(f"http://127.0.0.1:{entry}/ready")
                time.sleep(1.5)  # haproxy's first health checks mark every gateway up (inter 500ms)
                yield f"http://127.0.0.1:{entry}", [p.pid for p in procs]
            finally:
                lb.terminate()
                lb.wait()


def run_one(w: Workload, setup: str, sims: Sequence[str], redis_url: str, costs: SimCosts, seed: int) -> dict[str, Any]:
    redis.Redis.from_url(redis_url).flushall()  # a fresh fleet must not learn the previous run's routing
    with fleet(sims, setup, redis_url, costs.max_num_seqs) as (entry, pids):
        cpu0 = sum(cpu_seconds(p) for p in pids)
        res, cache, _ = _run(measure(entry, sims, w, Arrival("closed", concurrency=w.concurrency), seed))
        cpu_ms = 1e3 * (sum(cpu_seconds(p) for p in pids) - cpu0) / max(1, len(res.results))
    s = summarize(res.results, res.wall_s)
    ports = [u.rsplit(":", 1)[1] for u in sims]
    counts = [sum(1 for r in res.results if (r.replica or "").endswith(f":{p}")) for p in ports]
    sessions: dict[str, set[str]] = {}
    for r in res.results:
        if r.session_id:
            sessions.setdefault(r.session_id, set()).add(r.replica or "")
    return {
        "workload": w.name, "setup": setup, "requests": s.requests, "failed": s.failed,
        "hit_rate": cache["hit_rate"] or 0.0,
        "ttft_p50_ms": 1e3 * (s.ttft_s["p50"] or 0.0), "ttft_p99_ms": 1e3 * (s.ttft_s["p99"] or 0.0),
        "share": [c / max(1, sum(counts)) for c in counts],
        "sessions_moved": sum(1 for v in sessions.values() if len(v) > 1), "sessions": len(sessions),
        "gw_cpu_ms": cpu_ms,
    }  # fmt: skip


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(runs[0])
    for key in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "gw_cpu_ms", "sessions_moved"):
        out[key] = statistics.median(r[key] for r in runs)
    out["failed"] = sum(r["failed"] for r in runs)
    out["share"] = [statistics.fmean(s) for s in zip(*(r["share"] for r in runs), strict=True)]
    out["hit_rate_range"] = (min(r["hit_rate"] for r in runs), max(r["hit_rate"] for r in runs))
    out["repeats"] = len(runs)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=0.5, help="workload size (routing_workloads' scale)")
    p.add_argument("--workloads", nargs="*", default=["shared-prefix", "agent-sessions", "hot-prefix"])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default="docs/bench/fleet.json", help="where to write the rows ('' = nowhere)")
    args = p.parse_args(argv)
    for tool in ("redis-server", "haproxy"):
        if shutil.which(tool) is None:
            print(f"{tool} is not installed (apt-get install {tool})", file=sys.stderr)
            return 2
    costs = SimCosts()
    rows = []
    with redis_server() as redis_url:
        for w in (w for w in workloads(args.scale) if w.name in args.workloads):
            with sim_pool(3, costs, w.num_blocks, MODEL) as sims:
                runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SETUPS}
                for rep in range(args.repeat):
                    order = SETUPS[rep % 3 :] + SETUPS[: rep % 3]  # no setup always first
                    for setup in order:
                        row = run_one(w, setup, sims, redis_url, costs, args.seed)
                        runs[setup].append(row)
                        print(
                            f"  {w.name:<15} {setup:<13} hit {row['hit_rate']:6.1%} ttft p50 {row['ttft_p50_ms']:7.1f}"
                            f" p99 {row['ttft_p99_ms']:7.1f} ms share {[round(x, 2) for x in row['share']]} "
                            f"sessions moved {row['sessions_moved']}/{row['sessions']} gw {row['gw_cpu_ms']:.2f} "
                            f"ms CPU/req fail {row['failed']}",
                            flush=True,
                        )
                rows += [median_row(runs[s]) for s in SETUPS]
    print("\nworkload         setup          hit rate (range)        TTFT p50 / p99 ms   replica share      moved")
    for r in rows:
        lo, hi = r["hit_rate_range"]
        print(
            f"{r['workload']:<16} {r['setup']:<14} {r['hit_rate']:6.1%} ({lo:.1%}-{hi:.1%})  "
            f"{r['ttft_p50_ms']:7.1f} / {r['ttft_p99_ms']:7.1f}   {[round(x, 2) for x in r['share']]}  "
            f"{r['sessions_moved']}/{r['sessions']}"
        )
    if args.json:
        meta = {"machine": f"{platform.machine()} {os.cpu_count()} CPUs", "argv": sys.argv[1:], "costs": asdict(costs)}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
