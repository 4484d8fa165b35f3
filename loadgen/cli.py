"""`kvgate loadgen {sweep,run,quality,report,compare}`: argument parsing only; the modes live in `loadgen.modes`
and `loadgen.capacity` (report).

Examples:
  kvgate loadgen sweep --url http://127.0.0.1:8000 --workload shared-prefix --concurrencies 1,2,4,8,16 \\
      --metrics-url http://127.0.0.1:8000/metrics --out results/rr --write-gate kvgate.yaml
  kvgate loadgen run --url http://127.0.0.1:8000 --workload multi-round --concurrency 8 --duration 60
  kvgate loadgen quality --url http://127.0.0.1:8001 --tokenizer models/tiny
  kvgate loadgen report --url http://127.0.0.1:8000 --workload sharegpt --dataset sharegpt.json \\
      --slo ttft=500ms,tpot=50ms --plan auto --metrics-url http://127.0.0.1:8000/metrics --duration 60 --out rep
  kvgate loadgen compare results/rr/result.json results/cache/result.json --out results/cmp
Exit status: 0 done, 1 nothing succeeded (an unreachable URL included, with or without --model) / a quality check
failed / the gate could not be written, 2 bad usage (including an unreadable dataset, trace or plan file, and a
--plan auto whose metrics pages report no KV capacity: both checked before any load is sent), 130 interrupted
(Ctrl-C; a sweep writes the settings that finished, with no knee, gate or plan comparison).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import aiohttp

from loadgen import capacity, modes
from loadgen.runner import parse_tenant
from loadgen.stats import Slo, parse_slo


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return vals


def _ints(text: str) -> list[int]:
    vals = _floats(text)
    if any(v != int(v) for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return [int(v) for v in vals]


def _positive_int(text: str) -> int:
    vals = _ints(text)
    if len(vals) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return vals[0]


def _positive(text: str) -> float:
    vals = _floats(text)
    if len(vals) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive number, got {text!r}")
    return vals[0]


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from exc
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return a, b


def _tenant(text: str) -> object:
    try:
        return parse_tenant(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _slo(text: str) -> Slo:
    try:
        return parse_slo(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--url", required=True, help="base URL of the OpenAI-compatible server (no /v1)")
    g.add_argument("--model", help="model name (default: the first of /v1/models)")
    g.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    g.add_argument("--api-key", help="bearer key when no --tenant is given")
    g.add_argument("--tenant", action="append", type=_tenant, metavar="KEY:WEIGHT", help="repeatable tenant mix")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    g.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (lengths then vary)")
    g.add_argument("--tokenizer", metavar="DIR", help="HF tokenizer dir: lengths in model tokens (else 4 chars)")
    g.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="DIR", help="write DIR/result.json, charts and DIR/report.html")
    o.add_argument("--label", help="name of this run in reports and comparisons")
    o.add_argument("--progress", action="store_true", help="live progress line even when stderr is not a TTY")
    o.add_argument("--no-charts", action="store_true")
    o.add_argument("--metrics-url", action="append", help="Prometheus /metrics URL scraped before and after")


def _workload(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (lengths in tokens)")
    g.add_argument("--workload", default="shared-prefix", choices=(
        "shared-prefix", "multi-round", "agent", "random", "trace", "sharegpt", "jsonl"))  # fmt: skip
    g.add_argument("--dataset", metavar="FILE", help="sharegpt: ShareGPT JSON; jsonl: one prompt per line")
    g.add_argument("--dataset-turns", type=int, default=1, help="sharegpt: user turns per conversation")
    g.add_argument(
        "--num-requests", "-n", type=_positive_int, help="cap on requests per setting (random: its count, 64)"
    )
    g.add_argument("--system-len", type=int, default=512, help="shared system prompt")
    g.add_argument("--question-len", type=int, default=64, help="question / agent task")
    g.add_argument("--output-len", type=int, default=64, help="max_tokens (answer length; datasets: when absent)")
    g.add_argument("--groups", type=int, default=8, help="shared-prefix: system prompts")
    g.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix")
    g.add_argument("--popularity", choices=("uniform", "zipf"), default="uniform", help="shared-prefix")
    g.add_argument("--zipf-s", type=float, default=1.1, help="shared-prefix zipf exponent")
    g.add_argument("--users", type=int, default=8, help="multi-round: sessions")
    g.add_argument("--rounds", type=int, default=4, help="multi-round: turns per session")
    g.add_argument("--think-s", type=float, default=0.0, help="multi-round: pause between turns")
    g.add_argument("--sessions", type=int, default=4, help="agent: sessions")
    g.add_argument("--turns", type=int, default=8, help="agent: turns per session")
    g.add_argument("--tool-result-len", type=int, default=128, help="agent: tool result per turn")
    g.add_argument("--pause-s", type=float, default=0.0, help="agent: pause between turns")
    g.add_argument(
        "--subagents", type=int, default=0, help="agent: sub-agent conversations per session, under its session header"
    )
    g.add_argument("--input-len", type=_range, default=(128, 512), metavar="MIN:MAX", help="random")
    g.add_argument("--random-output-len", type=_range, default=(32, 128), metavar="MIN:MAX", help="random")
    g.add_argument("--trace", metavar="FILE", help="trace: Mooncake JSONL")
    g.add_argument("--trace-block-tokens", type=int, default=512, help="trace: tokens per hash id")
    g.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply arrival offsets")
    g.add_argument("--max-input-len", type=int, help="trace: clamp input lengths; datasets: skip longer prompts")
    g.add_argument("--max-output-len", type=int, help="trace and datasets: clamp output lengths")
    m = p.add_argument_group("measurement")
    m.add_argument("--warmup", type=int, default=0, metavar="N", help="requests before each setting, not counted")
    m.add_argument("--slo", type=_slo, metavar="ttft=500ms,tpot=50ms,e2e=4s", help="goodput: requests within")
    m.add_argument("--burstiness", type=float, default=1.0, help="rate arrivals: gamma shape (1 = Poisson)")


def _sweep_options(sw: argparse.ArgumentParser) -> None:
    loads = sw.add_mutually_exclusive_group()
    loads.add_argument("--concurrencies", type=_ints, default=[1, 2, 4, 8, 16], metavar="C1,C2,...")
    loads.add_argument("--rates", type=_floats, metavar="R1,R2,...", help="arrival rates (req/s) instead")
    sw.add_argument("--same-prompts", action="store_true", help="every setting reuses the same prompts")
    sw.add_argument("--replicas", type=int, help="replicas behind the URL (default: distinct x-kvgate-replica)")
    sw.add_argument("--write-gate", metavar="CONFIG.yaml", help="set admission.replica_max_concurrency there")
    sw.add_argument("--knee-ttft-factor", type=float, default=3.0, help="knee: TTFT p50 rise over baseline")
    sw.add_argument("--knee-min-gain", type=float, default=0.10, help="knee: throughput gain deemed flat")
    sw.add_argument("--min-success", type=float, default=0.99, help="knee: success rate below = saturated")
    sw.add_argument("--slo-attainment", type=float, default=0.9, help="goodput knee: share of requests within SLO")
    sw.add_argument(
        "--plan",
        metavar="PLAN.json|auto",
        help="predicted knee beside the measured: `kvgate plan --json` output, or auto (engines' KV)",
    )


def _quality_options(q: argparse.ArgumentParser) -> None:
    q.add_argument("--long-input", type=int, default=1500, help="long-context prompt tokens")
    q.add_argument("--long-output", type=int, default=512, help="long generation max_tokens")
    q.add_argument("--identical", type=int, default=4, help="concurrent identical prompts")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate loadgen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="mode", required=True)

    sw = sub.add_parser("sweep", help="capacity table over concurrencies or rates, knee and gate")
    _common(sw)
    _workload(sw)
    _sweep_options(sw)

    rn = sub.add_parser("run", help="one sustained setting")
    _common(rn)
    _workload(rn)
    arr = rn.add_mutually_exclusive_group()
    arr.add_argument("--concurrency", "-c", type=_positive_int, default=8, help="closed loop (default)")
    arr.add_argument("--rate", type=_positive, help="open loop: arrivals per second (see --burstiness)")
    arr.add_argument("--trace-arrival", action="store_true", help="open loop at the trace's timestamps")
    rn.add_argument("--duration", type=_positive, help="seconds (the workload repeats with new seeds)")
    rn.add_argument("--max-inflight", type=_positive_int, default=1024, help="open loop: cap on requests in flight")

    q = sub.add_parser("quality", help="checks for a real model")
    _common(q)
    _quality_options(q)

    rp = sub.add_parser("report", help="sweep + sustained run at the knee + quality checks: one capacity report")
    _common(rp)
    _workload(rp)
    _sweep_options(rp)
    _quality_options(rp)
    rp.add_argument("--duration", type=_positive, default=60.0, help="sustained run at the knee, seconds")
    rp.add_argument("--max-inflight", type=_positive_int, default=1024, help="open loop: cap on requests in flight")
    rp.add_argument("--no-quality", action="store_true", help="skip the quality checks")

    c = sub.add_parser("compare", help="side by side of result.json files (of a report: its sweep)")
    c.add_argument("files", nargs="+", metavar="RESULT.json")
    c.add_argument("--labels", type=lambda s: s.split(","), help="comma-separated names, one per file")
    c.add_argument("--out", metavar="DIR", help="write DIR/compare.html and charts")
    c.add_argument("--no-charts", action="store_true")
    return parser


async def _dispatch(args: argparse.Namespace) -> int:
    try:
        if args.mode == "sweep":
            return await modes.sweep(args)
        if args.mode == "run":
            return await modes.run(args)
        if args.mode == "quality":
            return await modes.quality(args)
        if args.mode == "report":
            return await capacity.report(args)
        return modes.compare(args)
    except (aiohttp.ClientConnectionError, TimeoutError) as exc:  # the server, not the usage: as when --model skips
        print(f"kvgate loadgen: cannot reach {args.url}: {exc}", file=sys.stderr)  # asking it for its models
        return 1
    except (ValueError, OSError, aiohttp.ClientError) as exc:  # TraceError and DatasetError are ValueErrors
        print(f"kvgate loadgen: {exc}", file=sys.stderr)
        return 2


async def amain(argv: list[str]) -> int:
    """The CLI for callers already inside an event loop (argparse usage errors raise SystemExit)."""
    return await _dispatch(build_parser().parse_args(argv))


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    if args.mode == "compare":  # no event loop needed
        return modes.compare(args)
    try:
        return asyncio.run(_dispatch(args))
    except KeyboardInterrupt:
        return 130
