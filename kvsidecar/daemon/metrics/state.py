"""The live-state gauges of the daemon, read at scrape time rather than set on the hot path.

Gauges that mirror live state (registered workers, host pool use, in-flight moves, ...) are not set
by the daemon: `StateCollector`, registered by `kvsidecar.daemon.metrics.families.DaemonMetrics`,
asks a `StateProvider` (the daemon) for a `StateSnapshot` at every scrape, so they can never drift
from the truth. The gauges' reference is ``docs/metrics.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["StateCollector", "StateProvider", "StateSnapshot"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StateSnapshot:
    """Live daemon state, read once per scrape.

    Each per-engine mapping should name every registered engine (with 0 where nothing is pending),
    so that a series disappears exactly when its engine does.
    """

    registered_workers: Mapping[str, int] = field(default_factory=dict)
    """Workers with a live lease, by engine."""
    registered_buffer_bytes: Mapping[str, int] = field(default_factory=dict)
    """Bytes of KV-cache buffers registered with the daemon, by engine."""
    aggregator_pending_requests: Mapping[str, int] = field(default_factory=dict)
    """Requests the completion aggregator still waits on, by engine."""
    host_pool_capacity_bytes: int = 0
    """Size of the daemon-owned host block pool (0 before it is allocated)."""
    host_pool_used_bytes: int = 0
    """Bytes of the host pool that hold blocks."""
    inflight_moves: int = 0
    """Moves submitted to the copy executor or a peer and not yet finished."""
    host_blocks_capacity: Mapping[str, int] = field(default_factory=dict)
    """Host block ids each engine may allocate (its ``host_blocks``; 0 without host blocks)."""
    host_blocks_used: Mapping[str, int] = field(default_factory=dict)
    """Host block ids each engine holds; ``host_alloc`` fails (``pool_exhausted``) at capacity."""
    defence_events: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """How often each defence against a misbehaving client acted since start, by (plane, event):
    refusals, evictions, expiries, dropped replies (docs/metrics.md lists them)."""


class StateProvider(Protocol):
    """What the daemon implements so that state gauges are read at scrape time.

    Called on the event loop (the scrape is served there), so it may read daemon state without
    locks; it must be quick and must not block.
    """

    def metrics_state(self) -> StateSnapshot:
        """Return the current state."""
        ...


class StateCollector:
    """A prometheus_client collector that builds the live-state gauges at every scrape.

    ``provider`` may be None (no state gauges) and may be replaced at any time; ``namespace`` is
    the gauges' name prefix, as prometheus_client's own metrics take one.
    """

    def __init__(self, provider: StateProvider | None, *, namespace: str) -> None:
        self.provider = provider
        self._namespace = namespace

    def describe(self) -> Iterable[Metric]:
        """Name the gauges without reading state."""
        # Lets the registry reserve the names (and catch clashes) without calling the provider.
        return self._families(StateSnapshot())

    def collect(self) -> Iterable[Metric]:
        """Read the provider once and build the gauges; none when it is missing or fails."""
        provider = self.provider
        if provider is None:
            return []
        try:
            snapshot = provider.metrics_state()
        except Exception:
            # A bug in the provider must not take the other metrics (or the scrape) down with it;
            # the missing series are visible to `absent()` alerts.
            logger.exception("metrics state provider failed; state gauges left out of this scrape")
            return []
        return self._families(snapshot)

    def _families(self, s: StateSnapshot) -> list[Metric]:
        ns = self._namespace

        def per_engine(name: str, doc: str, values: Mapping[str, int]) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"{ns}_{name}", doc, labels=["engine"])
            for engine, value in values.items():
                family.add_metric([engine], value)
            return family

        def scalar(name: str, doc: str, value: int) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{ns}_{name}", doc, value=value)

        defences = CounterMetricFamily(
            f"{ns}_defence_events",
            "Times a defence against a misbehaving client acted, by plane and event.",
            labels=["plane", "event"],
        )
        for (plane, event), count in sorted(s.defence_events.items()):
            defences.add_metric([plane, event], count)

        return [
            per_engine(
                "registered_workers", "Workers with a live lease, by engine.", s.registered_workers
            ),
            per_engine(
                "registered_buffer_bytes",
                "Bytes of KV-cache buffers registered with the daemon, by engine.",
                s.registered_buffer_bytes,
            ),
            per_engine(
                "aggregator_pending_requests",
                "Requests the completion aggregator still waits on, by engine.",
                s.aggregator_pending_requests,
            ),
            scalar(
                "host_pool_capacity_bytes",
                "Size of the daemon-owned host block pool.",
                s.host_pool_capacity_bytes,
            ),
            scalar(
                "host_pool_used_bytes",
                "Bytes of the host block pool that hold blocks.",
                s.host_pool_used_bytes,
            ),
            scalar(
                "inflight_moves",
                "Moves submitted to the copy executor or a peer and not yet finished.",
                s.inflight_moves,
            ),
            # The allocator that runs out: host_pool_used_bytes counts the mirrors reserved at
            # registration, full on a well-sized pool before a single block is in use.
            per_engine(
                "host_blocks_capacity",
                "Host block ids an engine may allocate (host_blocks at registration), by engine.",
                s.host_blocks_capacity,
            ),
            per_engine(
                "host_blocks_used",
                "Host block ids an engine holds; host_alloc fails with pool_exhausted at capacity.",
                s.host_blocks_used,
            ),
            defences,
        ]
