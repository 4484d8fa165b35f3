"""`kvgate loadgen report`: one command, one capacity report: a sweep, a sustained run at its knee, the quality checks.

Steps: (1) the sweep of `loadgen sweep` (verdicts, knee, recommended gate; the goodput knee with `--slo`; the
plan beside the measurement with `--plan`); (2) a sustained run of `--duration` seconds at the knee (closed loop
at the knee concurrency, or open loop at the knee rate; with `--slo`, at the goodput knee where it is the lower)
on new prompts (seed + 1; `--num-requests` caps only the sweep's settings); its output throughput in windows of
time (10 s, shorter for runs under a minute: at least six) over the time requests were sent (not the drain after
it) says whether the knee holds over time: *steady* when every full window is within 20 % of the windows' mean,
and that mean is the sustained throughput (`sustained_windows`); (3) the quality checks (`--no-quality` skips
them).
Output: the tables on the terminal, and with `--out DIR` one result.json holding the three documents and one
self-contained report.html (headline, the three sections, charts embedded). Exit status 1 when no request of
the sweep succeeded, a quality check failed, or the gate could not be written.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from loadgen import modes
from loadgen.report import Doc, format_table, write_charts, write_html
from loadgen.runner import Arrival

STEADY_SPREAD = 0.20  # every full window within 20 % of the mean


def sustained_windows(rows: Sequence[dict[str, Any]], wall_s: float, window_s: float = 10.0) -> dict[str, Any]:
    """Output tokens per second in each full window of the run (requests rows of one setting): each successful
    request's completion tokens are spread evenly over its streaming time (first token to last), so a window counts
    what was generated in it, not which requests happened to finish in it. O(requests x windows spanned)."""
    n = int(wall_s // window_s)
    tokens = [0.0] * n
    for r in rows:
        if not r["ok"] or not r["completion_tokens"]:
            continue
        a = r["start_s"] + (r["ttft_s"] if r["ttft_s"] is not None else r["e2e_s"])
        b = r["start_s"] + r["e2e_s"]
        if b - a <= 0:
            w = int(b // window_s)
            if w < n:
                tokens[w] += r["completion_tokens"]
            continue
        for w in range(int(a // window_s), min(n, int(b // window_s) + 1)):
            overlap = min(b, (w + 1) * window_s) - max(a, w * window_s)
            tokens[w] += r["completion_tokens"] * max(0.0, overlap) / (b - a)
    rates = [t / window_s for t in tokens]
    mean = sum(rates) / n if n else 0.0
    spread = max(abs(x - mean) for x in rates) / mean if n and mean > 0 else None
    return {"window_s": window_s, "tok_per_s": rates, "mean_tok_per_s": mean, "max_deviation": spread,
            "steady": spread is not None and spread <= STEADY_SPREAD}  # fmt: skip


def _headline(sweep: Doc, run: Doc, quality: Doc | None) -> list[str]:
    lines = [sweep["recommendation"]["text"]]
    for key in ("goodput", "plan"):
        if sweep.get(key):
            lines.append(sweep[key]["text"])
    s = run["points"][0]["summary"]
    w = run["sustained"]
    dev = "-" if w["max_deviation"] is None else f"{w['max_deviation'] * 100:.0f} %"
    rate = w["mean_tok_per_s"] if w["tok_per_s"] else s["output_tok_per_s"]  # over the sending time
    lines.append(
        f"sustained at {run['points'][0]['load']:g} for {s['wall_s']:.0f} s: {rate:.1f} tok/s, "
        f"TTFT p99 {(s['ttft_s']['p99'] or 0) * 1e3:.0f} ms, {s['success_rate'] * 100:.1f} % ok; "
        f"{'steady' if w['steady'] else 'NOT steady'} ({w['window_s']:g} s windows, max deviation {dev})"
    )
    if quality is not None:
        passed = sum(c["passed"] for c in quality["quality"])
        lines.append(f"quality: {passed} of {len(quality['quality'])} checks passed")
    return lines


def _write(out: Path, args: argparse.Namespace, docs: list[tuple[str, Doc]], headline: list[str], title: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    parts = dict(zip(("sweep", "sustained", "quality"), (d for _, d in docs), strict=False))
    doc = {"format": modes.FORMAT, "mode": "report", "label": args.label or "report", **parts, "headline": headline}
    (out / "result.json").write_text(json.dumps(doc, indent=1, allow_nan=False))
    charts = [] if args.no_charts else write_charts(docs[:1], out)
    write_html(docs, charts, out / "report.html", title, headline=headline)
    print(f"wrote {out / 'result.json'} and {out / 'report.html'}")


async def report(args: argparse.Namespace) -> int:
    async with aiohttp.ClientSession() as http:
        target = modes.make_target(args, await modes.resolve_model(http, args))
        sweep, gate = await modes.sweep_doc(http, args, target)
        if modes.nothing_succeeded(args, sweep):  # no sustained run or quality checks against what cannot serve
            print(format_table(sweep))
            return 1
        knee = sweep["recommendation"]["load"] or sweep["knee"]["load"]  # with --slo, the SLO's where it is lower
        by_rate = sweep["arrival"] == "poisson"
        arrival = Arrival("poisson", rate=knee, burstiness=args.burstiness, max_inflight=args.max_inflight) \
            if by_rate else Arrival("closed", concurrency=int(knee))  # fmt: skip
        run_args = argparse.Namespace(**{**vars(args), "seed": args.seed + 1, "num_requests": None})  # timed only
        run = await modes.run_doc(http, run_args, target, arrival)
        run["label"] = f"sustained at the knee ({knee:g})"
        window = min(10.0, max(0.5, args.duration / 6))  # at least six windows in a short run
        point = run["points"][0]
        # the windows of the sending time only: the drain after it (requests finishing, none sent) is no load
        sending_s = min(point["summary"]["wall_s"], args.duration)
        run["sustained"] = sustained_windows(point["requests"], sending_s, window)
        quality = None if args.no_quality else await modes.quality_doc(http, args, target)
    sweep["label"] = f"sweep: {sweep['label']}"
    docs: list[tuple[str, Doc]] = [(sweep["label"], sweep), (run["label"], run)]
    if quality is not None:
        quality["label"] = "quality checks"
        docs.append((quality["label"], quality))
    headline = _headline(sweep, run, quality)
    print(format_table(sweep))
    print(format_table(run))
    print("\n".join(headline))
    if args.out:
        _write(Path(args.out), args, docs, headline, f"kvgate capacity report: {target.model} at {target.base_url}")
    failed = modes.write_gate_from(args, gate)
    if quality is not None and not all(c["passed"] for c in quality["quality"]):
        failed = 1
    return 1 if failed or all(p["summary"]["succeeded"] == 0 for p in sweep["points"]) else 0
