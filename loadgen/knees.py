"""What a sweep's points say, written into its document: the knee by the knee rule and the recommended per-replica
gate (`loadgen.stats`); with `--slo` the goodput knee, each point's verdict against it, and the recommendation moved
down to it where the SLO is missed below the throughput knee; with `--plan` the prediction beside the measurement
(`loadgen.predicted`). Pure functions of the document and the arguments: O(points).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict
from typing import Any

from loadgen import predicted
from loadgen.report import Doc
from loadgen.stats import (
    Knee,
    KneeRule,
    SweepPoint,
    find_goodput_knee,
    find_knee,
    recommend_gate,
    slo_verdict,
    verdict,
)


def _answered(summary: dict[str, Any]) -> float:
    """The knee rule's success rate: the share answered, successes and refusals with Retry-After alike."""
    requests = summary["requests"]
    return (summary["succeeded"] + summary.get("refused", 0)) / requests if requests else 0.0


def _refused(summary: dict[str, Any]) -> float:
    requests = summary["requests"]
    return summary.get("refused", 0) / requests if requests else 0.0


def apply_knee(doc: Doc, args: argparse.Namespace, by_rate: bool) -> int | None:
    pts = [
        SweepPoint(p["load"], p["summary"]["ttft_s"]["p50"] or 0.0, p["summary"]["output_tok_per_s"],
                   _answered(p["summary"]), p["summary"]["e2e_s"]["mean"] or 0.0, _refused(p["summary"]))
        for p in doc["points"]
    ]  # fmt: skip
    rule = KneeRule(ttft_factor=args.knee_ttft_factor, min_gain=args.knee_min_gain, min_success=args.min_success)
    knee = find_knee(pts, rule, open_loop=by_rate)
    for p, sp in zip(doc["points"], pts, strict=True):
        p["verdict"] = verdict(sp, knee, rule)
    replicas_seen = {r for p in doc["points"] for r in p["replica_load"] if r != "-"}
    replicas = args.replicas or max(1, len(replicas_seen))
    gate = recommend_gate(knee, pts[knee.index], replicas=replicas, by_rate=by_rate)
    unit = "req/s" if by_rate else "concurrency"
    if knee.found:
        text = (f"knee at {unit} {knee.load:g} ({knee.reason} at {knee.saturated_at:g}); recommended "
                f"admission.replica_max_concurrency: {gate} for {replicas} replica(s)")  # fmt: skip
    elif knee.saturated_at is not None:  # the lowest load already fails: nothing to recommend
        text = (f"no knee: at the lowest {unit} tested ({knee.load:g}) requests already fail or are refused; "
                "nothing recommended (check the target, or sweep lower)")  # fmt: skip
    elif by_rate:
        text = f"no knee up to {unit} {knee.load:g}: time to first token did not jump (sweep higher rates)"
    else:
        text = f"no knee up to {unit} {knee.load:g}: the gate is at least {gate} per replica (sweep higher)"
    doc["knee"] = knee.to_json()
    doc["recommendation"] = {"replica_max_concurrency": gate, "replicas": replicas, "found": knee.found,
                             "load": knee.load, "text": text}  # fmt: skip
    return gate if knee.found else None


def apply_goodput(doc: Doc, args: argparse.Namespace, gate: int | None) -> int | None:
    """The goodput knee and verdicts with `--slo`; returns the gate to write: the throughput knee's (`gate`), or
    the goodput knee's where that is lower (the SLO is what the user asked the gate to keep), or None where no
    load tested met it."""
    if args.slo is None:
        return gate
    knee = find_goodput_knee([(p["load"], p["summary"]["slo_attainment"]) for p in doc["points"]], args.slo_attainment)
    for p in doc["points"]:
        if "verdict" in p:
            p["verdict"] = slo_verdict(p["verdict"], p["summary"]["slo_attainment"], args.slo_attainment)
    unit = "req/s" if doc["arrival"] == "poisson" else "concurrency"
    best = max(doc["points"], key=lambda p: p["summary"]["goodput_req_per_s"])
    if not knee.found and knee.saturated_at is not None:
        head = "no load tested is within targets"
    elif unit == "req/s":
        head = f"the highest rate within targets: {unit} {knee.load:g}"
    else:
        head = f"goodput knee at {unit} {knee.load:g}"
    text = (f"{head} ({knee.reason}; SLO {args.slo.describe()}, "
            f"attainment >= {args.slo_attainment:g}); most goodput {best['summary']['goodput_req_per_s']:.2f} req/s "
            f"at {best['load']:g}")  # fmt: skip
    doc["goodput"] = {"slo": asdict(args.slo), "min_attainment": args.slo_attainment, "knee": knee.to_json(),
                      "text": text}  # fmt: skip
    return _slo_recommendation(doc, knee, unit, gate)


def _slo_recommendation(doc: Doc, knee: Knee, unit: str, gate: int | None) -> int | None:
    """The recommendation moved down to the goodput knee where the SLO is missed below the throughput knee."""
    rec = doc["recommendation"]
    if not knee.found and knee.saturated_at is not None:  # no load tested within targets
        rec.update(replica_max_concurrency=None, found=False, load=None,
                   text=f"no {unit} tested meets the SLO: nothing recommended (sweep lower)")  # fmt: skip
        return None
    if not knee.found or (rec["found"] and knee.load >= rec["load"]):
        return gate
    point = doc["points"][knee.index]
    sp = SweepPoint(point["load"], 0.0, 0.0, e2e_mean_s=point["summary"]["e2e_s"]["mean"] or 0.0)
    slo_gate = recommend_gate(knee, sp, replicas=rec["replicas"], by_rate=unit == "req/s")
    past = f"the throughput knee at {rec['load']:g}" if rec["found"] else "no throughput knee found"
    rec.update(replica_max_concurrency=slo_gate, found=True, load=knee.load,
               text=f"SLO met up to {unit} {knee.load:g} ({past}); recommended admission.replica_max_concurrency: "
                    f"{slo_gate} for {rec['replicas']} replica(s)")  # fmt: skip
    return slo_gate


def plan_beside(doc: Doc, args: argparse.Namespace, source: tuple[int, float, Any] | list[predicted.Capacity]) -> None:
    """doc["plan"]: the prediction beside the measured knee, in concurrency (a rate sweep's by Little's law)."""
    if isinstance(source, list):  # the engines' capacity, at the tokens a sequence held in the lowest-load setting
        first = doc["points"][0]["summary"]
        per_seq = (first["prompt_tokens"] + first["completion_tokens"]) / max(1, first["succeeded"])
        prediction = predicted.from_capacities(source, per_seq)
    else:
        prediction = predicted.from_plan_file(args.plan, doc["recommendation"]["replicas"], source)
    by_rate = doc["arrival"] == "poisson"
    loads = [_in_flight(p) if by_rate else p["load"] for p in doc["points"]]
    knee = doc["knee"]  # not found: none up to the last load, or (saturated at the lowest) at the lowest
    measured = loads[knee["index"]] if knee["found"] or knee["saturated_at"] is not None else None
    best = max(p["summary"]["output_tok_per_s"] for p in doc["points"])
    unit = " in flight (a rate sweep: rate x mean latency)" if by_rate else ""
    doc["plan"] = predicted.compare(prediction, loads, measured, best, unit)
    if by_rate:  # the steps as the table's rows name them: their rates
        doc["plan"]["predicted_step"] = doc["points"][loads.index(doc["plan"]["predicted_step"])]["load"]
        doc["plan"]["measured_knee"] = knee["load"] if measured is not None else None


def _in_flight(point: dict[str, Any]) -> float:
    """Requests in flight at a rate sweep's point (Little's law, rounded up as the recommended gate is)."""
    return float(math.ceil(point["load"] * (point["summary"]["e2e_s"]["mean"] or 0.0)))
