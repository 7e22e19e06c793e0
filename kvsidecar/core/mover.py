"""Moves of KV-cache blocks between two buffer sets: checked, then planned as coalesced runs.

A move is "block ``src_ids[i]`` of every source view goes to block ``dst_ids[i]`` of the paired
destination view". A *view* is one layer's K (or V, or MLA) cache seen block-major: a tensor whose
dim 0 indexes blocks and whose remaining dims hold one block's bytes contiguously (the rows that
`kvsidecar.core.layout.block_views` hands out). The block stride may exceed the row length, as in a
FlashInfer ``(num_blocks, 2, ...)`` cache seen through its K half.

The work is split in three steps so that the daemon can reject a bad request before touching
memory and can reuse a plan across every layer:

1. `check_ids` checks the block ids against the two buffer sets (raises `MoveError`), after a
   one-pass `fine_small` on a handful of ids; `validate_move` first makes the ids an array.
2. `plan_runs` (or `plan_small` for a handful of ids) coalesces the id pairs into maximal runs
   where both sides step by +1.
3. `kvsidecar.core.copier` copies the runs (`copy_runs`, or through views prepared once per
   pair of buffer sets).

This module owns the first two and the error they raise: the one check of block ids for moves,
layout fixes, pulls and publishes, in the daemon, the peer service and the benchmarks
(`check_range`, `check_unique` for a single list). `clip_ssm_state_blocks` picks which of an SSM
layer's blocks a move carries at all.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.framing import IdArray

__all__ = [
    "SMALL_MOVE_IDS",
    "BlockIds",
    "MoveError",
    "MoveErrorCode",
    "Run",
    "RunPlan",
    "check_ids",
    "check_range",
    "check_unique",
    "clip_ssm_state_blocks",
    "fine_small",
    "plan_runs",
    "plan_small",
    "validate_move",
]

MoveErrorCode = Literal[
    "invalid_message",
    "length_mismatch",
    "out_of_range",
    "duplicate_destination",
    "incompatible_buffers",
]
"""Why a move was refused. Every value is also a `kvsidecar.wire.errors.ErrorCode`, so the daemon
can reply with ``MoveError.code`` unchanged.

- ``invalid_message``: an id array is not a 1-D array of integers, or (``aliased`` moves) a block
  is both read and written.
- ``length_mismatch``: source and destination id arrays differ in length.
- ``out_of_range``: an id is negative or not below the buffer's block count.
- ``duplicate_destination``: a destination block is written twice.
- ``incompatible_buffers``: the source and destination views do not pair up (count, dtype, block
  size in bytes) or a view's blocks are not contiguous rows.
"""

BlockIds: TypeAlias = "Sequence[int] | npt.NDArray[np.integer] | torch.Tensor"
"""Block ids as they arrive: a list of ints, a numpy integer array (raw int32/int64 frames from
ZeroMQ, wrapped with `numpy.frombuffer`), or a torch integer tensor."""

_IdArray: TypeAlias = "npt.NDArray[np.int64]"


class MoveError(SidecarError, ValueError):
    """A move that must not happen; raised before any byte is copied.

    A `SidecarError` whose ``code`` is one of `MoveErrorCode`: the daemon replies with its code
    and message as they are; the message says which id or view was at fault.
    """

    def __init__(self, code: MoveErrorCode, message: str) -> None:
        super().__init__(code, message)
        self.code: MoveErrorCode = code


def _as_ids(ids: BlockIds, what: str) -> _IdArray:
    """Return ``ids`` as a 1-D int64 numpy array, without copying when it already is one."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise MoveError("invalid_message", f"{what} must be integers, got {ids.dtype}")
        arr: npt.NDArray[Any] = ids.detach().cpu().numpy()
    else:
        try:
            arr = np.asarray(ids)
        except (TypeError, ValueError) as exc:
            raise MoveError("invalid_message", f"{what} is not an integer array: {exc}") from None
        if arr.size == 0 and arr.dtype == np.float64:
            # np.asarray([]) is float64; an empty list is a valid empty move.
            arr = arr.astype(np.int64)
    if arr.ndim != 1:
        raise MoveError("invalid_message", f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise MoveError("invalid_message", f"{what} must be integers, got {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise MoveError("out_of_range", f"{what} holds an id above 2**63 - 1")
    # int64 so that id + 1 cannot wrap for int32 frames holding 2**31 - 1.
    return arr.astype(np.int64, copy=False)


SMALL_MOVE_IDS = 16
"""Moves of at most this many ids are checked and planned in pure Python (`fine_small`,
`plan_small`): for a handful of ids, numpy's per-call cost is several times the work."""


def check_range(ids: IdArray, num_blocks: int, what: str) -> None:
    """Refuse (``out_of_range``) an id of ``ids`` outside ``0 .. num_blocks - 1``.

    ``what`` names the ids in the message: ``"<what> id <id> is outside 0..<n-1> (<n> blocks)"``.
    """
    if not ids.size:
        return
    if ids.size <= SMALL_MOVE_IDS:  # numpy reductions cost more than a few ids
        values = ids.tolist()
        lo, hi = min(values), max(values)
    else:
        lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_blocks:
        bad = lo if lo < 0 else hi
        raise MoveError(
            "out_of_range", f"{what} id {bad} is outside 0..{num_blocks - 1} ({num_blocks} blocks)"
        )


def check_unique(ids: IdArray, what: str, num_blocks: int) -> None:
    """Refuse (``duplicate_destination``) an id that appears twice in ``ids``.

    ``ids`` are already checked to lie in ``0 .. num_blocks - 1`` (`check_range`).
    """
    if ids.size <= 1:
        return
    if ids.size <= SMALL_MOVE_IDS:
        values = ids.tolist()
        if len(set(values)) == len(values):
            return
    elif ids.size * 64 >= num_blocks:
        # One flag per block rather than a sort once the ids are a fair share of the blocks:
        # linear in the blocks, with no sort of the ids.
        seen = np.zeros(num_blocks, dtype=np.bool_)
        seen[ids] = True
        if int(np.count_nonzero(seen)) == ids.size:
            return
    elif np.unique(ids).size == ids.size:
        return
    uniq, counts = np.unique(ids, return_counts=True)
    raise MoveError("duplicate_destination", f"{what} id {int(uniq[counts > 1][0])} appears twice")


def _overlap(a: IdArray, b: IdArray) -> bool:
    if a.size <= SMALL_MOVE_IDS and b.size <= SMALL_MOVE_IDS:
        return not set(a.tolist()).isdisjoint(b.tolist())
    return bool(np.intersect1d(a, b).size)


def check_ids(
    src_ids: IdArray,
    dst_ids: IdArray,
    *,
    blocks: tuple[int, int],
    ratio: int = 1,
    same_set: bool = False,
) -> None:
    """Raise `MoveError` unless a move's ids pair up and lie in range, with unique destinations.

    ``blocks``: the source's and the destination's block counts. ``ratio`` source ids per
    destination id (the destination's blocks hold ``ratio`` times the source's tokens). The
    checks, in order: ``ratio`` source ids per destination id (``length_mismatch``), every id
    in range of its side (``out_of_range``), no destination id twice (``duplicate_destination``;
    a source may be read several times), and with ``same_set`` (source and destination are one
    buffer set) no block both read and written (``invalid_message``: the result would depend on
    copy order).
    """
    if src_ids.size != ratio * dst_ids.size:
        want = f"{ratio} x {dst_ids.size}" if ratio > 1 else str(dst_ids.size)
        raise MoveError("length_mismatch", f"{src_ids.size} source ids for {want} destination ids")
    check_range(src_ids, blocks[0], "source")
    check_range(dst_ids, blocks[1], "destination")
    check_unique(dst_ids, "destination", blocks[1])
    if same_set and _overlap(src_ids, dst_ids):
        raise MoveError(
            "invalid_message", "source and destination blocks overlap in the same buffer set"
        )


def fine_small(
    src: list[int], dst: list[int], *, ratio: int, blocks: tuple[int, int], same_set: bool
) -> bool:
    """Whether a few ids (plain lists) pass every check of `check_ids`, in one pass.

    The fast path for a handful of ids: False says only that `check_ids` must look, and it
    names what is wrong. An empty move is left to `check_ids` too.
    """
    if not dst or len(src) != ratio * len(dst):
        return False
    if min(src) < 0 or max(src) >= blocks[0] or min(dst) < 0 or max(dst) >= blocks[1]:
        return False
    unique = set(dst)
    return len(unique) == len(dst) and not (same_set and not unique.isdisjoint(src))


def validate_move(
    src_ids: BlockIds,
    dst_ids: BlockIds,
    *,
    src_num_blocks: int,
    dst_num_blocks: int,
    aliased: bool = False,
) -> None:
    """Check that moving ``src_ids[i] -> dst_ids[i]`` is well formed; raise `MoveError` if not.

    `check_ids` for ids as they arrive (`BlockIds`), after checking that both are 1-D integer
    arrays (``invalid_message``). With ``aliased=True`` source and destination are the same
    buffer set.
    """
    src = _as_ids(src_ids, "src_ids")
    dst = _as_ids(dst_ids, "dst_ids")
    check_ids(src, dst, blocks=(src_num_blocks, dst_num_blocks), same_set=aliased)


@dataclass(frozen=True, slots=True)
class Run:
    """``length`` blocks from ``src_start`` onwards go to ``dst_start`` onwards."""

    src_start: int
    dst_start: int
    length: int


class RunPlan:
    """A move coalesced into runs, held as three int64 arrays of equal length.

    Iterating yields `Run` objects (for tests and logs); the copy loops read the arrays. Runs
    keep the order of the ids they came from.
    """

    __slots__ = ("dst_starts", "lengths", "src_starts")

    def __init__(self, src_starts: _IdArray, dst_starts: _IdArray, lengths: _IdArray) -> None:
        self.src_starts = src_starts
        self.dst_starts = dst_starts
        self.lengths = lengths

    def __len__(self) -> int:
        return int(self.lengths.size)

    def __iter__(self) -> Iterator[Run]:
        for s, d, n in zip(
            self.src_starts.tolist(), self.dst_starts.tolist(), self.lengths.tolist(), strict=True
        ):
            yield Run(s, d, n)

    def __repr__(self) -> str:
        return f"RunPlan(runs={len(self)}, blocks={self.num_blocks})"

    @property
    def num_blocks(self) -> int:
        """How many blocks the plan moves per view."""
        return int(self.lengths.sum())


def plan_runs(src_ids: BlockIds, dst_ids: BlockIds) -> RunPlan:
    """Coalesce a move into maximal runs where both source and destination ids step by +1.

    Copying each run as one slice gives exactly the bytes of a per-block copy in id order (given
    distinct destinations, which `validate_move` checks). Raises `MoveError` for malformed ids or
    unequal lengths; ranges are not checked here (see `validate_move`).
    """
    src = _as_ids(src_ids, "src_ids")
    dst = _as_ids(dst_ids, "dst_ids")
    if src.shape != dst.shape:
        raise MoveError("length_mismatch", f"{src.size} source ids but {dst.size} destination ids")
    if src.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return RunPlan(empty, empty.copy(), empty.copy())
    # A run starts at 0 and wherever either side does not continue the previous id by one.
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate((np.zeros(1, dtype=np.int64), breaks))
    ends = np.concatenate((breaks, np.array([src.size], dtype=np.int64)))
    return RunPlan(src[starts], dst[starts], ends - starts)


def plan_small(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """`plan_runs` for short id lists already checked: ``(src_start, dst_start, length)`` runs."""
    runs: list[tuple[int, int, int]] = []
    s0 = d0 = prev_s = prev_d = -2
    n = 0
    for s, d in zip(src, dst, strict=True):
        if n and s == prev_s + 1 and d == prev_d + 1:
            n += 1
        else:
            if n:
                runs.append((s0, d0, n))
            s0, d0, n = s, d, 1
        prev_s, prev_d = s, d
    if n:
        runs.append((s0, d0, n))
    return runs


def clip_ssm_state_blocks(blocks: list[int], num_spec_blocks: int) -> list[int]:
    """Keep only the running-state slot of an SSM layer's block list.

    The last ``num_spec_blocks`` entries are speculative-decoding scratch slots; the slot before
    them holds the running state and is the only one worth transferring. At least one block is
    kept when the list is non-empty (scratch may not be allocated yet), and an empty list stays
    empty. Returns a new list of at most one block; a negative ``num_spec_blocks`` is a
    ValueError.
    """
    if num_spec_blocks < 0:
        raise ValueError(f"num_spec_blocks must be >= 0, got {num_spec_blocks}")
    if not blocks:
        return []
    scratch = min(num_spec_blocks, len(blocks) - 1)
    return [blocks[len(blocks) - 1 - scratch]]
