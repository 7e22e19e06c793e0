"""Wire types of kvsidecar, defined once.

Every message that crosses a socket is a `msgspec.Struct` here. Schema evolution follows msgspec's
rules: new fields go at the end and carry defaults; a field's type never changes. Bulk data (block
ids, block bytes) never travels inside these structs: it rides in raw frames next to them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change of the messages below."""

Arrangement = Literal["kv_first", "blocks_first", "split", "mla"]
"""How K and V sit in one registered tensor.

- ``kv_first``: ``(2, B, N, H, C)`` (FlashAttention)
- ``blocks_first``: ``(B, 2, N, H, C)`` (FlashInfer)
- ``split``: ``(B, N, H, C)``, one tensor for K and another for V
- ``mla``: ``(B, N, C)``, one latent vector per token
"""

MemoryOrder = Literal["NHD", "HND"]
"""Memory order inside one block: tokens-then-heads (NHD) or heads-then-tokens (HND)."""


class BufferDescriptor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one registered KV tensor holds and how its bytes are laid out.

    The logical shape is always the engine's view (block dim, then tokens, then heads); the memory
    order says whether tokens or heads vary slower inside a block. MLA buffers have no head dim:
    ``num_heads`` is 1 and ``memory_order`` is irrelevant (NHD by convention).
    """

    arrangement: Arrangement
    memory_order: MemoryOrder
    dtype: str
    """torch dtype name without the ``torch.`` prefix, e.g. ``"float16"``."""
    num_blocks: int
    block_size: int
    """Tokens per block."""
    num_heads: int
    head_size: int


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
        """True when no counter was recorded."""
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
