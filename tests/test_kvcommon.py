"""The shared helpers: the Prometheus text reader reads what prometheus_client's parser reads for the wanted
families, and the back-off doubles from its base up to its cap."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcommon.backoff import Backoff, backoff_delay
from kvcommon.promtext import samples


def test_the_reader_agrees_with_prometheus_client_on_the_wanted_families() -> None:
    registry = CollectorRegistry()
    Counter("vllm:prefix_cache_hits", "h", ["engine"], registry=registry).labels("0").inc(7)
    gauge = Gauge("vllm:num_requests_running", "r", ["engine", "model_name"], registry=registry)
    gauge.labels("0", 'a "quoted" name').set(3)
    gauge.labels("1", "m").set(4)
    Histogram("vllm:time_to_first_token_seconds", "t", registry=registry).observe(0.25)
    text = generate_latest(registry).decode() + "not a sample\nvllm:num_requests_running{} nan-ish\n"
    wanted = ("vllm:prefix_cache_hits_total", "vllm:num_requests_running", "vllm:time_to_first_token_seconds_sum")
    ours = sorted((s.name, s.value) for s in samples(text, wanted))
    theirs = sorted(
        (s.name, s.value)
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
        if s.name in wanted
    )
    assert ours == theirs
    assert {s.labels["model_name"] for s in samples(text, ("vllm:num_requests_running",))} == {
        'a \\"quoted\\" name',
        "m",
    }


def test_back_off_doubles_up_to_its_cap_and_starts_over_after_a_success() -> None:
    backoff = Backoff(0.5, 3.0)
    assert [backoff.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert backoff.next() == 0.5
    assert backoff_delay(10_000, 1.0, 60.0) == 60.0  # no overflow however long it failed
