"""kvcommon.fastmetrics renders exactly what prometheus_client's own metrics render for the same updates."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvcommon.fastmetrics import FastCounter, FastGauge, FastHistogram

BUCKETS = (0.001, 0.01, 0.1, 1, 2.5, 10)


def _without_created(text: bytes) -> list[str]:
    return [line for line in text.decode().splitlines() if "_created" not in line]


def _pair() -> tuple[
    tuple[object, object, object], tuple[FastCounter, FastGauge, FastHistogram], CollectorRegistry, CollectorRegistry
]:
    ref_reg, fast_reg = CollectorRegistry(), CollectorRegistry()
    ref = (
        Counter("t_requests", "Requests.", ["model", "status"], registry=ref_reg),
        Gauge("t_in_flight", "In flight.", ["replica"], registry=ref_reg),
        Histogram("t_latency_seconds", "Latency.", ["model"], buckets=BUCKETS, registry=ref_reg),
    )
    fast = (
        FastCounter("t_requests", "Requests.", ["model", "status"], fast_reg),
        FastGauge("t_in_flight", "In flight.", ["replica"], fast_reg),
        FastHistogram("t_latency_seconds", "Latency.", ["model"], fast_reg, BUCKETS),
    )
    return ref, fast, ref_reg, fast_reg


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["m1", "m2"]),
            st.sampled_from(["200", "503"]),
            st.floats(min_value=0, max_value=20, allow_nan=False),
        ),
        max_size=40,
    )
)
def test_same_exposition_as_prometheus_client(updates: list[tuple[str, str, float]]) -> None:
    ref, fast, ref_reg, fast_reg = _pair()
    for model, status, value in updates + [("m1", "200", b) for b in BUCKETS]:  # exact bounds: le is inclusive
        for counter, gauge, hist in (ref, fast):
            counter.labels(model, status).inc(value)  # type: ignore[attr-defined]
            gauge.labels(model).set(value)  # type: ignore[attr-defined]
            hist.labels(model).observe(value)  # type: ignore[attr-defined]
    assert _without_created(generate_latest(fast_reg)) == _without_created(generate_latest(ref_reg))


def test_wrong_label_count_and_duplicate_names_are_refused() -> None:
    registry = CollectorRegistry()
    counter = FastCounter("t_total_things", "Things.", ["a", "b"], registry)
    with pytest.raises(ValueError, match="expected labels"):
        counter.labels("only-one")
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        FastCounter("t_total_things", "Again.", ["a"], registry)
    with pytest.raises(ValueError, match="strictly increasing"):
        FastHistogram("t_h", "H.", [], registry, (1, 0.5))
