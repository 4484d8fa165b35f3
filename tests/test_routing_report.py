"""The routing benchmark's target checks (bench/routing_report.py) on literal rows: the Poisson p99 comparison treats
a difference inside round-robin's own run-to-run range as equal, and nothing larger."""

from __future__ import annotations

from bench.bench_routing import Row
from bench.routing_report import target_checks


def _row(policy: str, p99: float, p99_range: tuple[float, float], p50: float = 20.0) -> Row:
    return Row(
        workload="shared-prefix", arrival="poisson", policy=policy, requests=100, failed=0,
        hit_rate=0.8 if policy == "cache-aware" else 0.2, best_hit_rate=0.8, best_unbounded=0.8,
        ttft_p50_ms=p50, ttft_p99_ms=p99, out_tok_s=700.0, req_s=44.0, ttft_p99_range=p99_range,
    )  # fmt: skip


def _p99_line(ca: Row, rr: Row) -> str:
    return next(line for line in target_checks([rr, ca]) if "TTFT p99" in line)


def test_a_p99_above_round_robin_by_less_than_its_own_range_counts_as_equal() -> None:
    rr = _row("round-robin", 332.6, (332.4, 332.8))
    assert _p99_line(_row("cache-aware", 332.8, (331.1, 335.4)), rr).startswith("- MET")
    assert _p99_line(_row("cache-aware", 330.0, (329.0, 331.0)), rr).startswith("- MET")
    assert _p99_line(_row("cache-aware", 333.1, (333.0, 333.2)), rr).startswith("- NOT MET")


def test_one_run_compares_strictly_and_the_p50_must_stay_near_the_best() -> None:
    rr = _row("round-robin", 332.6, (332.6, 332.6))
    assert _p99_line(_row("cache-aware", 332.7, (332.7, 332.7)), rr).startswith("- NOT MET")
    assert _p99_line(_row("cache-aware", 300.0, (300.0, 300.0), p50=30.0), rr).startswith("- NOT MET")


def test_timed_arrivals_get_the_tail_check_too() -> None:
    """A trace or the flash crowd (the `trace` arrival) is an open arrival: its p99 is held to round-robin's."""
    rr, ca = _row("round-robin", 372.0, (372.0, 372.0)), _row("cache-aware", 348.0, (348.0, 348.0))
    rr.arrival = ca.arrival = "trace"
    assert _p99_line(ca, rr).startswith("- MET: shared-prefix/trace TTFT p99 348.0")
    ca.ttft_p99_ms = 400.0
    assert _p99_line(ca, rr).startswith("- NOT MET")
