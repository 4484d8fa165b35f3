"""Labelled Prometheus metrics for the per-request hot path, without prometheus_client's cost per update.

prometheus_client takes a lock and walks several Python objects on every `inc`/`observe` (about 1-3 us each; a
request makes about a dozen updates, a streamed one another per relayed chunk). Here a child is a plain slotted
object updated in place, and the metric itself is the registry's collector, rendering every child at scrape time.
Only the event loop thread updates these metrics and the scrape runs on that thread too, so no lock is needed.

Exposition matches prometheus_client's Counter / Gauge / Histogram (names, types, labels, cumulative `le` buckets,
`_sum` and `_count`), without the `_created` samples. Children are cached by label values, so cardinality is the
caller's: every label set used here comes from config (models, replicas, tenants) or a fixed vocabulary.
Cost: `labels()` one dict lookup, `inc`/`set` one attribute update, `observe` one bisect (O(log buckets));
a scrape is O(children x buckets). `CallbackGauge` holds nothing: it reads its samples from the state's owner at
scrape time (in-flight counts, queue depth, replica states), so state is never read back from a metric.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


class Value:
    """A counter's or gauge's child."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def set(self, value: float) -> None:
        self.value = float(value)


class Buckets:
    """A histogram's child: per-bucket (non-cumulative) counts, the last one for +Inf, and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1  # le is inclusive: the first bound >= amount
        self.sum += amount


C = TypeVar("C", Value, Buckets)


class _Family(Generic[C]):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], C] = {}
        registry.register(self)

    def _new_child(self) -> C:
        raise NotImplementedError

    def labels(self, *values: str) -> C:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values!r}")
            child = self._children[values] = self._new_child()
        return child

    def forget(self, label: str, value: str) -> None:
        """Drop the children whose `label` is `value` (a replica removed for good: its series go, else engines
        found by DNS, coming and going, would pile series up for the life of the process)."""
        if label in self.labelnames:
            at = self.labelnames.index(label)
            for values in [v for v in self._children if v[at] == value]:
                del self._children[values]

    def _family(self) -> Metric:
        raise NotImplementedError

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError


class _ValueFamily(_Family[Value]):
    family_type: type[CounterMetricFamily] | type[GaugeMetricFamily]

    def _new_child(self) -> Value:
        return Value()

    def _family(self) -> CounterMetricFamily | GaugeMetricFamily:
        return self.family_type(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in self._children.items():
            family.add_metric(list(values), child.value)
        yield family


class FastCounter(_ValueFamily):
    family_type = CounterMetricFamily


class FastGauge(_ValueFamily):
    family_type = GaugeMetricFamily


class FastHistogram(_Family[Buckets]):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        buckets: Sequence[float],
    ) -> None:
        self.bounds = tuple(float(b) for b in buckets if b != float("inf"))
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"{name}: buckets must be strictly increasing")
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> Buckets:
        return Buckets(self.bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        les = [*(floatToGoString(b) for b in self.bounds), "+Inf"]
        for values, child in self._children.items():
            cumulative, total = [], 0
            for le, n in zip(les, child.counts, strict=True):
                total += n
                cumulative.append((le, float(total)))
            family.add_metric(list(values), cumulative, child.sum)
        yield family


class CallbackGauge:
    """A gauge whose samples are read from the state's owner at scrape time: the metric never holds the state.
    `read` returns (label values, value) pairs."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        read: Callable[[], Iterable[tuple[Sequence[str], float]]],
    ) -> None:
        self.name, self.documentation, self.labelnames, self.read = name, documentation, tuple(labelnames), read
        registry.register(self)

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, value in self.read():
            family.add_metric(list(values), value)
        yield family
