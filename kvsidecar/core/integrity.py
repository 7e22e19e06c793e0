"""End-to-end integrity of a move: CRC32 of every moved block at the source and the destination.

Why a checksum when the copy is a memcpy: the bytes a daemon copies live in another process's
memory, which that process (or a GPU kernel of it) may still be writing, and a bug anywhere in
the block bookkeeping (a wrong id, an overlapping move) shows up only as wrong bytes. Comparing
a checksum taken at the source just before the copy with one taken at the destination just after
it (before any layout fix, which rewrites the bytes) catches both, per destination block.

CRC32 (``zlib.crc32``, table/SIMD code in zlib, releases the GIL on large buffers) is the fast
non-cryptographic choice here: it detects every burst error up to 32 bits and random corruption
with probability 1 - 2^-32; it is not meant to stop an adversary, who could write the
destination after the check anyway. It reads every moved byte twice more, so it is optional
(setting ``checksum``, or per move); docs/reliability.md has its measured cost. Only CPU memory
is checksummed; a move between CUDA buffers reports ``verified`` False.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvsidecar.wire.framing import IdArray


@dataclass
class Verification:
    """What the integrity check of one move found (filled on the copy thread)."""

    verified: bool = False
    """True once both sides were checksummed and compared."""
    invalid_block_ids: list[int] = field(default_factory=list)
    """Destination blocks with at least one mismatching sub-block."""


def block_crcs(views: Sequence[torch.Tensor], ids: IdArray) -> list[int]:
    """CRC32 of each block ``ids[i]`` over every view (layers, K and V), in view order."""
    out = []
    arrays = [v.numpy() for v in views]
    for i in ids.tolist():
        crc = 0
        for arr in arrays:
            row = arr[i]
            if not row.flags.c_contiguous:
                row = np.ascontiguousarray(row)
            crc = zlib.crc32(row, crc)
        out.append(crc)
    return out


def checkable(views: Sequence[torch.Tensor]) -> bool:
    """Whether the views are CPU memory that `block_crcs` can read."""
    return all(v.device.type == "cpu" for v in views)


def verified_copy(
    copy: Callable[[], int],
    *,
    src_views: Sequence[torch.Tensor],
    src_ids: IdArray,
    dst_views: Sequence[torch.Tensor],
    dst_ids: IdArray,
    ratio: int,
    result: Verification,
) -> int:
    """Run ``copy`` between a source and a destination checksum; record mismatches in ``result``.

    ``src_ids[i]`` was copied into destination sub-block ``dst_ids[i]`` (sub-blocks: the
    destination's blocks split ``ratio`` ways, as the daemon plans moves); a mismatch invalidates
    destination block ``dst_ids[i] // ratio``.
    """
    if not (checkable(src_views) and checkable(dst_views)):
        return copy()
    before = block_crcs(src_views, src_ids)
    nbytes = copy()
    after = block_crcs(dst_views, dst_ids)
    bad = {
        int(d) // ratio for d, a, b in zip(dst_ids.tolist(), after, before, strict=True) if a != b
    }
    result.invalid_block_ids = sorted(bad)
    result.verified = True
    return nbytes
