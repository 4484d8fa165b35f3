"""Medians over several `bench/vllm_sweep.sh` runs: per concurrency, output tok/s, TTFT p50 and cached fraction of
cache-aware and round-robin, each run's values beside them, and the ratio of the medians.

    python -m bench.sweep_medians --out docs/loadgen/medians.json DIR [DIR ...]   # DIR holds cache-aware/ round-robin/
    python -m bench.sweep_medians --against fixed DIR [DIR ...]   # a VARIANTS label of vllm_sweep.sh instead
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def points(run_dir: Path, policy: str) -> dict[int, dict[str, float]]:
    data = json.loads((run_dir / policy / "result.json").read_text())
    out = {}
    for p in data["points"]:
        s = p["summary"]
        ttft = s["ttft_s"].get("p50") if isinstance(s["ttft_s"], dict) else None
        out[int(p["concurrency"])] = {
            "tok_s": float(s["output_tok_per_s"]),
            "ttft_p50_ms": 1e3 * float(ttft) if ttft is not None else float("nan"),
            "cached": float(s["cached_fraction"] or 0.0),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--against", default="cache-aware", help="the label compared with round-robin")
    args = ap.parse_args(argv)
    policies = (args.against, "round-robin")
    runs = {policy: [points(d, policy) for d in args.dirs] for policy in policies}
    concurrencies = sorted(set.intersection(*(set(r) for rs in runs.values() for r in rs)))
    rows: list[dict[str, Any]] = []
    print(f"| concurrency | {args.against} tok/s (runs) | round-robin tok/s (runs) | ratio of medians | TTFT p50 |")
    print("|---:|---|---|---:|---|")
    for c in concurrencies:
        row: dict[str, Any] = {"concurrency": c}
        for policy in policies:
            values = [r[c] for r in runs[policy]]
            row[policy] = {k: statistics.median(v[k] for v in values) for k in values[0]}
            row[policy]["runs_tok_s"] = [v["tok_s"] for v in values]
        ca, rr = row[args.against], row["round-robin"]
        row["ratio"] = ca["tok_s"] / rr["tok_s"] if rr["tok_s"] else None
        rows.append(row)
        fmt = ", ".join
        print(
            f"| {c} | {ca['tok_s']:.1f} ({fmt(f'{x:.0f}' for x in ca['runs_tok_s'])}) "
            f"| {rr['tok_s']:.1f} ({fmt(f'{x:.0f}' for x in rr['runs_tok_s'])}) | {row['ratio']:.2f} "
            f"| {ca['ttft_p50_ms']:.0f} / {rr['ttft_p50_ms']:.0f} ms |"
        )
    if args.out:
        args.out.write_text(json.dumps({"runs": [str(d) for d in args.dirs], "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
