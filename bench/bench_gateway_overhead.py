"""What kvgate itself costs: added latency and CPU per request, against instant simulated engines.

Side by side in one run, on the same engines:
- added latency at concurrency 1: requests alternate between "direct to an engine" and "through kvgate", so both
  see the same machine state; reported as p50/p99 of each and their difference;
- gateway CPU per request at high concurrency: kvgate's own process CPU seconds (from /proc) over N requests,
  streaming and not;
- the default policy of the shipped configs (cache-aware) and least-load, with and without the access log and
  admission by latency targets (what each part of the path costs);
- with `--baseline DIR`, the same modes of another checkout (the previous release) in the same run;
- with `--sglang-python PY` (a virtualenv with sglang-router: `python -m venv .kvgate/sglang-venv &&
  .kvgate/sglang-venv/bin/pip install sglang-router==0.3.2`), sglang-router's cache_aware policy in front of the
  same engines, measured the same way (its process CPU from /proc, all its threads);
- the floor: a Python proxy on kvgate's parts that only relays (`bench/floor_proxy.py`: aiohttp server on uvloop,
  kvgate's engine client, round-robin, nothing parsed or counted), what any gateway on these parts pays at least;
- every mode measured once per round, over `--repeat` rounds, reported as medians and ranges (this machine's speed
  drifts by 20-30% over minutes: only numbers taken side by side compare).
kvgate runs as its own process (`kvgate serve`, uvloop), the engines as `kvgate sim-engine --instant`, and this
script is the client. Rerun: `python bench/bench_gateway_overhead.py [--repeat N] [--baseline DIR] [--out docs/...md]`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import cpu_seconds, free_port, kvgate, process, sglang_argv, sim_engine_processes


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


PROMPT = ["hello world " * 8]  # --prompt-words replaces it
_SENT = itertools.count()


def prompt() -> str:
    """The prompt of the next request: the short default, or (`--prompt-words N`) a system part of N words that
    every request shares and a 32-word turn of its own (a chat's new tail: new blocks for the prefix index)."""
    if len(PROMPT) == 1:
        return PROMPT[0]
    return f"{PROMPT[0]} turn {next(_SENT)} {PROMPT[1]}"


async def one(session: aiohttp.ClientSession, url: str, stream: bool) -> float:
    body = {"model": "sim", "prompt": prompt(), "max_tokens": 16, "stream": stream}
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
    return time.perf_counter() - t0


async def latency(direct: str, gateway: str, n: int, stream: bool) -> dict[str, float]:
    d: list[float] = []
    g: list[float] = []
    async with aiohttp.ClientSession() as s:
        for _ in range(50):  # warm both paths' connections
            await one(s, direct, stream)
            await one(s, gateway, stream)
        for _ in range(n):
            d.append(await one(s, direct, stream))
            g.append(await one(s, gateway, stream))
    ms = 1000.0
    return {
        "direct_p50_ms": pct(d, 50) * ms,
        "direct_p99_ms": pct(d, 99) * ms,
        "kvgate_p50_ms": pct(g, 50) * ms,
        "kvgate_p99_ms": pct(g, 99) * ms,
        "added_p50_ms": (pct(g, 50) - pct(d, 50)) * ms,
        "added_p99_ms": (pct(g, 99) - pct(d, 99)) * ms,
        "added_median_of_pairs_ms": statistics.median(x - y for x, y in zip(g, d, strict=True)) * ms,
    }


async def cpu_per_request(url: str, pid: int, n: int, concurrency: int, stream: bool) -> dict[str, float]:
    """CPU milliseconds the process `pid` spends per request sent to `url`, at the given concurrency."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(one(s, url, stream) for _ in range(200)))
        queue = iter(range(n))

        async def worker() -> None:
            for _ in queue:
                await one(s, url, stream)

        c0, t0 = cpu_seconds(pid), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        c1, t1 = cpu_seconds(pid), time.perf_counter()
    return {"cpu_ms_per_request": (c1 - c0) / n * 1000, "requests_per_s": n / (t1 - t0)}


# (policy, access log, admission by latency targets): the default routing policy of the shipped configs
# (cache-aware, with the simulator's exact tokenizer) with the default access log and latency targets, then without
# the log, then without the targets too, and least-load the same two ways: what each part of the path costs.
MODES = (
    ("cache-aware", "plain", True),
    ("cache-aware", "off", True),
    ("cache-aware", "off", False),
    ("least-load", "off", True),
    ("least-load", "off", False),
)
TARGETS_OFF = {"KVGATE__ADMISSION__TARGETS__ENABLED": "false"}
CACHE_ENV = {"KVGATE__CACHE__TOKENIZERS__SIM": "sim"}


@contextmanager
def sglang_router(python: str, engines: list[str]) -> Iterator[tuple[str, int]]:
    """sglang-router (Rust) with its cache_aware policy in front of `engines`: (URL, pid)."""
    port = free_port()
    with process(sglang_argv(python, port, engines), f"http://127.0.0.1:{port}/health") as proc:
        yield f"http://127.0.0.1:{port}", proc.pid


@contextmanager
def floor_proxy(engines: list[str]) -> Iterator[tuple[str, int]]:
    """What relaying alone costs on kvgate's parts (aiohttp server on uvloop, kvgate's engine client): (URL, pid)."""
    port = free_port()
    argv = [sys.executable, str(Path(__file__).with_name("floor_proxy.py")), "--port", str(port)]
    argv += [a for e in engines for a in ("--engine", e)]
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    with process(argv, f"http://127.0.0.1:{port}/health", env) as proc:
        yield f"http://127.0.0.1:{port}", proc.pid


async def measure(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    """Every mode's measurements, one per round: all gateways (this checkout's and, with `--baseline`, the previous
    release's) run at once and each round measures each of them (and the engine alone) in turn, so slow and fast
    spells of the shared machine reach every mode alike."""
    runs: dict[str, list[dict[str, float]]] = {}
    sources: list[tuple[str, Path | None]] = [("this", None)]
    if args.baseline is not None:
        sources.append(("previous", args.baseline))
    os.environ.update(CACHE_ENV)  # inherited by the kvgate children
    with sim_engine_processes(2, "--instant") as procs, ExitStack() as stack:
        engines = [url for url, _ in procs]
        gateways = []
        for release, source in sources:
            for policy, log_mode, targets in MODES:
                log_level = "WARNING" if log_mode == "off" else "INFO"
                extra = ("--policy", policy, "--access-log", log_mode, "--log-level", log_level)
                cm = kvgate(engines, *extra, source=source, env=None if targets else TARGETS_OFF)
                name = f"{release} {policy} access_log={log_mode}{'' if targets else ' targets=off'}"
                gateways.append((name, *stack.enter_context(cm)))
        gateways.append(("floor: relaying only (bench/floor_proxy.py)", *stack.enter_context(floor_proxy(engines))))
        if args.sglang_python is not None:
            gateways.append(
                ("sglang-router cache_aware", *stack.enter_context(sglang_router(args.sglang_python, engines)))
            )
        for round_no in range(args.repeat):
            for stream in (False, True):  # reference: what one plain aiohttp server (the engine itself) costs
                ref = await cpu_per_request(procs[0][0], procs[0][1], args.requests, args.concurrency, stream)
                runs.setdefault(f"engine alone, stream={stream}", []).append(ref)
                print(f"round {round_no} engine alone stream={stream}", json.dumps(ref), flush=True)
            for name, gw, pid in gateways:
                for stream in (False, True):
                    key = f"{name} stream={stream}"
                    lat = await latency(engines[0], gw, args.latency_requests, stream)
                    cpu = await cpu_per_request(gw, pid, args.requests, args.concurrency, stream)
                    runs.setdefault(key, []).append({**lat, **cpu})
                    print(f"round {round_no} {key}", json.dumps({k: round(v, 4) for k, v in {**lat, **cpu}.items()}))
    return runs


def markdown(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> str:
    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    def spread(rows: list[dict[str, float]], key: str) -> str:
        values = [r[key] for r in rows]
        return f"{med(rows, key):.3f} ({min(values):.3f}-{max(values):.3f})"

    lines = [
        "| mode | direct p50 ms | kvgate p50 ms | added p50 ms (range) | added p99 ms | CPU ms/req (range) "
        "| CPU / engine alone | req/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, rows in runs.items():
        if key.startswith("engine alone"):
            lines.append(f"| {key} (reference) | | | | | {spread(rows, 'cpu_ms_per_request')} | 1 | |")
            continue
        ref = runs[f"engine alone, stream={key.rsplit('stream=', 1)[1]}"]
        ratio = med(rows, "cpu_ms_per_request") / med(ref, "cpu_ms_per_request")
        lines.append(
            f"| {key} | {med(rows, 'direct_p50_ms'):.3f} | {med(rows, 'kvgate_p50_ms'):.3f} | "
            f"{spread(rows, 'added_p50_ms')} | {med(rows, 'added_p99_ms'):.3f} | "
            f"{spread(rows, 'cpu_ms_per_request')} | {ratio:.2f} | {med(rows, 'requests_per_s'):.0f} |"
        )
    lines.append(
        f"\n{platform.machine()}, {platform.python_version()}; medians (and ranges) over {args.repeat} rounds, each "
        f"measuring every mode in turn; latency: {args.latency_requests} alternating pairs at concurrency 1; CPU: "
        f"{args.requests} requests at concurrency {args.concurrency}; engines: 2 x `kvgate sim-engine --instant`; "
        f"prompts: {f'{args.prompt_words} shared words and a 32-word turn' if args.prompt_words else '16 words'}; "
        "each kvgate as its own process (uvloop), this client in another."
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--latency-requests", type=int, default=1000)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5, help="rounds; the table shows medians and ranges")
    p.add_argument("--out", type=Path, help="write the markdown table here")
    p.add_argument(
        "--baseline",
        type=Path,
        help="a checkout of the previous release (git worktree add DIR <commit>), run side by side with this one",
    )
    p.add_argument("--sglang-python", help="the Python of a virtualenv with sglang-router, to measure it alongside")
    p.add_argument(
        "--prompt-words",
        type=int,
        help="a shared system part of this many words and a 32-word turn per request (default: 16 words, the same "
        "for every request)",
    )
    args = p.parse_args()
    if args.prompt_words:
        words = [f"w{i % 97}" for i in range(args.prompt_words)]
        PROMPT[:] = [" ".join(words), " ".join(f"x{i}" for i in range(31))]
    results = asyncio.run(measure(args))
    table = markdown(results, args)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
