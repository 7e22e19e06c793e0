"""The daemon-owned host pool: one arena allocated at start-up, carved into extents.

The arena is allocated and touched once (first touch runs at a fraction of copy speed) and pinned
on CUDA machines so GPU copies to and from it are DMA. Extents are carved first-fit from
a free list that coalesces neighbours, so a worker's mirror released at its death leaves one hole a
new worker can reuse.

Block ids are accounted separately by `BlockIdAllocator`: an engine's scheduler allocates host block
ids that are valid in every worker's mirror at once.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from kvsidecar.memory.base import HandleError


class Extent:
    """A reserved range of the host pool; a `MappedBuffer` of kind ``"host_pool"``.

    `close` gives the range back to the pool (same as `HostPool.release`, but idempotent).
    """

    kind: ClassVar[Literal["host_pool"]] = "host_pool"
    """Where the bytes live."""

    __slots__ = ("_flat", "_pool", "nbytes", "offset", "owner")

    def __init__(self, pool: HostPool, offset: int, flat: torch.Tensor, owner: str = "") -> None:
        self._pool: HostPool | None = pool
        self._flat: torch.Tensor | None = flat
        self.offset = offset
        """Byte offset of the extent within the arena."""
        self.nbytes = flat.numel()
        """Length of the extent in bytes."""
        self.owner = owner
        """Who it was reserved for (`HostPool.used_by` counts per owner)."""

    @property
    def flat(self) -> torch.Tensor:
        """1-D ``uint8`` view of the extent; raises `HandleError` once released."""
        if self._flat is None:
            raise HandleError("closed", f"host pool extent at {self.offset} was released")
        return self._flat

    @property
    def closed(self) -> bool:
        """True once the extent went back to the pool."""
        return self._flat is None

    def close(self) -> None:
        """Give the extent back to its pool; idempotent."""
        if self._pool is not None:
            self._pool.release(self)

    def _detach(self) -> None:
        self._pool = None
        self._flat = None

    def __repr__(self) -> str:
        state = "released" if self._flat is None else "reserved"
        return f"<Extent {self.offset}+{self.nbytes} {state}>"


_PAGE = 4096
"""Alignment of the arena's first byte."""


class HostPool:
    """One host memory arena of ``capacity_bytes``, carved into `Extent` s.

    ``pin``: None pins when CUDA is available; True requires CUDA (``cuda_unavailable``
    otherwise). Pinning registers the already-touched arena with ``cudaHostRegister`` rather than
    asking torch's pinned allocator, which rounds sizes up to a power of two.
    """

    def __init__(self, capacity_bytes: int, *, pin: bool | None = None) -> None:
        if capacity_bytes <= 0:
            raise HandleError("bad_request", f"pool capacity must be > 0, not {capacity_bytes}")
        if pin is None:
            pin = torch.cuda.is_available()
        elif pin and not torch.cuda.is_available():
            raise HandleError("cuda_unavailable", "cannot pin the host pool without CUDA")
        # torch's allocator aligns to 64 bytes; a page-aligned start lets a reservation of the
        # whole capacity at the default 4096-byte alignment fit (and pages map one to one).
        raw = torch.empty(capacity_bytes + _PAGE - 1, dtype=torch.uint8)
        skip = -raw.data_ptr() % _PAGE
        self._arena: torch.Tensor | None = raw[skip : skip + capacity_bytes]
        self._arena.zero_()
        self._base = self._arena.data_ptr()
        self.pinned = False
        """True when the arena is registered with CUDA (page-locked)."""
        if pin:
            _cuda_check(_cudart().cudaHostRegister(self._base, capacity_bytes, 0))
            self.pinned = True
        self.capacity_bytes = capacity_bytes
        """Size of the arena in bytes."""
        # Free ranges as parallel sorted lists (offsets, sizes): bisect finds neighbours to merge.
        self._free_off: list[int] = [0]
        self._free_len: list[int] = [capacity_bytes]
        self._used: dict[int, Extent] = {}
        self._used_bytes = 0
        self._by_owner: dict[str, int] = {}

    @property
    def arena(self) -> torch.Tensor:
        """The whole arena as one flat ``uint8`` tensor."""
        if self._arena is None:
            raise HandleError("closed", "the host pool is closed")
        return self._arena

    @property
    def used_bytes(self) -> int:
        """Bytes currently reserved (alignment padding not counted: it stays free)."""
        return self._used_bytes

    def used_by(self, owner: str) -> int:
        """Bytes currently reserved for ``owner`` (quotas are checked against it)."""
        return self._by_owner.get(owner, 0)

    @property
    def free_bytes(self) -> int:
        """Bytes not reserved (possibly fragmented)."""
        return self.capacity_bytes - self._used_bytes

    def free_ranges(self) -> list[tuple[int, int]]:
        """Return the free list as ``(offset, nbytes)`` pairs, sorted and never adjacent."""
        return list(zip(self._free_off, self._free_len, strict=True))

    def reserve(self, nbytes: int, *, align: int = 4096, owner: str = "") -> Extent:
        """Reserve ``nbytes`` whose address is a multiple of ``align`` (first fit), for ``owner``.

        Raises `HandleError` ``pool_exhausted`` when no free range fits, ``bad_request`` for a
        size <= 0 or an alignment that is not a power of two.
        """
        arena = self.arena
        if nbytes <= 0:
            raise HandleError("bad_request", f"cannot reserve {nbytes} bytes")
        if align <= 0 or align & (align - 1):
            raise HandleError("bad_request", f"alignment {align} is not a power of two")
        for i, (off, size) in enumerate(zip(self._free_off, self._free_len, strict=True)):
            # Align the address, not the offset (the arena starts on a page, but larger alignments).
            start = off + (-(self._base + off) % align)
            end = start + nbytes
            if end > off + size:
                continue
            pieces = [(o, n) for o, n in ((off, start - off), (end, off + size - end)) if n > 0]
            self._free_off[i : i + 1] = [o for o, _ in pieces]
            self._free_len[i : i + 1] = [n for _, n in pieces]
            extent = Extent(self, start, arena[start:end], owner)
            self._used[start] = extent
            self._used_bytes += nbytes
            self._by_owner[owner] = self._by_owner.get(owner, 0) + nbytes
            return extent
        raise HandleError(
            "pool_exhausted",
            f"no free range of {nbytes} bytes (align {align}); {self.free_bytes} of "
            f"{self.capacity_bytes} bytes free in {len(self._free_off)} ranges",
        )

    def release(self, extent: Extent) -> None:
        """Return an extent to the pool, merging it with free neighbours.

        Raises `HandleError` ``not_allocated`` for an extent that is not reserved from this pool.
        """
        if self._used.get(extent.offset) is not extent:
            raise HandleError("not_allocated", f"{extent!r} is not reserved in this pool")
        del self._used[extent.offset]
        extent._detach()
        self._used_bytes -= extent.nbytes
        left = self._by_owner.pop(extent.owner, 0) - extent.nbytes
        if left > 0:
            self._by_owner[extent.owner] = left
        off, size = extent.offset, extent.nbytes
        i = bisect.bisect_left(self._free_off, off)
        if i < len(self._free_off) and off + size == self._free_off[i]:
            size += self._free_len[i]
            del self._free_off[i], self._free_len[i]
        if i > 0 and self._free_off[i - 1] + self._free_len[i - 1] == off:
            self._free_len[i - 1] += size
        else:
            self._free_off.insert(i, off)
            self._free_len.insert(i, size)

    def close(self) -> None:
        """Release the arena (unpinning it); extents still reserved become unusable."""
        if self._arena is None:
            return
        for extent in self._used.values():
            extent._detach()
        self._used.clear()
        if self.pinned:
            _cuda_check(_cudart().cudaHostUnregister(self._base))
            self.pinned = False
        self._arena = None


def _cudart() -> Any:
    # torch.cuda.cudart() is untyped; its calls return cudaError values.
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _cuda_check(err: object) -> None:
    # cudart calls return a cudaError enum; 0 (cudaSuccess) is the only good value.
    code: Any = getattr(err, "value", err)
    if int(code) != 0:
        raise HandleError("cuda_unavailable", f"CUDA host registration failed: {err}")


def layer_views(
    flat: torch.Tensor, num_blocks: int, row_nbytes: Sequence[int]
) -> list[torch.Tensor]:
    """Split a worker's mirror extent layer-major into one ``(num_blocks, row)`` tensor per layer.

    ``row_nbytes[i]`` is layer i's bytes per block; the extent must be exactly
    ``num_blocks * sum(row_nbytes)`` bytes. Each layer's region is contiguous and block-major, so
    a run of consecutive host blocks of one layer is one contiguous copy.
    """
    total = num_blocks * sum(row_nbytes)
    if flat.dim() != 1 or flat.numel() != total:
        raise HandleError("bad_request", f"mirror has {flat.numel()} bytes, layers need {total}")
    views = []
    start = 0
    for row in row_nbytes:
        views.append(flat[start : start + num_blocks * row].view(num_blocks, row))
        start += num_blocks * row
    return views


class BlockIdAllocator:
    """Host block ids ``0 .. capacity-1`` of one engine, handed out all-or-nothing.

    Each id indexes a block in every worker's mirror of that engine at once. The free ids are a
    numpy stack (4 bytes an id, built in one call): an engine of millions of host blocks costs
    megabytes and milliseconds, not a list of Python ints.
    """

    def __init__(self, capacity: int) -> None:
        if not 0 <= capacity < 1 << 31:
            raise HandleError("bad_request", f"capacity must be in [0, 2**31), not {capacity}")
        self.capacity = capacity
        """Number of ids."""
        # A stack: taking from the end hands out low ids first, which keeps runs contiguous.
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int32)
        self._top = capacity
        self._allocated = np.zeros(capacity, dtype=bool)

    @property
    def num_free(self) -> int:
        """Ids available."""
        return self._top

    @property
    def num_used(self) -> int:
        """Ids handed out and not yet freed."""
        return self.capacity - self._top

    def alloc(self, count: int) -> list[int]:
        """Hand out ``count`` ids, or none: ``pool_exhausted`` if fewer than ``count`` are free."""
        if count < 0:
            raise HandleError("bad_request", f"cannot allocate {count} ids")
        if count > self._top:
            raise HandleError("pool_exhausted", f"{count} host blocks asked, {self._top} free")
        ids = self._free[self._top - count : self._top][::-1].copy()
        self._top -= count
        self._allocated[ids] = True
        out: list[int] = ids.tolist()
        return out

    def free(self, ids: Iterable[int]) -> None:
        """Give ids back; all are checked first, so a bad list frees nothing (``not_allocated``)."""
        arr = np.fromiter(ids, dtype=np.int64)
        bad = (arr < 0) | (arr >= self.capacity)
        if bad.any():
            raise HandleError("not_allocated", f"host block {int(arr[bad][0])} is not allocated")
        taken = self._allocated[arr]
        if not taken.all():
            raise HandleError("not_allocated", f"host block {int(arr[~taken][0])} is not allocated")
        if np.unique(arr).size != arr.size:
            raise HandleError("not_allocated", "a host block appears twice in the list")
        self._allocated[arr] = False
        self._free[self._top : self._top + arr.size] = arr[::-1]
        self._top += arr.size
