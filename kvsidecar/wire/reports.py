"""Completion reports: what a worker says it finished, and what its engine's scheduler sees.

The reference's ``KVConnectorOutput`` and its aggregate, as mergeable msgspec structs; the
``report`` and ``collect`` messages carry them and `kvsidecar.core.aggregator` merges them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvsidecar.wire.types import WorkerRef


class TransferStats(msgspec.Struct, frozen=True):
    """Mergeable per-worker transfer statistics (the reference's ``kv_connector_stats``).

    Counters add up when merged; nothing is averaged, so rates stay byte-weighted.
    """

    counters: dict[str, float] = {}

    def aggregate(self, other: TransferStats) -> TransferStats:
        """Return the sum of both sets of counters."""
        merged = dict(self.counters)
        for key, value in other.counters.items():
            merged[key] = merged.get(key, 0.0) + value
        return TransferStats(merged)

    def is_empty(self) -> bool:
        """Return True when no counter was recorded."""
        return not self.counters


class CacheEvent(msgspec.Struct, frozen=True):
    """One KV-cache event (block stored or removed) reported by a worker."""

    kind: Literal["stored", "removed", "cleared"]
    block_hashes: tuple[int, ...] = ()


class CacheEvents(msgspec.Struct, frozen=True):
    """Mergeable list of cache events with the number of workers that contributed."""

    events: tuple[CacheEvent, ...] = ()
    num_workers: int = 1

    def merge(self, other: CacheEvents) -> CacheEvents:
        """Append the other worker's events and count its contribution."""
        return CacheEvents(self.events + other.events, self.num_workers + other.num_workers)


class WorkerReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One worker's completion report for one step (the reference's ``KVConnectorOutput``).

    ``worker_id`` and ``step`` identify the report, so that a retried delivery counts once.
    ``expected_finished_count`` of 0 means "unchanged".
    """

    worker_id: str
    step: int
    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[int] = frozenset()
    failed_recving: frozenset[str] = frozenset()
    expected_finished_count: int = 0
    kv_connector_stats: TransferStats | None = None
    kv_cache_events: CacheEvents | None = None


class AggregatedOutput(msgspec.Struct, frozen=True):
    """What the engine's scheduler sees for one step, merged over every worker."""

    step: int
    finished_sending: frozenset[str] | None = None
    finished_recving: frozenset[str] | None = None
    invalid_block_ids: frozenset[int] = frozenset()
    failed_recving: frozenset[str] = frozenset()
    expected_finished_count: int = 0
    kv_connector_stats: TransferStats | None = None
    kv_cache_events: CacheEvents | None = None


class PeerCompletion(msgspec.Struct, frozen=True):
    """One completion event of the peer service, for the engine's completion aggregation.

    ``worker`` None means the event covers every rank of the engine (a scheduler's pull, or a
    producer request that every producer rank finished sending). ``expired_sending`` is the
    subset of ``finished_sending`` released by lease expiry rather than by reads.
    """

    engine_id: str
    worker: WorkerRef | None = None
    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    failed_recving: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[int] = frozenset()
    expired_sending: frozenset[str] = frozenset()
