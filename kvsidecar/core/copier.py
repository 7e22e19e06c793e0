"""Copy execution: a planned move's runs copied between block-major views.

`kvsidecar.core.mover` checks and plans a move; this module carries it out. `copy_runs` copies each
run with one slice copy per view, or per group of views when the layers sit equally spaced in one
storage ("layer stacking"), which turns ``L x runs`` small copies into ``runs`` large strided ones.
`cpu_groups` builds and stacks the views of two CPU buffer sets once, for `copy_small` (a few runs,
no numpy plan) and `copy_groups` (any plan) to copy through on every later move between them.

CPU-to-CPU copies go through numpy on byte views: `numpy.copyto` releases the GIL, has a smaller
per-call cost than ``torch.Tensor.copy_`` and does not depend on torch's process-wide intra-op
thread count; large moves are split across a few helper threads (docs/benchmarks.md has the
measurements behind these choices). Copies that involve a CUDA tensor are enqueued with
``non_blocking=True`` on a CUDA stream.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from kvsidecar.core.mover import MoveError, RunPlan

__all__ = [
    "copy_groups",
    "copy_runs",
    "copy_small",
    "cpu_groups",
    "default_copy_threads",
    "group_row_bytes",
]

_IdArray: TypeAlias = "npt.NDArray[np.int64]"
_Bytes: TypeAlias = "npt.NDArray[np.uint8]"
_BytePair: TypeAlias = "tuple[_Bytes, _Bytes]"
"""A source and a destination group as numpy bytes: 2-D rows or a 3-D stack of layers."""


def copy_runs(
    src_views: Sequence[torch.Tensor],
    dst_views: Sequence[torch.Tensor],
    plan: RunPlan,
    *,
    threads: int | None = None,
    stream: torch.cuda.Stream | None = None,
    synchronize: bool = True,
) -> int:
    """Copy the plan's runs from every source view into the paired destination view.

    ``src_views[k]`` pairs with ``dst_views[k]``: block-major tensors (dim 0 = block, each
    block's bytes contiguous, any dtype, any block stride); a pair must agree in dtype and
    block size. The plan must fit both sides (checked; raises `MoveError` before copying). Source
    and destination blocks must not overlap in memory (see ``validate_move(aliased=True)``).

    Views that lie equally spaced in one storage with identical shape and strides (all layers
    allocated as one region) are stacked into one strided view, so each run is one copy across
    all of them. CPU-only moves run on up to ``threads`` threads (default
    `default_copy_threads`) once they are large enough to gain from it. If a CUDA tensor is
    involved, copies are enqueued with ``non_blocking=True`` on ``stream`` (default: the
    current stream of that device); with ``synchronize`` the call waits for them, otherwise the
    caller must synchronise (or record an event) before the bytes are read.

    Returns the number of bytes copied.
    """
    src_rows, dst_rows, row_bytes = _paired_rows(src_views, dst_views, plan)
    total = row_bytes * plan.num_blocks
    if total == 0:
        return 0
    groups = _group_views(src_rows, dst_rows)
    if all(t.device.type == "cpu" for t in (*src_rows, *dst_rows)):
        arrays = _as_numpy(groups)
        _run_cpu(arrays, plan, default_copy_threads() if threads is None else threads, total)
    else:
        _run_torch(groups, plan, stream, synchronize)
    return total


def _paired_rows(
    src_views: Sequence[torch.Tensor], dst_views: Sequence[torch.Tensor], plan: RunPlan | None
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Return the byte rows of the view pairs that hold bytes, and the bytes a block id moves.

    Raises `MoveError` when the views do not pair up or (given a ``plan``) do not hold its blocks.
    """
    if len(src_views) != len(dst_views):
        raise MoveError(
            "incompatible_buffers",
            f"{len(src_views)} source views but {len(dst_views)} destination",
        )
    src_end, dst_end = (
        (_plan_extent(plan.src_starts, plan.lengths), _plan_extent(plan.dst_starts, plan.lengths))
        if plan is not None
        else (0, 0)
    )
    src_rows: list[torch.Tensor] = []
    dst_rows: list[torch.Tensor] = []
    row_bytes = 0
    for k, (s_view, d_view) in enumerate(zip(src_views, dst_views, strict=True)):
        s_rows, d_rows = (
            _byte_rows(s_view, f"source view {k}"),
            _byte_rows(d_view, f"destination view {k}"),
        )
        if s_view.dtype != d_view.dtype or s_rows.shape[1] != d_rows.shape[1]:
            raise MoveError(
                "incompatible_buffers",
                f"view {k}: source blocks are {s_rows.shape[1]} bytes of {s_view.dtype}, "
                f"destination blocks {d_rows.shape[1]} bytes of {d_view.dtype}",
            )
        if s_rows.shape[0] < src_end or d_rows.shape[0] < dst_end:
            raise MoveError(
                "out_of_range",
                f"view {k}: the plan reaches block {max(src_end, dst_end) - 1}, the views hold "
                f"{s_rows.shape[0]} (source) and {d_rows.shape[0]} (destination) blocks",
            )
        if s_rows.shape[1]:
            src_rows.append(s_rows)
            dst_rows.append(d_rows)
            row_bytes += s_rows.shape[1]
    return src_rows, dst_rows, row_bytes


def _plan_extent(starts: _IdArray, lengths: _IdArray) -> int:
    """One past the highest block the plan touches on one side (0 for an empty plan)."""
    if not lengths.size:
        return 0
    if int(starts.min()) < 0:
        raise MoveError("out_of_range", f"the plan holds negative block id {int(starts.min())}")
    return int((starts + lengths).max())


def cpu_groups(
    src_views: Sequence[torch.Tensor], dst_views: Sequence[torch.Tensor]
) -> list[_BytePair] | None:
    """Pair CPU views up as numpy byte rows for `copy_small` and `copy_groups`.

    They are stacked as `copy_runs` stacks them: layers of one region become one 3-D
    ``(layers, num_blocks, row_bytes)`` array per side, so a run is one copy across all of them;
    other views stay 2-D. Built once per pair of buffer sets (the daemon's jobs cache it): the
    stacking checks cost more per view than a small move's copy. None when a view is not on the
    CPU or a pair disagrees in dtype or block size (`copy_runs` reports that).
    """
    if any(v.device.type != "cpu" for v in (*src_views, *dst_views)):
        return None
    try:
        src_rows, dst_rows, _ = _paired_rows(src_views, dst_views, None)
    except MoveError:
        return None
    return _as_numpy(_group_views(src_rows, dst_rows))


def copy_small(
    groups: Sequence[_BytePair],
    runs: Sequence[tuple[int, int, int]],
    row_bytes: int | None = None,
) -> int:
    """Copy a few runs between `cpu_groups` arrays (2-D rows or 3-D stacks of layers).

    The fast path for small moves: no per-call view building or stacking, whose fixed cost
    dwarfs copying a few blocks, and no numpy plan. The caller has checked everything
    `copy_runs` checks (the runs fit both sides). Returns the bytes copied; ``row_bytes``:
    the groups' `group_row_bytes`, when the caller has it already.
    """
    _copy_numpy(groups, [s for s, _, _ in runs], [d for _, d, _ in runs], [n for _, _, n in runs])
    if row_bytes is None:
        row_bytes = group_row_bytes(groups)
    return row_bytes * sum(n for _, _, n in runs)


def copy_groups(
    groups: Sequence[_BytePair],
    plan: RunPlan,
    *,
    threads: int | None = None,
) -> int:
    """`copy_runs` between `cpu_groups` arrays built once per buffer pair.

    Skips `copy_runs`' per-call view building and stacking (a fixed cost per view, which
    dominates moves of a few MiB); the caller has checked that the plan fits both sides.
    Large moves use the same helper threads as `copy_runs`. Returns the bytes copied.
    """
    total = group_row_bytes(groups) * plan.num_blocks
    if total:
        _run_cpu(groups, plan, default_copy_threads() if threads is None else threads, total)
    return total


def group_row_bytes(groups: Sequence[_BytePair]) -> int:
    """Bytes one block id moves across `cpu_groups` (a 3-D group is layers x row bytes)."""
    return sum(src.shape[1] if src.ndim == 2 else src.shape[0] * src.shape[2] for src, _ in groups)


@dataclass(frozen=True, slots=True)
class _Rows:
    """A view re-read as ``(layers, num_blocks, row_bytes)`` uint8 over the same storage."""

    tensor: torch.Tensor  # uint8, 2-D (one view) or 3-D (a stack of equally spaced views)
    layers: int


def _byte_rows(view: torch.Tensor, what: str) -> torch.Tensor:
    """Re-read a block-major view as ``(num_blocks, row_bytes)`` uint8, sharing its memory.

    Built with ``set_`` on the untyped storage rather than ``Tensor.view(torch.uint8)`` so any
    dtype works (bfloat16, float8, 1-D views) and no silent copy can happen.
    """
    if view.dim() == 0:
        raise MoveError("incompatible_buffers", f"{what} is a scalar, not a block-major view")
    # Every dim after the block dim must be laid out contiguously: one block = one byte row.
    expected = 1
    for size, stride in zip(reversed(view.shape[1:]), reversed(view.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            raise MoveError(
                "incompatible_buffers",
                f"{what} has non-contiguous blocks (shape {tuple(view.shape)}, "
                f"stride {view.stride()})",
            )
        expected *= size
    esize = view.element_size()
    rows = torch.empty(0, dtype=torch.uint8, device=view.device)
    rows.set_(
        view.untyped_storage(),
        view.storage_offset() * esize,
        (view.shape[0], expected * esize),
        (view.stride(0) * esize, 1),
    )
    return rows


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    pa, pb = a.untyped_storage(), b.untyped_storage()
    return a.device == b.device and pa.nbytes() > 0 and pa.data_ptr() == pb.data_ptr()


def _step(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Return the byte step from view ``a`` to view ``b`` if ``b`` can follow ``a`` in a stack.

    That needs the same storage, shape and strides, and a positive step (``as_strided`` takes no
    negative strides); otherwise None.
    """
    if a.shape != b.shape or a.stride() != b.stride() or not _same_storage(a, b):
        return None
    step = int(b.storage_offset() - a.storage_offset())
    return step if step > 0 else None


def _max_dst_layers(rows: torch.Tensor, step: int) -> int:
    """Return how many destination views ``step`` bytes apart can be stacked.

    Stacked destinations must not share a byte, or the winning write would depend on copy order.
    """
    blocks, row = rows.shape
    extent = (blocks - 1) * rows.stride(0) + row if blocks else 0
    if step >= extent:  # each layer lies wholly after the previous one
        return 1 << 30
    if step >= row:  # layers interleave inside one block stride (K/V of a blocks-first cache)
        return max(1, (rows.stride(0) - row) // step + 1)
    return 1


def _stack(rows: Sequence[torch.Tensor], step: int) -> torch.Tensor:
    first = rows[0]
    return first.as_strided(
        (len(rows), *first.shape), (step, *first.stride()), first.storage_offset()
    )


def _group_views(
    src_rows: Sequence[torch.Tensor], dst_rows: Sequence[torch.Tensor]
) -> list[tuple[_Rows, _Rows]]:
    """Pair up views, stacking each longest consecutive stretch that stacks on both sides."""
    groups: list[tuple[_Rows, _Rows]] = []
    count = len(src_rows)
    i = 0
    while i < count:
        j = i + 1
        s_step = d_step = None
        if j < count:
            s_step = _step(src_rows[i], src_rows[j])
            d_step = _step(dst_rows[i], dst_rows[j])
        if s_step is not None and d_step is not None:
            limit = min(count, i + _max_dst_layers(dst_rows[i], d_step))
            while (
                j < limit
                and _step(src_rows[j - 1], src_rows[j]) == s_step
                and _step(dst_rows[j - 1], dst_rows[j]) == d_step
            ):
                j += 1
        if j - i == 1 or s_step is None or d_step is None:
            groups.append((_Rows(src_rows[i], 1), _Rows(dst_rows[i], 1)))
            i += 1
            continue
        groups.append(
            (
                _Rows(_stack(src_rows[i:j], s_step), j - i),
                _Rows(_stack(dst_rows[i:j], d_step), j - i),
            )
        )
        i = j
    return groups


def _as_numpy(groups: Sequence[tuple[_Rows, _Rows]]) -> list[_BytePair]:
    """Return the CPU groups' byte rows as numpy arrays over the same memory."""
    return [(s.tensor.numpy(), d.tensor.numpy()) for s, d in groups]


# Below these sizes the helper threads cost more than they save: a thread handoff costs more
# than copying a few blocks, and with copies of a few tens of KiB the threads mostly wait for
# the GIL: two threads copy such blocks slower than one.


_PARALLEL_MIN_BYTES = 8 << 20
_PARALLEL_MIN_CALL_BYTES = 256 << 10
_PIECES_PER_THREAD = 4

# Helper threads for large CPU moves, started on demand by the executor and shared by every call.
_MAX_THREADS = 16
_pool = ThreadPoolExecutor(max_workers=_MAX_THREADS - 1, thread_name_prefix="kvsidecar-copy")


def default_copy_threads() -> int:
    """Threads `copy_runs` uses by default on CPU: the usable cores, at most 4.

    Memory bandwidth, not compute, limits a copy; beyond a few threads per socket more threads
    only contend.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def _split_blocks(plan: RunPlan, parts: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Cut the plan into ``parts`` pieces holding equal numbers of blocks.

    Runs are split at the cut points, so threads get equal work whatever the run lengths.
    """
    ends = np.cumsum(plan.lengths)
    begins = ends - plan.lengths
    total = int(ends[-1])
    cuts = [total * k // parts for k in range(parts + 1)]
    pieces = []
    for lo, hi in itertools.pairwise(cuts):
        take = (begins < hi) & (ends > lo)
        skip = np.maximum(lo - begins[take], 0)
        stop = np.minimum(ends[take], hi) - begins[take]
        pieces.append(
            (
                (plan.src_starts[take] + skip).tolist(),
                (plan.dst_starts[take] + skip).tolist(),
                (stop - skip).tolist(),
            )
        )
    return pieces


def _copy_numpy(
    groups: Sequence[_BytePair],
    src_starts: list[int],
    dst_starts: list[int],
    lengths: list[int],
) -> None:
    """One `numpy.copyto` per run per group. Groups are 2-D (one view) or 3-D (stacked)."""
    pairs = [
        (slice(s, s + n), slice(d, d + n))
        for s, d, n in zip(src_starts, dst_starts, lengths, strict=True)
    ]
    copyto = np.copyto
    for src, dst in groups:
        if src.ndim == 2:
            for s_sl, d_sl in pairs:
                copyto(dst[d_sl], src[s_sl])
        else:
            for s_sl, d_sl in pairs:
                copyto(dst[:, d_sl], src[:, s_sl])


def _run_cpu(arrays: Sequence[_BytePair], plan: RunPlan, threads: int, total: int) -> None:
    calls = len(plan) * len(arrays)
    threads = max(1, min(threads, _MAX_THREADS))
    if threads == 1 or total < _PARALLEL_MIN_BYTES or total < calls * _PARALLEL_MIN_CALL_BYTES:
        _copy_numpy(
            arrays, plan.src_starts.tolist(), plan.dst_starts.tolist(), plan.lengths.tolist()
        )
        return
    # More pieces than threads, taken in turn: a thread that the OS deschedules (the machine is
    # shared) delays the move by one piece, not by half of it.
    pieces = _split_blocks(plan, threads * _PIECES_PER_THREAD)
    order = itertools.count()  # next() on a count is atomic under the GIL

    def work() -> None:
        while (k := next(order)) < len(pieces):
            _copy_numpy(arrays, *pieces[k])

    futures: list[Future[None]] = [_pool.submit(work) for _ in range(threads - 1)]
    try:
        work()
    finally:
        # Wait for every helper even if this thread failed: no copy may outlive the call.
        errors = [f.exception() for f in futures]
    for err in errors:
        if err is not None:
            raise err


def _run_torch(
    groups: list[tuple[_Rows, _Rows]],
    plan: RunPlan,
    stream: torch.cuda.Stream | None,
    synchronize: bool,
) -> None:
    """Copy where a CUDA (or other non-CPU) tensor is involved, enqueued on one stream."""
    cuda_device = next(
        (t.tensor.device for pair in groups for t in pair if t.tensor.device.type == "cuda"), None
    )
    if cuda_device is not None and stream is None:
        stream = torch.cuda.current_stream(cuda_device)
    runs = list(
        zip(plan.src_starts.tolist(), plan.dst_starts.tolist(), plan.lengths.tolist(), strict=True)
    )
    with torch.cuda.stream(stream):  # a no-op context for None
        for src, dst in groups:
            if src.tensor.device == dst.tensor.device:
                # One device: a strided copy kernel handles stacked and padded rows in place.
                s_t, d_t = src.tensor, dst.tensor
                if src.layers == 1:
                    for s, d, n in runs:
                        d_t[d : d + n].copy_(s_t[s : s + n], non_blocking=True)
                else:
                    for s, d, n in runs:
                        d_t[:, d : d + n].copy_(s_t[:, s : s + n], non_blocking=True)
                continue
            # Between host and device torch stages any non-contiguous copy through a temporary
            # the size of the copy; keep every copy a contiguous chunk instead (a whole run when
            # blocks are packed, else one block), each a single async memcpy.
            s_layers = src.tensor if src.layers > 1 else src.tensor.unsqueeze(0)
            d_layers = dst.tensor if dst.layers > 1 else dst.tensor.unsqueeze(0)
            packed = all(t.shape[2] == t.stride(1) for t in (s_layers, d_layers))
            for s_t, d_t in zip(s_layers.unbind(0), d_layers.unbind(0), strict=True):
                for s, d, n in runs:
                    if packed:
                        d_t[d : d + n].copy_(s_t[s : s + n], non_blocking=True)
                    else:
                        for k in range(n):
                            d_t[d + k].copy_(s_t[s + k], non_blocking=True)
    if synchronize and stream is not None:
        stream.synchronize()
