"""Prometheus metrics of the node's prefix cache (`kvsidecar.daemon.cache.prefix`).

Counters are recorded on the event loop as lookups, stores and loads end; the gauges (capacity,
bytes and blocks held, namespaces, pinned blocks) are read from the cache at scrape time by a
collector, like `kvsidecar.daemon.metrics.state`'s, so they never drift from the truth. Defined on
the daemon's own `CollectorRegistry`; the reference is ``docs/metrics.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from kvsidecar.daemon.metrics.families import NAMESPACE

Direction = Literal["store", "load"]
"""Into the cache (a worker's blocks stored) or out of it (loaded into a worker's blocks)."""

DropReason = Literal["no_room", "late", "failed"]
"""Why blocks offered to the cache were not kept: every slot pinned or filling, the copy ended
after the worker stopped waiting (``not_after``), or the copy failed."""


@dataclass(frozen=True, slots=True)
class CacheState:
    """The cache as the gauges show it, read once per scrape."""

    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    namespaces: int = 0
    pinned_blocks: int = 0


class _CacheCollector:
    """Builds the cache gauges from a `CacheState` at every scrape."""

    def __init__(self, state: Callable[[], CacheState]) -> None:
        self.state = state

    def collect(self) -> Iterable[Metric]:
        s = self.state()
        for name, doc, value in (
            ("capacity_bytes", "Host-pool bytes reserved by cache namespaces.", s.capacity_bytes),
            ("used_bytes", "Bytes of cached blocks that lookups can see.", s.used_bytes),
            ("blocks", "Cached blocks that lookups can see, all namespaces.", s.blocks),
            ("namespaces", "Cache namespaces (owner, fingerprint, TP rank).", s.namespaces),
            ("pinned_blocks", "Cached blocks pinned by lookups or running loads.", s.pinned_blocks),
        ):
            yield GaugeMetricFamily(f"{NAMESPACE}_cache_{name}", doc, value=value)


class CacheMetrics:
    """The prefix cache's counters, and its gauges read through ``state`` at scrape time."""

    def __init__(self, registry: CollectorRegistry, state: Callable[[], CacheState]) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, namespace=NAMESPACE, registry=registry)

        self.lookups = counter(
            "cache_lookups", "Prefix-cache lookups answered (those that pinned their hits too)."
        )
        self.pins = counter(
            "cache_pins", "Lookups that pinned their hits for a load (counted as lookups too)."
        )
        self.pinned = counter("cache_pinned_blocks", "Blocks pinned for loads, all pins.")
        self.lookup_blocks = counter(
            "cache_lookup_blocks",
            "Blocks asked for by lookups: hit (held on every rank, leading) or miss.",
            ("result",),
        )
        self.blocks = counter(
            "cache_transferred_blocks", "Blocks copied into or out of the cache.", ("direction",)
        )
        self.bytes = counter(
            "cache_transferred_bytes", "Bytes copied into or out of the cache.", ("direction",)
        )
        self.evictions = counter(
            "cache_evictions", "Cached blocks evicted (least recently used) to make room."
        )
        self.dropped = counter(
            "cache_dropped_blocks", "Blocks offered to the cache and not kept.", ("reason",)
        )
        self.missing = counter(
            "cache_load_missing_blocks",
            "Blocks a load asked for that were not held (the engine recomputes them).",
        )
        for result in ("hit", "miss"):
            self.lookup_blocks.labels(result)
        for direction in ("store", "load"):
            self.blocks.labels(direction)
            self.bytes.labels(direction)
        for reason in ("no_room", "late", "failed"):
            self.dropped.labels(reason)
        registry.register(_CacheCollector(state))

    def lookup(self, hits: int, misses: int) -> None:
        """Count one lookup and its blocks."""
        self.lookups.inc()
        self.lookup_blocks.labels("hit").inc(hits)
        self.lookup_blocks.labels("miss").inc(misses)

    def pin(self, blocks: int) -> None:
        """Count one pin and its blocks (a lookup with ``pin_s`` that hit)."""
        self.pins.inc()
        self.pinned.inc(blocks)

    def transferred(self, direction: Direction, blocks: int, nbytes: int) -> None:
        """Count blocks and bytes copied into (store) or out of (load) the cache."""
        self.blocks.labels(direction).inc(blocks)
        self.bytes.labels(direction).inc(nbytes)

    def evicted(self, blocks: int) -> None:
        """Count evicted blocks."""
        if blocks:
            self.evictions.inc(blocks)

    def drop(self, reason: DropReason, blocks: int) -> None:
        """Count blocks offered to the cache and not kept."""
        if blocks:
            self.dropped.labels(reason).inc(blocks)

    def load_missing(self, blocks: int) -> None:
        """Count blocks a load asked for that the cache did not hold."""
        if blocks:
            self.missing.inc(blocks)
