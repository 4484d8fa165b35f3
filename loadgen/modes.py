"""The modes behind `kvgate loadgen`: sweep, run, quality and compare (argument parsing is in `loadgen.cli`; the
one-command capacity report, which chains sweep, run and quality, is `loadgen.capacity`).

sweep: one setting per concurrency (closed loop) or rate (gamma arrivals, Poisson by default), each with a fresh
workload (seed + 1000 * i, so settings do not reuse each other's prompts unless `--same-prompts`), metrics scraped
before and after each; then what the points say (`loadgen.knees`): the knee and the recommended per-replica gate,
optionally written to a config; with `--slo` the goodput knee, with `--plan` the prediction beside the
measurement. run: one setting for N requests or a duration. quality: `loadgen.quality` checks. compare:
side-by-side of result files. Every mode prints the table, and with `--out DIR` writes result.json, charts and
report.html.
Warm-up (`--warmup N`): before each setting, N requests of the same arrival from another seed (so they do not
pre-cache the measured prompts), sent before the metrics are scraped and left out of every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from loadgen import knees, predicted
from loadgen import workloads as wl
from loadgen.client import RequestSpec, Target, fetch_model
from loadgen.datasets import DatasetWorkload, load_dataset
from loadgen.gatecfg import GateConfigError, write_gate
from loadgen.promscrape import prefix_cache_report, replica_load, scrape_all
from loadgen.quality import run_quality
from loadgen.report import Doc, format_compare, format_table, write_charts, write_html, write_json
from loadgen.runner import Arrival, Progress, SettingResult, Tenant, WorkloadFactory, run_setting
from loadgen.stats import (
    Slo,
    percentile,
    summarize,
)
from loadgen.text import TextMaker, make_text_maker

FORMAT = "kvgate-loadgen/1"
WARMUP_SEED = 777_777  # offset of the warm-up requests' seed from the setting's


def build_factory(args: argparse.Namespace, maker: TextMaker) -> WorkloadFactory:
    name = args.workload
    records: list[wl.TraceRecord] = []
    if name == "trace":
        if not args.trace:
            raise ValueError("--workload trace needs --trace FILE")
        with open(args.trace) as fh:
            records = wl.parse_mooncake_trace(fh)

    if name in ("sharegpt", "jsonl"):
        if not args.dataset:
            raise ValueError(f"--workload {name} needs --dataset FILE")
        data = DatasetWorkload(
            maker, load_dataset(name, args.dataset), max_turns=args.dataset_turns,
            default_output_len=args.output_len, max_input_tokens=args.max_input_len,
            max_output_tokens=args.max_output_len,
        )  # fmt: skip
        return data.specs

    def factory(seed: int) -> Iterator[RequestSpec]:
        if name == "shared-prefix":
            return wl.shared_prefix(
                maker, seed=seed, groups=args.groups, prompts_per_group=args.prompts_per_group,
                system_tokens=args.system_len, question_tokens=args.question_len, output_tokens=args.output_len,
                popularity=args.popularity, zipf_s=args.zipf_s,
            )  # fmt: skip
        if name == "multi-round":
            return wl.multi_round_chat(
                maker, seed=seed, users=args.users, rounds=args.rounds, system_tokens=args.system_len,
                question_tokens=args.question_len, answer_tokens=args.output_len, think_s=args.think_s,
            )  # fmt: skip
        if name == "agent":
            return wl.agent_sessions(
                maker, seed=seed, sessions=args.sessions, turns=args.turns, system_tokens=args.system_len,
                task_tokens=args.question_len, tool_result_tokens=args.tool_result_len,
                output_tokens=args.output_len, pause_s=args.pause_s, subagents=args.subagents,
            )  # fmt: skip
        if name == "random":
            return wl.random_requests(
                maker, seed=seed, num_requests=args.num_requests or 64, input_tokens=tuple(args.input_len),
                output_tokens=tuple(args.random_output_len),
            )  # fmt: skip
        return wl.trace_replay(
            maker, records, seed=seed, block_tokens=args.trace_block_tokens, time_scale=args.time_scale,
            max_input_tokens=args.max_input_len, max_output_tokens=args.max_output_len,
        )  # fmt: skip

    next(factory(args.seed), None)  # generators are lazy: validate the parameters now, not mid-run
    return factory


def make_target(args: argparse.Namespace, model: str) -> Target:
    return Target(
        base_url=args.url,
        model=model,
        endpoint=args.endpoint,
        timeout_s=args.timeout,
        ignore_eos=not args.no_ignore_eos,
    )


def _auth(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def resolve_model(http: aiohttp.ClientSession, args: argparse.Namespace) -> str:
    """`--model`, else the first model the target lists, asked with `--api-key` or else the first tenant's key."""
    if args.model:
        return str(args.model)
    headers = _auth(args)
    if not headers and (tenants := getattr(args, "tenant", None)):
        headers = {"Authorization": f"Bearer {tenants[0].key}"}
    return await fetch_model(http, args.url, headers)


def _tenants(args: argparse.Namespace) -> list[Tenant]:
    return list(args.tenant or [])


def _per_tenant(setting: SettingResult, slo: Slo | None) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[Any]] = {}
    for r in setting.results:
        groups.setdefault(r.tenant or "-", []).append(r)
    out = {}
    for label, rs in sorted(groups.items()):
        s = summarize(rs, setting.wall_s, slo)
        out[label] = {"requests": s.requests, "succeeded": s.succeeded, "ttft_p50_s": s.ttft_s["p50"],
                      "output_tok_per_s": s.output_tok_per_s, "slo_attainment": s.slo_attainment}  # fmt: skip
    return out


def _progress(
    args: argparse.Namespace, factory: WorkloadFactory, seed: int, label: str, duration: float | None
) -> Progress:
    enabled = bool(args.progress or sys.stderr.isatty())
    total = args.num_requests
    if enabled and duration is None and sys.stderr.isatty():  # the bar's length: the workload, counted up front
        count = sum(1 for _ in factory(seed))
        total = count if total is None else min(total, count)
    return Progress(enabled, label, total=total, duration_s=duration)


async def run_point(
    http: aiohttp.ClientSession, target: Target, factory: WorkloadFactory, arrival: Arrival,
    args: argparse.Namespace, seed: int, label: str, duration_s: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One setting (after its warm-up), with metrics scraped before and after; returns the point's JSON."""
    urls = list(args.metrics_url or [])
    kwargs: dict[str, Any] = {"tenants": _tenants(args), "api_key": args.api_key}
    if args.warmup:
        await run_setting(http, target, factory, arrival, seed=seed + WARMUP_SEED, max_requests=args.warmup, **kwargs)
    before = await scrape_all(http, urls) if urls else []
    setting = await run_setting(
        http, target, factory, arrival, seed=seed, max_requests=args.num_requests,
        duration_s=duration_s, progress=_progress(args, factory, seed, label, duration_s), **kwargs,
    )  # fmt: skip
    after = await scrape_all(http, urls) if urls else []
    summary = summarize(setting.results, setting.wall_s, args.slo)
    gaps = [g for r in setting.results if r.ok for g in r.itl_s]
    return {
        "load": arrival.load,
        "arrival": arrival.mode,
        "concurrency": arrival.concurrency if arrival.mode == "closed" else None,
        "rate": arrival.rate if arrival.mode == "poisson" else None,
        "burstiness": arrival.burstiness if arrival.mode == "poisson" else None,
        "seed": seed,
        "warmup_requests": args.warmup,
        "started_at": setting.started_at,
        "summary": summary.to_json(),
        "verdict": None,
        "replica_load": replica_load(r.replica for r in setting.results),
        "tenants": _per_tenant(setting, args.slo),
        "prefix_cache": prefix_cache_report(before, after) if urls else None,
        "itl_cdf_s": [percentile(gaps, q) for q in range(101)] if gaps else [],  # p0..p100 of the gaps
        "requests": [r.to_json() for r in setting.results],
    }


def _new_doc(args: argparse.Namespace, mode: str, target: Target | None) -> Doc:
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "tenant", "func")}
    return {
        "format": FORMAT,
        "mode": mode,
        "label": args.label or mode,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "description": f"{mode} of workload {getattr(args, 'workload', '-')} against {getattr(args, 'url', '-')}",
        "target": {"url": target.url, "model": target.model, "endpoint": target.endpoint} if target else None,
        "tenants": [{"tenant": t.label, "weight": t.weight} for t in _tenants(args)],
        "config": json.loads(json.dumps(config, default=str)),
        "arrival": "closed",
        "points": [],
        "knee": None,
        "recommendation": None,
        "goodput": None,
        "plan": None,
        "quality": None,
    }


def _finish(doc: Doc, args: argparse.Namespace) -> None:
    print(format_table(doc))
    if not args.out:
        return
    out = Path(args.out)
    path = write_json(doc, out)
    charts: list[Path] = []
    if not args.no_charts and doc["points"]:
        charts = write_charts([(doc["label"], doc)], out)
    write_html([(doc["label"], doc)], charts, out / "report.html", f"kvgate loadgen {doc['mode']}: {doc['label']}")
    print(f"wrote {path}, {out / 'report.html'}" + (f" and {len(charts)} charts" if charts else ""))


async def _plan_source(
    http: aiohttp.ClientSession, args: argparse.Namespace
) -> tuple[int, float, Any] | list[predicted.Capacity] | None:
    """What `--plan` predicts from, read and checked before any load is sent: a bad plan file, or engines that report
    no KV capacity, must not cost a whole sweep thrown away after it (ValueError: exit 2)."""
    if not args.plan:
        return None
    if args.plan != "auto":
        return predicted.read_plan_file(args.plan)
    if not args.metrics_url:
        raise ValueError("--plan auto reads the engines' KV capacity: give --metrics-url (kvgate's or the engines')")
    return await predicted.scrape_capacities(http, args.metrics_url)


async def sweep_doc(http: aiohttp.ClientSession, args: argparse.Namespace, target: Target) -> tuple[Doc, int | None]:
    """The sweep's document (points, knee, goodput, plan) and the gate to write (None: no knee found)."""
    factory = build_factory(args, make_text_maker(args.tokenizer))
    plan_source = await _plan_source(http, args)
    by_rate = bool(args.rates)
    doc = _new_doc(args, "sweep", target)
    doc["arrival"] = "poisson" if by_rate else "closed"
    loads = sorted(args.rates or args.concurrencies)
    try:
        for i, load in enumerate(loads):
            if by_rate:
                arrival = Arrival("poisson", rate=load, burstiness=args.burstiness)
            else:
                arrival = Arrival("closed", concurrency=int(load))
            seed = args.seed if args.same_prompts else args.seed + 1000 * i
            doc["points"].append(await run_point(http, target, factory, arrival, args, seed, f"{load:g}"))
    except asyncio.CancelledError:  # Ctrl-C: the settings that finished are kept, with no knee (it needs them all)
        if doc["points"]:
            doc["interrupted"] = f"after {len(doc['points'])} of {len(loads)} settings: no knee, gate or plan"
            print(f"kvgate loadgen: interrupted {doc['interrupted']}", file=sys.stderr)
            _finish(doc, args)
        raise
    gate = knees.apply_goodput(doc, args, knees.apply_knee(doc, args, by_rate))
    if plan_source is not None:
        knees.plan_beside(doc, args, plan_source)
    return doc, gate


def unreachable(args: argparse.Namespace, rows: list[dict[str, Any]]) -> bool:
    """Every request failed to connect (says so on stderr): the URL is down or wrong, not the load too high; the
    same exit status and message as when resolving the model found it so (cli)."""
    if not rows or any(r["ok"] or r["error_type"] != "connection" for r in rows):
        return False
    print(f"kvgate loadgen: cannot reach {args.url}: {rows[0]['error']}", file=sys.stderr)
    return True


def nothing_succeeded(args: argparse.Namespace, doc: Doc) -> bool:
    """No request of any point succeeded: says why on stderr (the URL unreachable, else the errors by kind)."""
    if any(p["summary"]["succeeded"] for p in doc["points"]):
        return False
    if not unreachable(args, [r for p in doc["points"] for r in p["requests"]]):
        errors: dict[str, int] = {}
        for p in doc["points"]:
            for kind, n in p["summary"]["errors"].items():
                errors[kind] = errors.get(kind, 0) + n
        listed = ", ".join(f"{kind} x{n}" for kind, n in sorted(errors.items())) or "none sent"
        print(f"kvgate loadgen: no request succeeded ({listed})", file=sys.stderr)
    return True


def write_gate_from(args: argparse.Namespace, gate: int | None) -> int:
    """`--write-gate`: 0 written or nothing to do, 1 the file could not be written."""
    if not args.write_gate:
        return 0
    if gate is None:
        print(f"no knee found: {args.write_gate} left unchanged", file=sys.stderr)
        return 0
    try:
        write_gate(args.write_gate, gate)
    except (GateConfigError, OSError) as exc:
        print(f"cannot write the gate: {exc}", file=sys.stderr)
        return 1
    print(f"set admission.replica_max_concurrency: {gate} in {args.write_gate}")
    return 0


async def sweep(args: argparse.Namespace) -> int:
    async with aiohttp.ClientSession() as http:
        doc, gate = await sweep_doc(http, args, make_target(args, await resolve_model(http, args)))
    _finish(doc, args)
    if nothing_succeeded(args, doc) or write_gate_from(args, gate):
        return 1
    return 0


def run_arrival(args: argparse.Namespace) -> Arrival:
    if args.rate:
        return Arrival("poisson", rate=args.rate, burstiness=args.burstiness, max_inflight=args.max_inflight)
    if args.trace_arrival:
        return Arrival("trace", max_inflight=args.max_inflight)
    return Arrival("closed", concurrency=args.concurrency)


async def run_doc(http: aiohttp.ClientSession, args: argparse.Namespace, target: Target, arrival: Arrival) -> Doc:
    factory = build_factory(args, make_text_maker(args.tokenizer))
    doc = _new_doc(args, "run", target)
    doc["arrival"] = arrival.mode
    doc["points"].append(await run_point(http, target, factory, arrival, args, args.seed, "run", args.duration))
    return doc


async def run(args: argparse.Namespace) -> int:
    async with aiohttp.ClientSession() as http:
        doc = await run_doc(http, args, make_target(args, await resolve_model(http, args)), run_arrival(args))
    _finish(doc, args)
    return 1 if nothing_succeeded(args, doc) else 0


async def quality_doc(http: aiohttp.ClientSession, args: argparse.Namespace, target: Target) -> Doc:
    checks = await run_quality(
        http, target, make_text_maker(args.tokenizer), headers=_auth(args), long_input_tokens=args.long_input,
        long_output_tokens=args.long_output, identical=args.identical, seed=args.seed,
    )  # fmt: skip
    doc = _new_doc(args, "quality", target)
    doc["quality"] = [c.to_json() for c in checks]
    return doc


async def quality(args: argparse.Namespace) -> int:
    async with aiohttp.ClientSession() as http:
        doc = await quality_doc(http, args, make_target(args, await resolve_model(http, args)))
    for c in doc["quality"]:
        print(f"{'PASS' if c['passed'] else 'FAIL'}  {c['name']:<20} {c['detail']}")
    unreachable(args, [c["figures"] for c in doc["quality"] if "error_type" in c["figures"]])
    if args.out:
        out = Path(args.out)
        write_json(doc, out)
        write_html([(doc["label"], doc)], [], out / "report.html", "kvgate loadgen quality")
    return 0 if all(c["passed"] for c in doc["quality"]) else 1


def compare(args: argparse.Namespace) -> int:
    docs: list[tuple[str, Doc]] = []
    labels = list(args.labels or [])
    for i, name in enumerate(args.files):
        try:
            doc = json.loads(Path(name).read_text())
        except (OSError, ValueError) as exc:
            print(f"cannot read {name}: {exc}", file=sys.stderr)
            return 2
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            print(f"{name} is not a kvgate loadgen result", file=sys.stderr)
            return 2
        label = labels[i] if i < len(labels) else str(doc.get("label") or Path(name).parent.name)
        if doc.get("mode") == "report":  # a capacity report: its sweep is what compares with other sweeps
            doc = doc["sweep"]
        docs.append((label, doc))
    print(format_compare(docs))
    if args.out:
        out = Path(args.out)
        charts = [] if args.no_charts else write_charts(docs, out, prefix="compare_")
        write_html(docs, charts, out / "compare.html", "kvgate loadgen comparison")
        print(f"wrote {out / 'compare.html'}")
    return 0
