"""What kvgate costs per streamed token: gateway CPU per token of long streams, one token an event, an event a chunk.

`bench_gateway_overhead.py` measures per request against instant engines, which send a whole stream in one chunk;
a real engine sends a stream's tokens one decode step at a time (vLLM: one event a token, `--stream-interval 1`),
so a long answer crosses the gateway as hundreds of chunks, each read, split, checked and written on its own. Here
two simulated engines decode one token every `--decode-ms` (no prefill cost), `--streams` streams of
`--max-tokens` tokens run at once through each gateway in turn, and each gateway's process CPU (from /proc) over the
streams is divided by the tokens they delivered. Side by side in one run: kvgate as shipped (cache-aware, latency
targets, plain access log; chat streams, which kvgate keeps migratable), kvgate with `--baseline DIR` (another
checkout), the floor (`bench/floor_proxy.py`: relaying only) and, with `--sglang-python PY`, sglang-router (as in
`bench_gateway_overhead.py`). Medians over `--repeat` rounds.
Rerun: `python bench/bench_stream_tokens.py [--repeat N] [--baseline DIR] [--out docs/...md]` (5 rounds: ~4 min).
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
from contextlib import ExitStack
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import cpu_seconds, kvgate, sim_engine_processes
from bench_gateway_overhead import CACHE_ENV, floor_proxy, sglang_router


async def one(session: aiohttp.ClientSession, url: str, max_tokens: int, i: int) -> int:
    """One chat stream; the content events it delivered (tokens)."""
    body = {
        "model": "sim",
        "messages": [{"role": "user", "content": f"stream {i}: tell me a long story"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    tokens = 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content"' in line:
                tokens += 1
    return tokens


async def cpu_per_token(url: str, pid: int, streams: int, concurrency: int, max_tokens: int) -> dict[str, float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(one(s, url, 8, i) for i in range(concurrency)))  # warm: connections, caches
        queue = iter(range(streams))
        delivered = 0

        async def worker() -> None:
            nonlocal delivered
            for i in queue:
                tokens = await one(s, url, max_tokens, i)  # read after the await: `+=` would lose the others' counts
                delivered += tokens

        c0, t0 = cpu_seconds(pid), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        c1, t1 = cpu_seconds(pid), time.perf_counter()
    return {"cpu_us_per_token": (c1 - c0) / delivered * 1e6, "tokens_per_s": delivered / (t1 - t0)}


async def measure(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    os.environ.update(CACHE_ENV)  # inherited by the kvgate children
    engine_args = ("--decode-ms", str(args.decode_ms), "--decode-ms-per-seq", "0", "--overhead-ms", "0")
    engine_args += ("--prefill-us-per-token", "0", "--max-num-seqs", "256")
    runs: dict[str, list[dict[str, float]]] = {}
    with sim_engine_processes(2, *engine_args) as procs, ExitStack() as stack:
        engines = [url for url, _ in procs]
        gateways = [("kvgate as shipped", *stack.enter_context(kvgate(engines, "--access-log", "plain")))]
        if args.baseline is not None:
            cm = kvgate(engines, "--access-log", "plain", source=args.baseline)
            gateways.append(("kvgate --baseline", *stack.enter_context(cm)))
        gateways.append(("floor: relaying only", *stack.enter_context(floor_proxy(engines))))
        if args.sglang_python is not None:
            gateways.append(
                ("sglang-router (cache_aware)", *stack.enter_context(sglang_router(args.sglang_python, engines)))
            )
        for round_no in range(args.repeat):
            for name, url, pid in gateways:
                row = await cpu_per_token(url, pid, args.streams, args.concurrency, args.max_tokens)
                runs.setdefault(name, []).append(row)
                print(f"round {round_no} {name}", json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
    return runs


def markdown(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> str:
    lines = ["| gateway | CPU us per streamed token (range) | tokens/s |", "|---|---|---|"]
    for name, rows in runs.items():
        cpu = [r["cpu_us_per_token"] for r in rows]
        rate = statistics.median(r["tokens_per_s"] for r in rows)
        lines.append(f"| {name} | {statistics.median(cpu):.1f} ({min(cpu):.1f}-{max(cpu):.1f}) | {rate:.0f} |")
    lines.append("")
    lines.append(
        f"{platform.machine()}, {platform.python_version()}; medians over {args.repeat} rounds; {args.streams} chat "
        f"streams of {args.max_tokens} tokens, {args.concurrency} at once; engines: 2 x `kvgate sim-engine` decoding "
        f"a token every {args.decode_ms} ms, one event a token; each gateway its own process, this client another."
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=8, help="streams at once (at 32 the engines fill both cores)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--decode-ms", type=float, default=2.0)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--baseline", type=Path, help="another checkout (git worktree add DIR <commit>), side by side")
    p.add_argument("--sglang-python", help="the Python of a virtualenv with sglang-router, measured alongside")
    p.add_argument("--out", type=Path, help="write the markdown table here")
    args = p.parse_args()
    table = markdown(asyncio.run(measure(args)), args)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
