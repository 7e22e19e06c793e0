"""Hot-path counters and histograms as plain numbers under one lock, exported at scrape time.

prometheus_client's `Counter` and `Histogram` validate and take a lock per value on every update,
and a move makes four updates and a command two: a visible share of a 1-block move's round trip
(docs/benchmarks.md, "bench latency"). A `Tally` keeps the same series as plain numbers, changed
under one lock per record, and builds their metric families at each scrape, as
`kvsidecar.daemon.metrics.state` does for the live-state gauges.

Each series is a small list the recorder holds on to (`CounterFamily.cell`,
`HistogramFamily.cell`), so that a record is a dict lookup and a few additions. The families'
reference is ``docs/metrics.md``; `kvsidecar.daemon.metrics.families.DaemonMetrics` owns them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

__all__ = ["CounterFamily", "HistogramFamily", "Tally"]

Labels = tuple[str, ...]


@dataclass(eq=False)
class CounterFamily:
    """A counter family; each series is a one-element list ``[total]``."""

    name: str
    doc: str
    labelnames: tuple[str, ...]
    series: dict[Labels, list[float]] = field(default_factory=dict)

    def cell(self, labels: Labels) -> list[float]:
        """Return the series of ``labels``, created at 0 (call under the tally's lock)."""
        cell = self.series.get(labels)
        if cell is None:
            cell = self.series[labels] = [0.0]
        return cell

    def family(self) -> CounterMetricFamily:
        """Build the family as it stands (call under the tally's lock)."""
        out = CounterMetricFamily(self.name, self.doc, labels=list(self.labelnames))
        for labels, (total,) in self.series.items():
            out.add_metric(list(labels), total)
        return out


@dataclass(eq=False)
class HistogramFamily:
    """A histogram family with fixed bucket bounds (ascending, ``+Inf`` implied).

    Each series is a list of per-bucket counts (not cumulative), the ``+Inf`` bucket's count,
    then the sum of the observed values. A value goes to bucket ``bisect_left(bounds, value)``
    (the first bound ``>= value``, as Prometheus counts ``le``).
    """

    name: str
    doc: str
    labelnames: tuple[str, ...]
    bounds: tuple[float, ...]
    series: dict[Labels, list[float]] = field(default_factory=dict)

    def cell(self, labels: Labels) -> list[float]:
        """Return the series of ``labels``, created empty (call under the tally's lock)."""
        cell = self.series.get(labels)
        if cell is None:
            cell = self.series[labels] = [0.0] * (len(self.bounds) + 2)
        return cell

    def family(self) -> HistogramMetricFamily:
        """Build the family, with cumulative buckets (call under the tally's lock)."""
        out = HistogramMetricFamily(self.name, self.doc, labels=list(self.labelnames))
        edges = [floatToGoString(b) for b in self.bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        for labels, cell in self.series.items():
            running, buckets = 0.0, []
            for edge, count in zip(edges, cell, strict=False):
                running += count
                buckets.append((edge, running))
            out.add_metric(list(labels), buckets, cell[-1])
        return out


class Tally:
    """A prometheus_client collector of `CounterFamily` and `HistogramFamily` families.

    ``lock`` guards every series: records come from the event loop and from copy threads (a
    reply sent from a copy thread counts its command there); hold it around each record and
    around `CounterFamily.cell` / `HistogramFamily.cell`.
    """

    def __init__(self, namespace: str) -> None:
        self.lock = threading.Lock()
        self._namespace = namespace
        self._families: list[CounterFamily | HistogramFamily] = []

    def counter(self, name: str, doc: str, labelnames: tuple[str, ...]) -> CounterFamily:
        """Define a counter family ``<namespace>_<name>`` (exported as ``..._total``)."""
        family = CounterFamily(f"{self._namespace}_{name}", doc, labelnames)
        self._families.append(family)
        return family

    def histogram(
        self, name: str, doc: str, labelnames: tuple[str, ...], bounds: tuple[float, ...]
    ) -> HistogramFamily:
        """Define a histogram family ``<namespace>_<name>`` with bucket ``bounds``."""
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"{name}: bucket bounds must ascend: {bounds}")
        family = HistogramFamily(f"{self._namespace}_{name}", doc, labelnames, bounds)
        self._families.append(family)
        return family

    def describe(self) -> Iterable[Metric]:
        """Name the families without their series (lets the registry reserve the names)."""
        return [
            CounterMetricFamily(f.name, f.doc, labels=list(f.labelnames))
            if isinstance(f, CounterFamily)
            else HistogramMetricFamily(f.name, f.doc, labels=list(f.labelnames))
            for f in self._families
        ]

    def collect(self) -> Iterable[Metric]:
        """Build every family from the series as they stand now."""
        with self.lock:
            return [f.family() for f in self._families]
