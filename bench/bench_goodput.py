"""Goodput past the knee: routers without admission, the best static gate, and admission by latency targets.

Setup (loopback; engines and gateways are child processes, this process drives load with kvgate's load generator):
two simulated engines whose KV capacity caps the running batch as vLLM's scheduler does (`--num-blocks` so that
`--fit` requests of `--prompt` + `--output` tokens fit; a request waits until its blocks fit), GPU-like costs;
Poisson arrivals of zero-reuse streamed requests at 0.5x, 1x, 2x and 3x the pool's capacity (capacity = the rate
the pool completes with every KV slot busy, measured first by a closed loop at 2 x fit x engines); `--requests`
per rate. A request is *good* when it succeeds within the targets (`--ttft`, `--tpot`); goodput = good requests /
wall time. Side by side, the same seeded workload through:
- round-robin, least-load and cache-aware with no admission (`admission.targets.enabled: false`);
- static gates (`replica_max_concurrency` in `--gates`, the shipped queue: up to 30 s), the best of them per rate;
- latency targets only (the shipped default path: cache-aware, `admission.targets` = the SLO, no gate).
Then a context shift: one run at `--shift-rate` x capacity whose prompts double in length half way through (the
knee moves: half as many fit), through the static gates and the targets; and the per-phase oracle: each phase run
alone through every static gate, the best gate of each phase taken (good requests of both phases over both phases'
time), which is what a sweep per phase would set if someone reset the gate at the very moment the prompts changed.

    python bench/bench_goodput.py [--repeat 3] [--json docs/bench/goodput.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _procs import kvgate, sim_engines

from loadgen.client import RequestSpec, Target
from loadgen.runner import Arrival, run_setting
from loadgen.stats import Slo, percentile, summarize
from loadgen.text import CharTextMaker

MODEL = "sim"


def workload(prompt: int, output: int, n: int, shift_at: int | None = None) -> Any:
    """Zero-reuse requests of `prompt` tokens (2 x prompt from request `shift_at` on), `output` tokens each."""
    maker = CharTextMaker()

    def factory(seed: int) -> Iterator[RequestSpec]:
        for i in range(n):
            tokens = prompt * 2 if shift_at is not None and i >= shift_at else prompt
            text = maker.text(f"goodput-{seed}-{i}", tokens)
            yield RequestSpec(f"g{i}", f"g{i}", 0, (("user", text),), output, est_prompt_tokens=tokens)

    return factory


def gateway_yaml(policy: str, admission: dict[str, Any], params: dict[str, Any] | None = None) -> str:
    cfg = {
        "server": {"access_log": "off", "shutdown_grace_s": 1},
        "health": {"interval_s": 0.5, "metrics_interval_s": 0.25},
        "routing": {"policy": policy, "params": params or {}},
        "admission": admission,
    }
    fd, path = tempfile.mkstemp(suffix=".yaml", prefix="kvgate-goodput-")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def configs(args: argparse.Namespace) -> dict[str, tuple[str, dict[str, Any], dict[str, Any]]]:
    off = {"targets": {"enabled": False}}
    out = {
        "round-robin": ("round-robin", off, {}),
        "least-load": ("least-load", off, {}),
        "cache-aware": ("cache-aware", off, {}),
    }
    for gate in args.gates:
        out[f"gate {gate}"] = ("cache-aware", {**off, "replica_max_concurrency": gate}, {})
    targets = {"default": {"ttft_s": args.ttft, "tpot_s": args.tpot}}
    out["targets"] = ("cache-aware", {"targets": targets}, {})
    # the same, cache-aware's cost in token equivalents instead of predicted seconds (the previous default)
    out["targets-tokens"] = ("cache-aware", {"targets": targets}, {"unit": "tokens"})
    for gate in args.target_gates:  # a static gate beside the targets: admission's queue then has work to do
        out[f"targets + gate {gate}"] = ("cache-aware", {"targets": targets, "replica_max_concurrency": gate}, {})
    return out


async def measure(
    http: aiohttp.ClientSession, url: str, factory: Any, rate: float, seed: int, slo: Slo
) -> dict[str, Any]:
    target = Target(url, MODEL, "chat", timeout_s=120.0)
    arrival = Arrival("poisson", rate=rate, max_inflight=4096)
    started = time.monotonic()
    res = await run_setting(http, target, factory, arrival, seed=seed)
    summary = summarize(res.results, res.wall_s, slo)
    refused = [r for r in res.results if r.status in (429, 503)]
    admitted = [r for r in res.results if r.ok]
    return {
        "goodput": summary.goodput_req_per_s,
        "attainment": summary.slo_attainment,
        "admitted": len(admitted),
        "refused": len(refused),
        "requests": len(res.results),
        "ttft_p50": summary.ttft_s["p50"],
        "ttft_p99": summary.ttft_s["p99"],
        "refusal_p99_ms": percentile([r.e2e_s for r in refused], 99) * 1e3 if refused else None,
        "good": round((summary.goodput_req_per_s or 0.0) * res.wall_s),
        "run_s": res.wall_s,
        "wall_s": time.monotonic() - started,
    }


async def capacity(http: aiohttp.ClientSession, url: str, args: argparse.Namespace) -> float:
    """Completed requests per second with every KV slot busy (a closed loop at twice the slots)."""
    n = 4 * args.fit * 2
    target = Target(url, MODEL, "chat", timeout_s=120.0)
    res = await run_setting(
        http, target, workload(args.prompt, args.output, n), Arrival("closed", concurrency=2 * args.fit * 2), seed=99
    )
    return sum(1 for r in res.results if r.ok) / res.wall_s


async def run(args: argparse.Namespace) -> dict[str, Any]:
    blocks = args.fit * (args.prompt + args.output + 16) // 16
    sim = [
        "--block-size", "16", "--num-blocks", str(blocks), "--max-num-seqs", "256",
        "--overhead-ms", "2", "--prefill-us-per-token", str(args.prefill_us),
        "--decode-ms", str(args.decode_ms), "--decode-ms-per-seq", str(args.decode_ms_per_seq),
    ]  # fmt: skip
    slo = Slo(ttft_s=args.ttft, tpot_s=args.tpot)
    doc: dict[str, Any] = {"settings": vars(args), "kv_blocks": blocks, "rates": {}, "shift": {}}
    paths: list[str] = []
    try:
        with ExitStack() as es:
            engines = es.enter_context(sim_engines(2, *sim, model=MODEL))
            gateways = {}
            for name, (policy, admission, params) in configs(args).items():
                if args.configs and name not in args.configs:
                    continue
                paths.append(gateway_yaml(policy, admission, params))
                gateways[name] = es.enter_context(kvgate(engines, "--config", paths[-1]))[0]
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as http:
                cap = args.capacity or await capacity(http, next(iter(gateways.values())), args)
                doc["capacity_req_per_s"] = cap
                print(f"pool capacity {cap:.2f} req/s ({blocks} KV blocks per engine)", flush=True)
                for repeat in range(args.repeat):
                    order = list(gateways)[repeat % len(gateways) :] + list(gateways)[: repeat % len(gateways)]
                    for scale in args.scales:
                        factory = workload(args.prompt, args.output, args.requests)
                        for name in order:
                            row = await measure(http, gateways[name], factory, scale * cap, 1000 + repeat, slo)
                            doc["rates"].setdefault(f"{scale:g}x", {}).setdefault(name, []).append(row)
                            print(f"repeat {repeat} {scale:g}x {name}: {_line(row)}", flush=True)
                    shift = workload(args.prompt, args.output, args.requests, shift_at=args.requests // 2)
                    for name in order:
                        if name in ("round-robin", "least-load", "cache-aware"):  # no admission: collapse as at 3x
                            continue
                        row = await measure(http, gateways[name], shift, args.shift_rate * cap, 2000 + repeat, slo)
                        doc["shift"].setdefault(name, []).append(row)
                        print(f"repeat {repeat} shift {name}: {_line(row)}", flush=True)
                    await oracle(http, gateways, args, repeat, slo, doc)
    finally:
        for path in paths:
            os.unlink(path)
    return doc


async def oracle(
    http: aiohttp.ClientSession,
    gateways: dict[str, str],
    args: argparse.Namespace,
    repeat: int,
    slo: Slo,
    doc: dict[str, Any],
) -> None:
    """The context shift's two phases, each alone through every static gate: the per-phase best gate's goodput."""
    half = args.requests // 2
    phases = {"short": workload(args.prompt, args.output, half), "long": workload(2 * args.prompt, args.output, half)}
    rate = args.shift_rate * doc["capacity_req_per_s"]
    best: dict[str, dict[str, Any]] = {}
    for phase, factory in phases.items():
        for name in (n for n in gateways if n.startswith("gate ")):
            row = await measure(http, gateways[name], factory, rate, 3000 + repeat, slo)
            print(f"repeat {repeat} oracle {phase} {name}: {_line(row)}", flush=True)
            if phase not in best or row["goodput"] > best[phase]["goodput"]:
                best[phase] = {**row, "gate": name}
    if len(best) == 2:
        wall = sum(r["run_s"] for r in best.values())
        good = sum(r["good"] for r in best.values())
        row = {"goodput": good / wall, "phases": best}
        doc.setdefault("oracle", []).append(row)
        print(f"repeat {repeat} per-phase oracle: goodput {row['goodput']:.2f} req/s", flush=True)


def merged(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`base` with the configurations `new` measured replaced by `new`'s rows (the capacity of each run kept)."""
    out = json.loads(json.dumps(base))
    for rate, by_name in new["rates"].items():
        out["rates"].setdefault(rate, {}).update(by_name)
    out["shift"].update(new["shift"])
    if new.get("oracle"):
        out["oracle"] = new["oracle"]
    out.setdefault("reruns", []).append(
        {"configs": list(new["settings"]["configs"] or []), "capacity": new["capacity_req_per_s"]}
    )
    return out


def _line(row: dict[str, Any]) -> str:
    p99 = row["ttft_p99"]
    return (
        f"goodput {row['goodput']:.2f} req/s, {row['attainment']:.0%} within, admitted {row['admitted']}/"
        f"{row['requests']}, TTFT p99 {p99 if p99 is None else round(p99, 2)} s, refusal p99 "
        f"{row['refusal_p99_ms'] and round(row['refusal_p99_ms'], 1)} ms"
    )


def table(doc: dict[str, Any], gates: list[int]) -> str:
    """Medians over the repeats: goodput (req/s) and attainment per rate and configuration."""
    names = ["round-robin", "least-load", "cache-aware", "best static gate", "targets", "targets-tokens"]
    names += sorted({n for by_name in doc["rates"].values() for n in by_name if n.startswith("targets + gate")})
    lines = ["| rate | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for rate, by_name in doc["rates"].items():
        cells = []
        for name in names:
            if name == "best static gate":
                gated = [by_name[f"gate {g}"] for g in gates if f"gate {g}" in by_name]
                rows = max(gated, key=lambda rs: statistics.median(_g(rs))) if gated else []
            else:
                rows = by_name.get(name, [])
            cells.append(_cell(rows) if rows else "-")
        lines.append(f"| {rate} | " + " | ".join(cells) + " |")
    if doc["shift"]:
        shift = doc["shift"]
        gated = [shift[f"gate {g}"] for g in gates if f"gate {g}" in shift]
        best = _cell(max(gated, key=lambda rs: statistics.median(_g(rs)))) if gated else "-"
        targets = [_cell(shift[n]) if n in shift else "-" for n in names[4:]]
        lines.append(f"| context shift | - | - | - | {best} | {' | '.join(targets)} |")
    if doc.get("oracle"):
        lines.append(f"\nper-phase oracle gate (context shift): {statistics.median(_g(doc['oracle'])):.2f} req/s")
    return "\n".join(lines)


def _g(rows: list[dict[str, Any]]) -> list[float]:
    return [r["goodput"] or 0.0 for r in rows]


def _cell(rows: list[dict[str, Any]]) -> str:
    goodput = statistics.median(_g(rows))
    att = statistics.median(r["attainment"] or 0.0 for r in rows)
    p99s = [r["ttft_p99"] for r in rows if r["ttft_p99"] is not None]
    p99 = f", p99 {statistics.median(p99s):.1f} s" if p99s else ""
    return f"{goodput:.2f} ({att:.0%}{p99})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--output", type=int, default=32, help="output tokens per request")
    p.add_argument("--fit", type=int, default=8, help="requests whose KV fits in one engine at once")
    p.add_argument("--prefill-us", type=float, default=100.0, help="prefill microseconds per token")
    p.add_argument("--decode-ms", type=float, default=20.0)
    p.add_argument("--decode-ms-per-seq", type=float, default=1.0)
    p.add_argument("--ttft", type=float, default=1.0, help="time-to-first-token target, seconds")
    p.add_argument("--tpot", type=float, default=0.04, help="time-per-output-token target, seconds")
    p.add_argument("--scales", type=float, nargs="*", default=[0.5, 1.0, 2.0, 3.0], help="rates x capacity")
    p.add_argument("--shift-rate", type=float, default=1.0, help="context-shift run's rate x capacity")
    p.add_argument("--gates", type=int, nargs="+", default=[4, 8, 12])
    p.add_argument("--target-gates", type=int, nargs="*", default=[], help="also the targets beside these gates")
    p.add_argument("--requests", type=int, default=150, help="requests per rate")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--configs", nargs="*", default=None, help="only these configurations (names as in the table)")
    p.add_argument("--merge", default=None, help="a results file whose rows of these configurations are replaced")
    p.add_argument("--capacity", type=float, default=None, help="req/s (default: measured, through the first one)")
    args = p.parse_args()
    doc = asyncio.run(run(args))
    if args.merge:
        doc = merged(json.loads(Path(args.merge).read_text()), doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc, args.gates))


if __name__ == "__main__":
    main()
