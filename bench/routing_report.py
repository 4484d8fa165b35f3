"""Markdown table, target checks and the docs update of the routing benchmark (`bench.bench_routing`).

Targets (issue 4), checked per workload from the rows of one run:
- hit: cache-aware engine hit rate >= 95% of the best possible (`best_hit_rate`), each arrival process;
- hot-prefix: cache-aware output throughput >= round-robin's (closed loop);
- zero-reuse: cache-aware throughput >= 95% of round-robin's and TTFT p50 <= 105% of it (noise allowance);
- Poisson: cache-aware TTFT p99 <= round-robin's (above it by less than round-robin's own min-max range over the
  repeats counts as equal: noise), and its p50 within 10% of the lowest p50 of the three policies.
`update_docs` replaces the text between the results markers of the docs file, keeping the hand-written notes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.bench_routing import Row as _Row
    from bench.routing_procs import SimCosts as _Costs
    from bench.routing_workloads import Workload as _Workload

BEGIN = "<!-- routing-results:begin -->"
END = "<!-- routing-results:end -->"


def _share(share: Sequence[float]) -> str:
    return " / ".join(f"{100 * s:.0f}" for s in share)


SECONDS = "(in seconds)"  # the decisions cache-aware priced in predicted seconds, beside the reasons


def _reasons(reasons: Mapping[str, int]) -> str:
    seconds = reasons.get(SECONDS, 0)
    counted = {k: v for k, v in reasons.items() if k != SECONDS}
    total = sum(counted.values()) or 1
    top = sorted(counted.items(), key=lambda kv: -kv[1])[:3]
    text = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in top)
    return f"{text}; {100 * seconds / total:.0f}% in seconds" if seconds else text


def render_markdown(
    rows: Sequence[_Row],
    ws: Sequence[_Workload],
    costs: _Costs,
    replicas: int,
    command: str,
    machine: str,
    elapsed_s: float,
    ca_params: Mapping[str, Any],
) -> str:
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {machine}; wall time {elapsed_s:.0f} s.  ",
        f"Engines: {replicas} simulated replicas (separate processes), block {costs.block_size} tokens, "
        f"max_num_seqs {costs.max_num_seqs}, prefill {costs.prefill_us_per_token:g} us/token + "
        f"{costs.overhead_ms:g} ms, decode {costs.decode_ms:g} ms + {costs.decode_ms_per_seq:g} ms x running.  ",
        f"cache-aware params: `{dict(ca_params) or 'defaults'}`; runs per row: {rows[0].repeats if rows else 1} "
        "(medians; throughput and TTFT p99 with their min-max over the runs)",
        "",
        "| workload | arrival | policy | reqs | hit | best | TTFT p50 ms | TTFT p99 ms | out tok/s | req/s "
        "| gw CPU ms/req | share % per replica | route reasons |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        fail = f" ({r.failed} failed)" if r.failed else ""
        tok_s, p99 = f"{r.out_tok_s:.0f}", f"{r.ttft_p99_ms:.0f}"
        if r.repeats > 1:
            tok_s += f" ({r.out_tok_s_range[0]:.0f}-{r.out_tok_s_range[1]:.0f})"
            p99 += f" ({r.ttft_p99_range[0]:.0f}-{r.ttft_p99_range[1]:.0f})"
        reasons = _reasons(r.reasons) if r.policy not in ("round-robin", "least-load") else ""
        lines.append(
            f"| {r.workload} | {r.arrival} | {r.policy} | {r.requests}{fail} | {100 * r.hit_rate:.1f}% "
            f"| {100 * r.best_hit_rate:.1f}% | {r.ttft_p50_ms:.0f} | {p99} | {tok_s} "
            f"| {r.req_s:.1f} | {r.gw_cpu_ms:.2f} | {_share(r.share)} | {reasons} |"
        )
    lines += ["", "Workloads:", ""]
    for w in ws:
        lines.append(
            f"- **{w.name}**: {w.about}; KV {w.num_blocks} blocks/replica; closed loop {w.concurrency} in flight, "
            f"Poisson {w.rate:g} new sessions/s."
        )
    return "\n".join(lines)


def _get(rows: Sequence[_Row], workload: str, arrival: str, policy: str) -> _Row | None:
    return next((r for r in rows if (r.workload, r.arrival, r.policy) == (workload, arrival, policy)), None)


def target_checks(rows: Sequence[_Row]) -> list[str]:
    out = ["Target checks:", ""]

    def mark(ok: bool, text: str) -> None:
        out.append(f"- {'MET' if ok else 'NOT MET'}: {text}")

    for wl in dict.fromkeys(r.workload for r in rows):
        for arrival in ("closed", "poisson", "trace"):
            ca = _get(rows, wl, arrival, "cache-aware")
            rr = _get(rows, wl, arrival, "round-robin")
            if ca is None:
                continue
            if wl != "zero-reuse" and ca.best_hit_rate > 0:
                ratio = ca.hit_rate / ca.best_hit_rate
                mark(ratio >= 0.95, f"{wl}/{arrival} hit {100 * ca.hit_rate:.1f}% = {100 * ratio:.0f}% of best "
                     f"{100 * ca.best_hit_rate:.1f}% (>= 95%)")  # fmt: skip
            if rr is None:
                continue
            if wl == "hot-prefix" and arrival == "closed":
                mark(ca.out_tok_s >= rr.out_tok_s, f"hot-prefix throughput {ca.out_tok_s:.0f} vs round-robin "
                     f"{rr.out_tok_s:.0f} tok/s (>=)")  # fmt: skip
            if wl == "zero-reuse":
                ok = ca.out_tok_s >= 0.95 * rr.out_tok_s and ca.ttft_p50_ms <= 1.05 * rr.ttft_p50_ms
                mark(ok, f"zero-reuse/{arrival} {ca.out_tok_s:.0f} vs {rr.out_tok_s:.0f} tok/s, TTFT p50 "
                     f"{ca.ttft_p50_ms:.0f} vs {rr.ttft_p50_ms:.0f} ms (no worse than round-robin, 5% "
                     "noise)")  # fmt: skip
            if arrival != "closed":  # open arrivals: the tail against round-robin's
                p50s = [r.ttft_p50_ms for r in rows if (r.workload, r.arrival) == (wl, arrival)]
                low, high = rr.ttft_p99_range
                noise = max(0.0, high - low)  # round-robin's own run-to-run spread (0 with one run)
                mark(ca.ttft_p99_ms <= rr.ttft_p99_ms + noise and ca.ttft_p50_ms <= 1.1 * min(p50s),
                     f"{wl}/{arrival} TTFT p99 {ca.ttft_p99_ms:.1f} vs round-robin {rr.ttft_p99_ms:.1f} ms (<= that "
                     f"+ its own run-to-run range, {noise:.1f} ms); p50 "
                     f"{ca.ttft_p50_ms:.0f} vs best {min(p50s):.0f} ms")  # fmt: skip
    return out


def update_docs(path: Path, block: str) -> None:
    """Replace the results block of `path` (between BEGIN and END), or create the file with it."""
    body = f"{BEGIN}\n{block}\n{END}"
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        text = head + body + tail
    else:
        text = f"# Routing benchmark\n\n{body}\n" if not text else f"{text.rstrip()}\n\n{body}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
