"""Soak benchmark (issue 14; not a CI test): mixed traffic through one kvgate for a long while, faults injected at
random, and the checks an operator cares about.

    python -m bench.soak                         # 20 minutes (the issue's run); writes docs/bench/soak.json
    python -m bench.soak --minutes 3 --json ''   # a short smoke
    python -m bench.soak --minutes 10 --json '' --trace-memory   # where the gateway's memory grew (tracemalloc)

Set-up, all child processes on loopback: Redis (the quota store), 3 simulated engines (`kvgate sim-engine`), one
`kvgate serve` in front (cache-aware, two tenants with keys: one limited to 4 concurrent requests and 600 per
minute, Redis fail-open, stream idle timeout 5 s). Traffic: 24 closed-loop workers, seeded: streamed and whole chat,
completions, agent sessions, and clients that leave in the middle of a stream. Warm-up: traffic without faults until
the prefix index (the gateway's largest bounded table: blocks, hot window and engine-hash map per replica) is full
on every replica, at least 10% and at most 30% of the run. Then faults, one every 10-30 s (seeded):
kill -9 of an engine and its restart 5 s later on the same port; an engine answering 500 to 30% of requests, or
stalling 30% of them for 8 s, for 20 s; a Redis restart.

Checks: every request ended as a success or an honest 429 / 503 / 504 (a stream: with `[DONE]`, or an error event;
streams whose engine was killed continue on another replica: `stream_migrations` counts them;
a connection cut, an empty answer, another status or a client timeout of 120 s count as failures); after the
traffic stops, the gateway's in-flight and queue gauges return to 0; the gateway's RSS after the run against after
the warm-up (bounded tables grow until they are full: that is their design; growth past it is what a leak is).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench._procs import free_port, wait_http
from gateway.admission.config import hash_key

KEYS = {"free": "sk-free", "capped": "sk-capped"}
OK_STATUSES = {200, 429, 503, 504}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Child:
    """A restartable child process (`python -m <args>` or an executable), in its own process group."""

    def __init__(self, argv: list[str], ready_url: str | None = None) -> None:
        self.argv, self.ready_url = argv, ready_url
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        if self.ready_url:
            wait_http(self.ready_url, timeout_s=60)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def gateway_config(port: int, engines: list[str], redis_url: str) -> dict[str, Any]:
    return {
        "server": {"port": port, "access_log": "off", "metrics_access": "public"},
        "health": {"interval_s": 0.5, "timeout_s": 1.0, "metrics_interval_s": 0.5},
        "timeouts": {"first_byte_s": 10.0, "stream_idle_s": 5.0, "total_s": 60.0},
        "routing": {"policy": "cache-aware"},
        "cache": {"tokenizers": {"sim": "sim"}},
        "engines": [{"url": u} for u in engines],
        "admission": {
            "auth": True,
            "tenants": {
                "free": {"keys": [hash_key(KEYS["free"])]},
                "capped": {
                    "keys": [hash_key(KEYS["capped"])],
                    "limits": {"max_concurrency": 4, "requests_per_minute": 600},
                },
            },
            "redis": {"url": redis_url, "failure_policy": "open", "reconnect_max_s": 1.0},
        },
    }


class Outcomes:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.failures: list[str] = []

    def record(self, kind: str, detail: str | None = None) -> None:
        self.counts[kind] += 1
        if detail is not None and len(self.failures) < 50:
            self.failures.append(detail)


async def one_request(http: aiohttp.ClientSession, url: str, rng: random.Random, out: Outcomes, worker: int) -> None:
    tenant = "capped" if rng.random() < 0.3 else "free"
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    kind = rng.choice(["stream", "stream", "whole", "completion", "session", "leave"])
    stream = kind in ("stream", "session", "leave")
    system = f"system prompt {rng.randrange(8)} " * 60
    if kind == "completion":
        path, body = "/v1/completions", {"model": "sim", "prompt": system + f"q{rng.random()}", "max_tokens": 16}
    else:
        path = "/v1/chat/completions"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {rng.random()}"}]
        body = {"model": "sim", "messages": messages, "max_tokens": rng.randrange(4, 48), "stream": stream}
    if kind == "session":
        headers["x-session-id"] = f"agent-{worker}"
    try:
        async with asyncio.timeout(120):
            async with http.post(url + path, json=body, headers=headers) as resp:
                if resp.status not in OK_STATUSES:
                    out.record(f"bad-status-{resp.status}", f"{kind} {resp.status} {(await resp.text())[:200]}")
                    return
                if resp.status != 200:
                    await resp.read()
                    out.record(str(resp.status))
                    return
                if not stream:
                    data = await resp.json()
                    out.record("ok" if data.get("choices") else "empty", None if data.get("choices") else str(data))
                    return
                events, done, error = 0, False, False
                async for line in resp.content:
                    if line.startswith(b"data: [DONE]"):
                        done = True
                    elif line.startswith(b"data: ") and b'"error"' in line[:20]:
                        error = True
                    elif line.startswith(b"data: "):
                        events += 1
                        if kind == "leave" and events == 3:
                            out.record("left")  # the client goes away mid-stream
                            return
                if done:
                    out.record("ok")
                elif error:
                    out.record("stream-error-event")
                else:
                    out.record("cut-stream", f"{kind}: a stream ended after {events} events with no [DONE]/error")
    except TimeoutError:
        out.record("client-timeout", f"{kind}: no answer in 120 s")
    except aiohttp.ClientError as exc:
        out.record("connection-error", f"{kind}: {exc!r}")


async def traffic(url: str, stop: asyncio.Event, out: Outcomes, seed: int, workers: int) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def worker(w: int) -> None:
            rng = random.Random(seed * 1000 + w)
            while not stop.is_set():
                await one_request(http, url, rng, out, w)

        await asyncio.gather(*(worker(w) for w in range(workers)))


async def faults(
    engines: list[Child], urls: list[str], redis: Child, stop: asyncio.Event, seed: int, log: list[str]
) -> None:
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            try:
                async with asyncio.timeout(rng.uniform(10, 30)):
                    await stop.wait()
                return
            except TimeoutError:
                pass
            fault = rng.choice(["kill-engine", "engine-500s", "engine-stalls", "redis-restart"])
            i = rng.randrange(len(engines))
            log.append(f"{time.strftime('%H:%M:%S')} {fault} {i if 'engine' in fault else ''}")
            if fault == "kill-engine":
                engines[i].kill()
                await asyncio.sleep(5)
                await asyncio.to_thread(engines[i].start)
            elif fault == "redis-restart":
                redis.kill()
                await asyncio.sleep(3)
                await asyncio.to_thread(redis.start)
            else:
                faults_on = {"error_rate": 0.3} if fault == "engine-500s" else {"stall_rate": 0.3, "stall_s": 8.0}
                try:
                    async with http.post(f"{urls[i]}/sim/faults", json=faults_on) as resp:
                        await resp.read()
                    await asyncio.sleep(20)
                    async with http.post(f"{urls[i]}/sim/faults", json={"error_rate": 0, "stall_rate": 0}) as resp:
                        await resp.read()
                except aiohttp.ClientError:
                    pass  # the engine was being restarted


async def samples(url: str) -> list[tuple[str, float]]:
    """The gateway's /metrics as (series with its labels, value) pairs."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    pairs = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return [(series, float(value)) for series, value in pairs]


def total(series: list[tuple[str, float]], name: str) -> float:
    """The sum of a metric over its label sets."""
    return sum(v for s, v in series if s == name or s.startswith(name + "{"))


async def gauges(url: str) -> dict[str, float]:
    series = await samples(url)
    names = ("kvgate_replica_in_flight", "kvgate_queue_depth", "kvgate_tenant_concurrency")
    return {name: total(series, name) for name in names}


async def migration_counts(url: str) -> dict[str, float]:
    """kvgate_stream_migrations_total by outcome (streams whose engine failed mid-answer, resumed or not)."""
    out: dict[str, float] = {}
    for s, v in await samples(url):
        if s.startswith("kvgate_stream_migrations_total{"):
            outcome = s.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = out.get(outcome, 0.0) + v
    return out


async def warm_up(url: str, started: float, duration: float) -> dict[str, Any]:
    """Traffic without faults until the gateway's largest bounded table, the prefix index, is full on every
    replica (its memory grows until then by design), and at least 10% of the run; at most 30% of it."""
    while True:
        series = await samples(url)
        held = total(series, "kvgate_prefix_index_blocks")
        capacity = total(series, "kvgate_prefix_index_capacity_blocks")
        elapsed = time.monotonic() - started
        full = capacity > 0 and held >= capacity
        if (full and elapsed >= 0.1 * duration) or elapsed >= 0.3 * duration:
            return {"s": round(elapsed), "index_blocks": held, "index_capacity_blocks": capacity, "index_full": full}
        await asyncio.sleep(2.0)


async def snapshot(pid: int, path: Path) -> None:
    """Ask the traced gateway (bench/_tracemem.py) for a tracemalloc snapshot and wait until it is written."""
    os.kill(pid, signal.SIGUSR1)
    for _ in range(600):
        if await asyncio.to_thread(path.exists):  # written under another name, then renamed
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"no tracemalloc snapshot at {path}")


def memory_growth(before: Path, after: Path, top: int = 15) -> list[str]:
    """The allocation sites (their innermost frames) that grew most between two snapshots."""
    import tracemalloc

    keep = [tracemalloc.Filter(False, "<frozen *>"), tracemalloc.Filter(False, tracemalloc.__file__)]
    old = tracemalloc.Snapshot.load(str(before)).filter_traces(keep)
    new = tracemalloc.Snapshot.load(str(after)).filter_traces(keep)
    lines = []
    for stat in new.compare_to(old, "traceback")[:top]:
        frames = [f"{Path(f.filename).name}:{f.lineno}" for f in reversed(stat.traceback)]  # innermost first
        lines.append(f"{stat.size_diff / 1024:+.1f} KiB ({stat.count_diff:+d} blocks): {' < '.join(frames[:6])}")
    return lines


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvgate-soak-") as tmp:
        redis_port = free_port()
        redis = Child(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                       "--appendonly", "no"])  # fmt: skip
        redis.start()
        ports = [free_port() for _ in range(3)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        engines = [
            Child(
                [
                    sys.executable,
                    "-m",
                    "simengine",
                    "--port",
                    str(p),
                    "--model",
                    "sim",
                    "--seed",
                    str(i),
                    "--decode-ms",
                    "10",
                    "--prefill-us-per-token",
                    "50",
                    "--max-num-seqs",
                    "16",
                ],
                f"{u}/health",
            )
            for i, (p, u) in enumerate(zip(ports, urls, strict=True))
        ]
        for e in engines:
            e.start()
        port = free_port()
        cfg = Path(tmp) / "kvgate.yaml"
        cfg.write_text(yaml.safe_dump(gateway_config(port, urls, f"redis://127.0.0.1:{redis_port}/0")))
        url = f"http://127.0.0.1:{port}"
        serve = ["kvgate", "serve", "--config", str(cfg), "--log-level", "ERROR"]
        tracer = ["bench._tracemem", tmp] if args.trace_memory else []
        gateway = Child([sys.executable, "-m", *tracer, *serve], f"{url}/ready")
        gateway.start()
        assert gateway.proc is not None
        out, fault_log = Outcomes(), list[str]()
        stop = asyncio.Event()
        started = time.monotonic()
        duration = args.minutes * 60
        runners = [asyncio.create_task(traffic(url, stop, out, args.seed, args.workers))]
        warmup = await warm_up(url, started, duration)
        runners.append(asyncio.create_task(faults(engines, urls, redis, stop, args.seed, fault_log)))
        rss_warm = rss_mib(gateway.proc.pid)
        if args.trace_memory:
            await snapshot(gateway.proc.pid, Path(tmp) / "0.snap")
        rss_samples = [(round(time.monotonic() - started), round(rss_warm, 1))]
        while time.monotonic() - started < duration:
            await asyncio.sleep(min(30.0, duration - (time.monotonic() - started)))
            rss_samples.append((round(time.monotonic() - started), round(rss_mib(gateway.proc.pid), 1)))
            print(
                f"  {int(time.monotonic() - started):5d} s  rss {rss_samples[-1][1]} MiB  {dict(out.counts)}",
                flush=True,
            )
        stop.set()
        await asyncio.gather(*runners)
        settled: dict[str, float] = {}
        for _ in range(60):  # the gauges after the traffic, up to 30 s
            settled = await gauges(url)
            if not any(settled.values()):
                break
            await asyncio.sleep(0.5)
        rss_end = rss_mib(gateway.proc.pid)
        migrations = await migration_counts(url)
        growth: list[str] = []
        if args.trace_memory:
            await snapshot(gateway.proc.pid, Path(tmp) / "1.snap")
            growth = memory_growth(Path(tmp) / "0.snap", Path(tmp) / "1.snap")
        for child in [gateway, *engines, redis]:
            child.stop()
    total = sum(out.counts.values())
    failures = {k: v for k, v in out.counts.items() if k in ("cut-stream", "client-timeout", "connection-error",
                                                             "empty") or k.startswith("bad-status")}  # fmt: skip
    return {
        "minutes": args.minutes, "workers": args.workers, "seed": args.seed, "requests": total,
        "outcomes": dict(out.counts), "failures": failures, "failure_examples": out.failures[:20],
        "faults": fault_log, "gauges_after": settled, "stream_migrations": migrations,
        "warmup": warmup, "rss_after_warmup_mib": round(rss_warm, 1),
        "rss_end_mib": round(rss_end, 1), "rss_growth": round(rss_end / rss_warm - 1, 4) if rss_warm else None,
        "rss_samples_s_mib": rss_samples, **({"traced_growth": growth} if args.trace_memory else {}),
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--workers", type=int, default=24)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--trace-memory",
        action="store_true",
        help="run the gateway under tracemalloc and report the allocation sites that grew after the warm-up (a "
        "diagnostic: tracing changes timing and RSS)",
    )
    p.add_argument("--json", default="docs/bench/soak.json", help="where to write the result ('' = nowhere)")
    args = p.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if not result["failures"] and not any(result["gauges_after"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
