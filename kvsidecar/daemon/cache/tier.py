"""The prefix cache's tiers below the host pool: one small interface, one implementation per medium.

The host pool holds every namespace's blocks that engines load (`kvsidecar.daemon.cache.prefix`);
a tier below it keeps more of them, and keeps them across daemon restarts. What the pool's side
(`kvsidecar.daemon.cache.tiering.TieredCache`) asks of a tier is the same whatever the medium:

- a `TierSpace` per namespace (``(owner, fingerprint, tp_rank)``, the same key as in memory),
  made with the namespace's `SpaceShape`, which a tier keeps with the blocks: a space found again
  after a restart serves only engines whose layers are the same;
- on the event loop, O(keys named): which keys a space holds (`TierSpace.holds`), and
  `TierSpace.touch` (a block used in the pool is recently used below it too: one LRU across
  tiers);
- `TierSpace.put` and `TierSpace.get`: blocks by key, copied from or into rows of host memory
  (`HostBlocks`), on the tier's own threads, answered by a future with one verdict per key. A
  tier stores a checksum (and the key) with every block and checks both on every read: a block
  that does not match is answered False and dropped by the tier, never handed up;
- evictions and losses reported through ``on_removed`` (metrics, KV events), and its state for
  the gauges (`TierState`).

The disk tier (`kvsidecar.daemon.cache.disk.DiskTier`, medium ``STORAGE``) is the one here; a
tier of another medium (NIXL's GDS or POSIX planes, a cluster store) implements the same
`BlockTier` and `TierSpace`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from kvsidecar.daemon.cache.prefix import NamespaceKey
from kvsidecar.daemon.metrics.tiers import TierState
from kvsidecar.wire.types import BufferDescriptor

Rows = np.ndarray[Any, np.dtype[np.uint8]]
"""A ``(slots, row)`` uint8 array: one piece (a layer's K or V, or a whole layer) of every slot."""


@dataclasses.dataclass(frozen=True)
class SpaceShape:
    """What a namespace's blocks are: its layers in order (block count aside), a block's bytes.

    The order is the order of a block's pieces: two shapes with the same layers in another
    order are not the same shape.
    """

    layers: tuple[tuple[str, BufferDescriptor], ...]
    block_bytes: int


@dataclasses.dataclass(frozen=True)
class HostBlocks:
    """Blocks in host memory: block ``i`` is row ``slots[i]`` of every piece, in piece order.

    Valid while the caller keeps those slots from being written (a pin, or a slot that is
    filling): a tier reads or writes them on its own threads.
    """

    pieces: list[Rows]
    slots: list[int]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all pieces."""
        return sum(p.shape[1] for p in self.pieces)


Removed = Callable[[NamespaceKey, str, int], None]
"""``on_removed(namespace, why, blocks)``: blocks left a tier (``evicted``, ``corrupt``,
``dropped`` with their space)."""


class TierSpace(Protocol):
    """One namespace's blocks in one tier (see the module doc)."""

    key: NamespaceKey
    shape: SpaceShape

    @property
    def capacity_blocks(self) -> int:
        """Blocks it can hold."""
        ...

    @property
    def ready_blocks(self) -> int:
        """Blocks it holds whole (what `holds` counts)."""
        ...

    def holds(self, key: bytes) -> bool:
        """Whether the block ``key`` is held whole (a `get` may still find it damaged)."""
        ...

    def touch(self, keys: Sequence[bytes]) -> None:
        """Make these blocks, used above this tier, the most recently used here too."""
        ...

    def put(self, keys: Sequence[bytes], blocks: HostBlocks) -> asyncio.Future[list[bool]]:
        """Write block ``i`` of ``blocks`` under ``keys[i]``; per key, whether it is held now."""
        ...

    def get(self, keys: Sequence[bytes], into: HostBlocks) -> asyncio.Future[list[bool]]:
        """Read ``keys[i]`` into block ``i`` of ``into``; per key, whether it was read whole.

        Whole: read to its end, its key and checksum matched. The rows of the others hold
        anything.
        """
        ...


class BlockTier(Protocol):
    """A medium below the host pool (see the module doc). Used on the event loop only."""

    medium: str
    on_removed: Removed | None
    in_use: Callable[[NamespaceKey], bool]
    """Whether an engine uses a namespace now (set by the pool's side): the spaces of the
    others give their room first."""

    @property
    def up(self) -> bool:
        """Whether it serves; a tier that went down answers every `space` None."""
        ...

    async def start(self) -> None:
        """Open the medium and find the spaces a previous daemon left (bounded time)."""
        ...

    def space(
        self, key: NamespaceKey, shape: SpaceShape | None = None, *, tp_size: int = 1
    ) -> TierSpace | None:
        """Return namespace ``key``'s space (None: none, or no room).

        With ``shape``, make it (a share of the tier for one of ``tp_size`` ranks), or make it
        again when its shape differs.
        """
        ...

    def spaces(self) -> Iterable[TierSpace]:
        """Every space it holds."""
        ...

    def state(self) -> TierState:
        """Return what the gauges show."""
        ...

    async def drain(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) for every read and write in flight; True if none is left."""
        ...

    def close(self) -> None:
        """Release the medium (after `drain`); what is stored stays for the next daemon."""
        ...
