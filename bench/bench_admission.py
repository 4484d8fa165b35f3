"""Admission control under overload: rejection latency and admitted-request TTFT, admission on vs off.

Setup (loopback; engines and gateways are child processes, this process only drives load): `--engines` simulated
engines with `--slots` concurrent sequences each (pool
capacity C = engines x slots); gateway A has admission on (per-replica gate = slots, global queue bound
`--queue` (default C/4), max wait 10 s); gateway B has admission off (no gate, no queue: the engines queue).
For each load L in 1x, 2x, 3x, L x C closed-loop clients send streaming chat requests for `--duration` seconds
through each gateway in turn. Reported per load: admitted-request TTFT p50/p99 (client side, time to the first
body byte), the ratio of A's TTFT p99 to B's, the share rejected, and the rejection latency p50/p99 (client-side
round trip of a 429/503).

    python bench/bench_admission.py [--duration 4] [--write-docs docs/admission.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import kvgate, sim_engines

MODEL = "sim"


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    reject_latency: list[float] = field(default_factory=list)
    errors: int = 0

    @property
    def total(self) -> int:
        return len(self.ttft) + len(self.reject_latency) + self.errors


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any], result: Result) -> None:
    start = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status in (429, 503):
                await resp.read()
                result.reject_latency.append(time.perf_counter() - start)
                await asyncio.sleep(0.1)  # a polite client backs off a little before retrying
                return
            if resp.status != 200:
                result.errors += 1
                return
            await resp.content.readany()
            result.ttft.append(time.perf_counter() - start)
            await resp.read()
    except aiohttp.ClientError:
        result.errors += 1


async def drive(url: str, clients: int, duration_s: float, max_tokens: int) -> Result:
    result = Result()
    deadline = time.monotonic() + duration_s
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client(i: int) -> None:
            n = 0
            while time.monotonic() < deadline:
                n += 1
                content = f"client {i} request {n}: tell me a story about routers"
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": max_tokens,
                    "stream": True,
                }
                await one_request(session, url, body, result)

        await asyncio.gather(*(client(i) for i in range(clients)))
    return result


def gateway_yaml(admission: dict[str, Any]) -> str:
    cfg = {
        "server": {"access_log": "off", "shutdown_grace_s": 1},
        "health": {"interval_s": 0.5, "metrics_interval_s": 0.1},
        "admission": admission,
    }
    fd, path = tempfile.mkstemp(suffix=".yaml", prefix="kvgate-bench-")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    capacity = args.engines * args.slots
    queue = args.queue if args.queue is not None else max(1, capacity // 4)
    sim = ["--max-num-seqs", str(args.slots), "--decode-ms", str(args.decode_ms), "--prefill-us-per-token", "100"]
    on = {
        "replica_max_concurrency": args.slots,
        "queue": {"max_queued": queue, "max_queued_per_tenant": queue, "max_wait_s": 10},
    }
    paths = [gateway_yaml(on), gateway_yaml({"enabled": False})]
    rows = []
    try:
        with ExitStack() as es:  # engines and gateways are child processes; this process only drives load
            urls = es.enter_context(sim_engines(args.engines, *sim, model=MODEL))
            url_on, _ = es.enter_context(kvgate(urls, "--config", paths[0]))
            url_off, _ = es.enter_context(kvgate(urls, "--config", paths[1]))
            await drive(url_on, capacity, 1.0, args.max_tokens)  # warm-up
            for load in (1, 2, 3):
                clients = load * capacity
                res_on = await drive(url_on, clients, args.duration, args.max_tokens)
                res_off = await drive(url_off, clients, args.duration, args.max_tokens)
                row = {
                    "load": load,
                    "clients": clients,
                    "on_p50": pct(res_on.ttft, 0.5),
                    "on_p99": pct(res_on.ttft, 0.99),
                    "off_p50": pct(res_off.ttft, 0.5),
                    "off_p99": pct(res_off.ttft, 0.99),
                    "rejected": len(res_on.reject_latency) / max(1, res_on.total),
                    "rej_p50": pct(res_on.reject_latency, 0.5),
                    "rej_p99": pct(res_on.reject_latency, 0.99),
                    "on_ok": len(res_on.ttft),
                    "off_ok": len(res_off.ttft),
                    "errors": res_on.errors + res_off.errors,
                }
                row["ratio"] = row["on_p99"] / row["off_p99"] if row["off_p99"] else float("nan")
                rows.append(row)
                print(format_row(row), flush=True)
    finally:
        for path in paths:
            os.unlink(path)
    return rows


HEADER = (
    "| load | clients | TTFT p50 on / off (ms) | TTFT p99 on / off (ms) | p99 on/off | admitted on / off "
    "| rejected | reject p50 / p99 (ms) | errors |\n|---|---|---|---|---|---|---|---|---|"
)


def format_row(r: dict[str, Any]) -> str:
    ms = 1000.0
    rej = f"{r['rej_p50'] * ms:.2f} / {r['rej_p99'] * ms:.2f}" if r["rej_p50"] == r["rej_p50"] else "- / -"
    return (
        f"| {r['load']}x | {r['clients']} | {r['on_p50'] * ms:.1f} / {r['off_p50'] * ms:.1f} "
        f"| {r['on_p99'] * ms:.1f} / {r['off_p99'] * ms:.1f} | {r['ratio']:.2f} | {r['on_ok']} / {r['off_ok']} "
        f"| {r['rejected']:.0%} | {rej} | {r['errors']} |"
    )


async def rejection_cost(n: int = 20_000) -> tuple[float, float]:
    """Server-side work of one refusal (quota check + queue-full test + Overloaded), timed in process: p50, p99 s."""
    from multidict import CIMultiDict
    from prometheus_client import CollectorRegistry

    from engine_pool.replica import Replica
    from engine_pool.replica_set import ReplicaSet
    from gateway.admission.config import AdmissionConfig
    from gateway.admission.controller import AdmissionController
    from gateway.admission.local import LocalQuotaStore
    from gateway.admission.metrics import AdmissionMetrics
    from gateway.context import RequestContext
    from gateway.errors import Overloaded
    from gateway.metrics import GatewayMetrics
    from gateway.router import Router
    from policies.registry import build_policy

    registry = CollectorRegistry()
    cfg = AdmissionConfig.model_validate({"replica_max_concurrency": 1, "queue": {"max_queued": 0}})
    async with aiohttp.ClientSession() as http:
        replicas = ReplicaSet(http)
        replica = Replica("r0", "http://127.0.0.1:9", MODEL, max_concurrency=1)
        replica.healthy = True
        replicas._replicas["r0"] = replica  # no probe task: the replica is only a capacity gate here
        router = Router(build_policy("least-load", {}), replicas, GatewayMetrics(registry))
        ctl = AdmissionController(cfg, replicas, router, LocalQuotaStore(), AdmissionMetrics(registry))
        ident = ctl.identify(CIMultiDict())
        replica.in_flight = 1  # full: every request must be refused at once
        ctl.capacity_gate._active[MODEL] = 1
        times = []
        for i in range(n):
            ctx = RequestContext(request_id=str(i), endpoint="chat")
            start = time.perf_counter()
            try:
                await ctl.admit(ident, MODEL, 10, ctx)
            except Overloaded:
                times.append(time.perf_counter() - start)
    return pct(times, 0.5), pct(times, 0.99)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--slots", type=int, default=8, help="max_num_seqs per engine = the gateway's per-replica gate")
    p.add_argument("--decode-ms", type=float, default=8.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--queue", type=int, default=None, help="global queue bound (default capacity/4)")
    p.add_argument("--duration", type=float, default=4.0, help="seconds per load level and gateway")
    p.add_argument("--write-docs", default=None, help="replace the results table in this markdown file")
    args = p.parse_args()
    cost = asyncio.run(rejection_cost())
    print(f"server-side rejection work: p50 {cost[0] * 1e6:.1f} us, p99 {cost[1] * 1e6:.1f} us")
    print(HEADER)
    rows = asyncio.run(run(args))
    if args.write_docs:
        write_docs(args.write_docs, rows, args, cost)


def write_docs(path: str, rows: list[dict[str, Any]], args: argparse.Namespace, cost: tuple[float, float]) -> None:
    begin, end = "<!-- bench:begin -->", "<!-- bench:end -->"
    with open(path) as f:
        text = f.read()
    settings = (
        f"engines={args.engines} slots={args.slots} decode_ms={args.decode_ms} max_tokens={args.max_tokens} "
        f"duration={args.duration}s per load and gateway"
    )
    settings += f"\n\nServer-side rejection work (in process): p50 {cost[0] * 1e6:.1f} us, p99 {cost[1] * 1e6:.1f} us."
    table = "\n".join([HEADER, *(format_row(r) for r in rows)])
    block = f"{begin}\n{settings}\n\n{table}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text += "\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
