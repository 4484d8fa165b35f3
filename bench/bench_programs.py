"""Agent programs under overload: least attained service first against arrival order, and cold placements that
spare the agents waiting on a tool against placements by load alone.

Setup (loopback; engines and gateways are child processes, this process drives load with kvgate's load generator):
two simulated engines whose KV capacity caps the running batch (`--fit` requests of about `--prompt` + `--output`
tokens each), GPU-like costs; two gateways in front of them, identical but for what `--compare` compares:
- `order` (default): `admission.queue.order` `arrival` against `least-attained`;
- `awaited`: `cache.awaited_ttl_s` 0 (off) against its default (on): a session whose answer was a tool call is
  expected back, and cold placements are priced for evicting its blocks.
Both cache-aware, latency targets off and a gate of `--gate` requests per replica, so that overload waits in the
gateway's queue (up to `--max-wait` s) instead of being refused. Workload: agent programs (sessions) arriving as a
Poisson process at `--rate` per second, each a system prompt and a task, then tool-result turns appended to its
history one after the other (each turn sent `--tool-s` after the previous answer is in, as an agent loop runs its
tool; with `--compare awaited` every turn but the last asks for a tool call, `tool_choice: required`, so its
answer is one); a share `--long-share` of the programs run `--long-turns` turns, the rest `--short-turns`: the mix
of an agent platform where most programs are short; `--cold-share` adds a one-shot request of `--cold-tokens`
that shares nothing after that share of the programs (a chat app's or a batch job's traffic on the same pool).
Seeded; the same programs through both gateways, alternating per repeat. Reported per arm: program completion time
(first request sent to last answer in) of all programs (the average is what Autellix minimises), of the short and
of the long ones, mean and p90, and the engines' prefix hit rate on the programs' later turns (cached / prompt
tokens), medians over the repeats.

    python bench/bench_programs.py [--compare order|awaited] [--repeat 3] [--json docs/bench/programs.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
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
from loadgen.stats import percentile
from loadgen.text import CharTextMaker

MODEL = "sim"
ARMS: dict[str, dict[str, tuple[str, Any]]] = {  # --compare -> arm -> the one setting that differs: (section, value)
    "order": {"arrival": ("admission", {"order": "arrival"}), "least-attained": ("admission", {})},
    "awaited": {"off": ("cache", {"awaited_ttl_s": 0}), "on": ("cache", {})},
}


def programs(args: argparse.Namespace) -> Any:
    maker = CharTextMaker()

    def factory(seed: int) -> Iterator[RequestSpec]:
        rng = random.Random(seed)
        for p in range(args.programs):
            sid = f"prog-{seed}-{p}"
            turns = args.long_turns if rng.random() < args.long_share else args.short_turns
            for t in range(turns):
                if t == 0:
                    half = args.prompt // 2
                    msgs = (("system", maker.text("tools", half)), ("user", maker.text(sid, half)))
                else:
                    msgs = (("user", "Tool result: " + maker.text(f"{sid}-{t}", args.tool_tokens)),)
                yield RequestSpec(
                    sid, sid, t, msgs, args.output, think_s=args.tool_s if t else 0.0,
                    headers=(("x-session-id", sid),), est_prompt_tokens=args.prompt, group=turns,
                    final=t == turns - 1, tool_call=args.compare == "awaited" and t < turns - 1,
                )  # fmt: skip
            if rng.random() < args.cold_share:  # a one-shot request beside the programs: its prompt shares nothing
                doc = f"doc-{seed}-{p}"
                msgs = (("user", maker.text(doc, args.cold_tokens)),)
                yield RequestSpec(doc, doc, 0, msgs, args.output, est_prompt_tokens=args.cold_tokens, group=0)

    return factory


def gateway_yaml(arm: tuple[str, Any], args: argparse.Namespace) -> str:
    section, setting = arm
    queue = {"max_wait_s": args.max_wait, **(setting if section == "admission" else {})}
    cfg = {
        "server": {"access_log": "off", "shutdown_grace_s": 1},
        "health": {"interval_s": 0.5, "metrics_interval_s": 0.25},
        "admission": {"targets": {"enabled": False}, "replica_max_concurrency": args.gate, "queue": queue},
    }
    if section == "cache":
        cfg["cache"] = setting
    fd, path = tempfile.mkstemp(suffix=".yaml", prefix="kvgate-programs-")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def completion_times(results: list[Any], turns_of: dict[str, int]) -> dict[str, Any]:
    """Per program: first request sent to last answer in, for the programs whose every turn succeeded."""
    spans: dict[str, list[float]] = {}
    failed: set[str] = set()
    for r in results:
        if not turns_of.get(r.session_id):  # a one-shot request, not a program
            continue
        if not r.ok:
            failed.add(r.session_id)
        start, end = r.start_s, r.start_s + r.e2e_s
        lo, hi = spans.get(r.session_id, [start, end])
        spans[r.session_id] = [min(lo, start), max(hi, end)]
    later = [r for r in results if r.ok and r.turn > 0]
    prompt = sum(r.prompt_tokens for r in later)
    out: dict[str, Any] = {
        "failed_programs": len(failed),
        "later_turns_hit_rate": sum(r.cached_tokens for r in later) / prompt if prompt else None,
    }
    longest = max(turns_of.values())
    for kind, is_long in (("short", False), ("long", True), ("all", None)):
        done = (sid for sid in spans if sid not in failed and is_long in (None, turns_of[sid] == longest))
        times = [spans[sid][1] - spans[sid][0] for sid in done]
        out[kind] = {
            "programs": len(times),
            "mean_s": statistics.fmean(times) if times else None,
            "p90_s": percentile(times, 90) if times else None,
        }
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    blocks = args.fit * (args.prompt + args.output + 16) // 16
    sim = [
        "--block-size", "16", "--num-blocks", str(blocks), "--max-num-seqs", "256", "--overhead-ms", "2",
        "--prefill-us-per-token", str(args.prefill_us), "--decode-ms", str(args.decode_ms),
        "--decode-ms-per-seq", str(args.decode_ms_per_seq),
    ]  # fmt: skip
    arms = ARMS[args.compare]
    names = list(arms)
    doc: dict[str, Any] = {"settings": vars(args), "runs": {name: [] for name in names}}
    paths = [gateway_yaml(arm, args) for arm in arms.values()]
    factory = programs(args)
    try:
        with ExitStack() as es:
            engines = es.enter_context(sim_engines(2, *sim, model=MODEL))
            urls = {n: es.enter_context(kvgate(engines, "--config", p))[0] for n, p in zip(names, paths, strict=True)}
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                for repeat in range(args.repeat):
                    seed = 100 + repeat
                    turns_of = {spec.session_id: spec.group or 0 for spec in factory(seed)}
                    for name in names[repeat % 2 :] + names[: repeat % 2]:
                        for engine in engines:  # each arm starts from empty engine caches
                            async with http.post(f"{engine}/reset_prefix_cache") as resp:
                                resp.raise_for_status()
                        target = Target(urls[name], MODEL, "chat", timeout_s=300.0)
                        arrival = Arrival("poisson", rate=args.rate, max_inflight=4096)
                        res = await run_setting(http, target, factory, arrival, seed=seed)
                        row = {**completion_times(res.results, turns_of), "wall_s": res.wall_s}
                        doc["runs"][name].append(row)
                        print(f"repeat {repeat} {name}: {json.dumps(row)}", flush=True)
    finally:
        for path in paths:
            os.unlink(path)
    return doc


def table(doc: dict[str, Any]) -> str:
    lines = [
        f"| {doc['settings']['compare']} | all programs: mean / p90 s | short: mean / p90 s | long: mean / p90 s | "
        "later turns' hit rate | failed programs |",
        "|---|---|---|---|---|---|",
    ]
    for arm, rows in doc["runs"].items():

        def med(kind: str, key: str, rows: list[dict[str, Any]] = rows) -> str:
            values = [r[kind][key] for r in rows if r[kind][key] is not None]
            return f"{statistics.median(values):.1f}" if values else "-"

        failed = sum(r["failed_programs"] for r in rows)
        hits = [r["later_turns_hit_rate"] for r in rows if r.get("later_turns_hit_rate") is not None]
        hit = f"{statistics.median(hits):.3f}" if hits else "-"
        lines.append(
            f"| {arm} | {med('all', 'mean_s')} / {med('all', 'p90_s')} | {med('short', 'mean_s')} / "
            f"{med('short', 'p90_s')} | "
            f"{med('long', 'mean_s')} / {med('long', 'p90_s')} | {hit} | {failed} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--compare", choices=sorted(ARMS), default="order", help="what the two gateways differ in")
    p.add_argument("--programs", type=int, default=60)
    p.add_argument("--tool-s", type=float, default=0.0, help="seconds each tool runs before the next turn is sent")
    p.add_argument("--cold-share", type=float, default=0.0, help="one-shot requests beside the programs, per program")
    p.add_argument("--cold-tokens", type=int, default=1024, help="tokens of a one-shot request's prompt")
    p.add_argument("--short-turns", type=int, default=2)
    p.add_argument("--long-turns", type=int, default=10)
    p.add_argument("--long-share", type=float, default=0.3)
    p.add_argument("--prompt", type=int, default=512, help="first turn's tokens (system prompt and task)")
    p.add_argument("--tool-tokens", type=int, default=96, help="tokens of each tool result appended")
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--fit", type=int, default=8, help="requests whose KV fits in one engine at once")
    p.add_argument("--gate", type=int, default=4, help="requests per replica at once (the queue holds the rest)")
    p.add_argument("--max-wait", type=float, default=120.0)
    p.add_argument("--rate", type=float, default=4.0, help="new programs per second")
    p.add_argument("--prefill-us", type=float, default=100.0)
    p.add_argument("--decode-ms", type=float, default=20.0)
    p.add_argument("--decode-ms-per-seq", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    doc = asyncio.run(run(args))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc))


if __name__ == "__main__":
    main()
