"""Prometheus metrics of the prefix cache's tiers, labelled by ``medium``.

``CPU`` is the host pool, ``STORAGE`` the disk tier (`kvsidecar.daemon.cache.disk`).

The gauges (up, capacity, bytes and blocks held, spaces, the file system's free bytes) are read
from the tiers at scrape time by a collector; the counters (hits, reads and writes in blocks,
bytes and seconds, errors by kind, evictions) are recorded on the event loop as I/O settles.
Defined on the daemon's own `CollectorRegistry`; the reference is ``docs/metrics.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from kvsidecar.daemon.metrics.families import NAMESPACE

ErrorKind = Literal["io", "no_space", "read_only", "corrupt", "truncated"]
"""What went wrong: a failed read or write, a full file system, a read-only or taken-away one,
a block read whole that did not match its key or checksum, a block the file ended before."""

ERROR_KINDS: tuple[ErrorKind, ...] = ("io", "no_space", "read_only", "corrupt", "truncated")
MEDIA = ("CPU", "STORAGE")


@dataclass(frozen=True)
class TierState:
    """A tier as the gauges and ``status`` show it, read once per scrape."""

    medium: str
    up: bool
    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    spaces: int = 0
    free_bytes: int = -1
    """Bytes left on the device or file system (-1: unknown)."""
    reason: str = ""
    """Why it is down (empty when up)."""
    path: str = ""


class _TierCollector:
    """Builds the tier gauges at every scrape."""

    def __init__(self, states: Callable[[], Iterable[TierState]]) -> None:
        self.states = states

    def collect(self) -> Iterable[Metric]:
        families = {
            name: GaugeMetricFamily(f"{NAMESPACE}_cache_tier_{name}", doc, labels=["medium"])
            for name, doc in (
                ("up", "1 when the tier serves, 0 when it turned itself off (or never started)."),
                ("capacity_bytes", "Bytes the tier has for blocks (the disk tier: its files)."),
                ("used_bytes", "Bytes of the blocks the tier holds whole."),
                ("blocks", "Blocks the tier holds whole."),
                ("spaces", "Namespaces the tier holds."),
                ("free_bytes", "Bytes left on the tier's file system (the disk tier only)."),
            )
        }
        for s in self.states():
            families["up"].add_metric([s.medium], 1.0 if s.up else 0.0)
            families["capacity_bytes"].add_metric([s.medium], s.capacity_bytes)
            families["used_bytes"].add_metric([s.medium], s.used_bytes)
            families["blocks"].add_metric([s.medium], s.blocks)
            families["spaces"].add_metric([s.medium], s.spaces)
            if s.free_bytes >= 0:
                families["free_bytes"].add_metric([s.medium], s.free_bytes)
        yield from families.values()


class TierMetrics:
    """The tiers' counters, and their gauges read through ``states`` at scrape time."""

    def __init__(
        self, registry: CollectorRegistry, states: Callable[[], Iterable[TierState]]
    ) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...]) -> Counter:
            return Counter(name, doc, labels, namespace=NAMESPACE, registry=registry)

        self.hits = counter(
            "cache_tier_hit_blocks",
            "Blocks lookups found, by the tier that held them (leading hits, every rank).",
            ("medium",),
        )
        self.io_blocks = counter(
            "cache_tier_io_blocks", "Blocks read from or written to the tier.", ("medium", "op")
        )
        self.io_bytes = counter(
            "cache_tier_io_bytes", "Bytes read from or written to the tier.", ("medium", "op")
        )
        self.io_seconds = counter(
            "cache_tier_io_seconds",
            "Seconds the tier's I/O threads spent reading or writing (checksums included).",
            ("medium", "op"),
        )
        self.errors = counter(
            "cache_tier_errors", "Faults of the tier, by kind.", ("medium", "kind")
        )
        self.evictions = counter(
            "cache_tier_evictions",
            "Blocks evicted from the tier (least recently used) to make room.",
            ("medium",),
        )
        for medium in MEDIA:
            self.hits.labels(medium)
        for op in ("read", "write"):
            self.io_blocks.labels("STORAGE", op)
            self.io_bytes.labels("STORAGE", op)
            self.io_seconds.labels("STORAGE", op)
        for kind in ERROR_KINDS:
            self.errors.labels("STORAGE", kind)
        self.evictions.labels("STORAGE")
        registry.register(_TierCollector(states))

    def hit(self, medium: str, blocks: int) -> None:
        """Count blocks a lookup found in ``medium``."""
        if blocks:
            self.hits.labels(medium).inc(blocks)

    def io(self, medium: str, op: str, blocks: int, nbytes: int, seconds: float) -> None:
        """Count one settled read or write."""
        self.io_blocks.labels(medium, op).inc(blocks)
        self.io_bytes.labels(medium, op).inc(nbytes)
        self.io_seconds.labels(medium, op).inc(seconds)

    def error(self, medium: str, kind: ErrorKind, n: int = 1) -> None:
        """Count faults."""
        if n:
            self.errors.labels(medium, kind).inc(n)

    def evicted(self, medium: str, blocks: int) -> None:
        """Count evicted blocks."""
        if blocks:
            self.evictions.labels(medium).inc(blocks)
