"""Validated copy jobs: a move or a fix, checked completely before any byte moves.

`prepare_move` and `prepare_fix` run on the event loop. They resolve the buffer sets, check the
ids and the layouts, and either raise `SidecarError` (nothing touched) or return a `Job`: the
blocks it reads and writes (for the executor's ordering) and a closure that does the copy on a
copy thread.

Block-size ratio on a move: when the destination's blocks hold ``r`` times the tokens of the
source's, the destination's per-block byte rows are viewed as ``r`` consecutive sub-rows, and
destination block ``d`` is written as sub-blocks ``d*r .. d*r + r - 1`` from ``r`` source blocks.
That is a plain block copy at source granularity, after which `fix_received` turns the
packed remote blocks into the local block (the reference's ``kv_postprocess_blksize_*``).
A ``blocks_first`` row holds a block's K region, then its V region: re-blocked, each row is
first split into those two halves (`_PairPlan.parts`), so that the ``r`` source blocks' K land
in the destination's K region and their V in its V region, as a node-to-node pull lays them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvsidecar.core import copier, integrity, mover
from kvsidecar.core.fixes import fix_received, needs_fix
from kvsidecar.core.mover import check_ids, check_range, check_unique
from kvsidecar.node.copy_events import on_copy_streams
from kvsidecar.node.registry import BufferSet, LayerBuffer, Registry
from kvsidecar.wire.errors import SidecarError
from kvsidecar.wire.framing import IdArray
from kvsidecar.wire.protocol import FixLayout, Move
from kvsidecar.wire.types import BufferDescriptor, MemoryOrder, MoveEvents


@dataclass(frozen=True)
class Job:
    """A checked command, ready for the executor."""

    reads: dict[Hashable, IdArray]
    writes: dict[Hashable, IdArray]
    run: Callable[[], int]
    """Does the work on a copy thread; returns bytes copied."""
    blocks: int
    fixed: bool
    workers: frozenset[Hashable]
    """Workers whose memory the job touches (their release waits for it)."""
    verification: integrity.Verification | None = None
    """Set when the move is checksummed end to end; filled by ``run``."""
    inline: bool = False
    """Short enough to run on the event loop (`kvsidecar.daemon.runner.JobRunner.run`)."""


fine_small = mover.fine_small
"""`kvsidecar.core.mover.fine_small`, the one-pass check of a few ids; short moves call it here."""

INLINE_MAX_BYTES = 128 << 10
"""Plain CPU moves up to this size run on the event loop instead of a copy thread: copying
128 KiB takes about as long as the hand-off to a thread and back (two thread wake-ups), which
is most of a 1-block move's time in the daemon (docs/benchmarks.md, "bench latency"). The loop
is held no longer than that."""


def _select_layers(
    names: list[str] | None, first: BufferSet, second: BufferSet | None
) -> list[str]:
    chosen = list(first.layers) if names is None else names
    if not chosen:
        raise SidecarError("invalid_message", "an empty layer list moves nothing")
    if len(set(chosen)) != len(chosen):
        raise SidecarError("invalid_message", "a layer is named twice")
    for name in chosen:
        for side in (first, second):
            if side is not None and name not in side.layers:
                raise SidecarError(
                    "unknown_layer", f"{side.key[0].label()} ({side.key[1]}) has no layer {name!r}"
                )
    return chosen


def _ratio(src: BufferDescriptor, dst: BufferDescriptor, name: str) -> int:
    """Destination/source block-size ratio, or ``incompatible_buffers`` with the reason."""
    same = ("arrangement", "dtype", "num_heads", "head_size")
    for attr in same:
        if getattr(src, attr) != getattr(dst, attr):
            raise SidecarError(
                "incompatible_buffers",
                f"layer {name!r}: {attr} {getattr(src, attr)!r} vs {getattr(dst, attr)!r}",
            )
    if dst.block_size % src.block_size:
        raise SidecarError(
            "incompatible_buffers",
            f"layer {name!r}: destination block size {dst.block_size} is not a multiple of the "
            f"source's {src.block_size}",
        )
    return dst.block_size // src.block_size


def _split_rows(layer: LayerBuffer, parts: int) -> list[torch.Tensor]:
    """Return the layer's block rows split into ``parts`` sub-rows each (a view; see module doc)."""
    if parts == 1:
        return layer.block_views
    return [v.view(v.shape[0] * parts, v.shape[1] // parts) for v in layer.block_views]


def _row_ids(
    src_idx: npt.NDArray[np.int64], dst_idx: npt.NDArray[np.int64], ratio: int, parts: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Rows of the pair's views that a move's blocks copy between (source row i -> dest row i).

    Source block ``src_idx[p]`` goes into sub-block ``p % ratio`` of destination block
    ``dst_idx[p // ratio]``; with ``parts`` 2 (`_PairPlan.parts`), each of its K and V halves
    into that sub-block of the destination's K and V halves.
    """
    if ratio == 1 and parts == 1:
        return src_idx, dst_idx
    part = np.arange(parts, dtype=np.int64)
    sub = np.arange(src_idx.size, dtype=np.int64) % ratio
    src_rows = src_idx[:, None] * parts + part
    dst_rows = (np.repeat(dst_idx, ratio)[:, None] * parts + part) * ratio + sub[:, None]
    return src_rows.reshape(-1), dst_rows.reshape(-1)


def fix_layers(
    targets: Sequence[tuple[LayerBuffer, MemoryOrder]], index: torch.Tensor, ratio: int
) -> None:
    """Run `fix_received` on blocks ``index`` of each layer, written in its remote order.

    The one place that turns a raw copy's destination blocks into the layers' own layout: local
    moves, in-place fixes and node-to-node pulls all end here (on a copy thread).
    """
    for layer, remote_order in targets:
        desc = layer.descriptor
        fix_received(
            layer.cache,
            index,
            remote_layout=remote_order,
            local_layout=desc.memory_order,
            block_size_ratio=ratio,
            arrangement=desc.arrangement,
        )


@dataclass(frozen=True, slots=True)
class _PairPlan:
    """What a move between two buffer sets needs besides its ids: checked once per pair.

    Built from the layers' descriptors alone, so it holds for every move between the same two
    registrations and the same layer list; `Registry.derived` keeps it until either changes.
    """

    names: list[str]
    ratio: int
    parts: int
    """Sub-rows each view row is split into before the ratio's: 2 for a re-blocked
    ``blocks_first`` pair (K, then V, in one row), else 1 (module doc)."""
    fixes: list[tuple[LayerBuffer, MemoryOrder]]
    cpu_groups: list[tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]] | None
    """`copier.cpu_groups` of the two sides (ratio 1, CPU only): every unverified CPU move
    copies through these, small ones with `copier.copy_small`, larger with `copier.copy_groups`."""
    block_bytes: int
    """Bytes one block id moves over the ``cpu_groups`` (0 without them)."""
    src_views: list[torch.Tensor]
    dst_views: list[torch.Tensor]
    src_blocks: int
    dst_blocks: int
    """The two sides' block counts (a registration's never change)."""
    cuda_devices: tuple[int, ...]
    """The CUDA devices whose memory the move touches (empty: a CPU move)."""


_MAX_PLANS = 256
"""Cached pair plans; beyond it the cache starts over (layer subsets are the client's choice)."""


def _plan_key(src: BufferSet, dst: BufferSet, layers: list[str] | None) -> Hashable:
    return ("move", src, dst, None if layers is None else tuple(layers))


def plain_pair(
    registry: Registry, src: BufferSet, dst: BufferSet, layers: list[str] | None
) -> _PairPlan | None:
    """Return the cached plan of a pair whose moves are plain CPU row copies, or None.

    Plain: equal block sizes, no layout fix, CPU memory on both sides (`cpu_groups`). None also
    when no move between this pair and layer list made the plan yet (`move_job` makes it).
    """
    plan = registry.derived.get(_plan_key(src, dst, layers))
    if (
        isinstance(plan, _PairPlan)
        and plan.ratio == 1
        and not plan.fixes
        and plan.cpu_groups is not None
        and not plan.cuda_devices
    ):
        return plan
    return None


def _pair_plan(
    registry: Registry, src: BufferSet, dst: BufferSet, layers: list[str] | None
) -> _PairPlan:
    key = _plan_key(src, dst, layers)
    plan = registry.derived.get(key)
    if isinstance(plan, _PairPlan):
        return plan
    names = _select_layers(layers, src, dst)
    ratios = {_ratio(src.layers[n].descriptor, dst.layers[n].descriptor, n) for n in names}
    if len(ratios) != 1:
        raise SidecarError("incompatible_buffers", "layers disagree on the block-size ratio")
    ratio = ratios.pop()
    # One plan serves every layer's views, so they must all split alike (module doc).
    split = {ratio > 1 and src.layers[n].descriptor.arrangement == "blocks_first" for n in names}
    if len(split) != 1:
        raise SidecarError(
            "incompatible_buffers",
            "blocks_first layers change block size in a move of their own: their rows hold K "
            "and V (name the layers of each arrangement in separate moves)",
        )
    parts = 2 if split.pop() else 1
    src_views = [v for n in names for v in _split_rows(src.layers[n], parts)]
    dst_views = [v for n in names for v in _split_rows(dst.layers[n], parts * ratio)]
    groups = copier.cpu_groups(src_views, dst_views) if ratio == 1 else None
    plan = _PairPlan(
        names=names,
        ratio=ratio,
        parts=parts,
        fixes=[
            (dst.layers[n], src.layers[n].descriptor.memory_order)
            for n in names
            if needs_fix(src.layers[n].descriptor.memory_order, dst.layers[n].descriptor, ratio)
        ],
        cpu_groups=groups,
        block_bytes=0 if groups is None else copier.group_row_bytes(groups),
        src_views=src_views,
        dst_views=dst_views,
        src_blocks=src.num_blocks,
        dst_blocks=dst.num_blocks,
        cuda_devices=tuple(
            sorted({v.device.index or 0 for v in (*src_views, *dst_views) if v.is_cuda})
        ),
    )
    if len(registry.derived) >= _MAX_PLANS:
        registry.derived.clear()
    registry.derived[key] = plan
    return plan


def prepare_move(
    registry: Registry, cmd: Move, src_ids: IdArray, dst_ids: IdArray, *, checksum: bool = False
) -> Job:
    """Check a move completely and return its job; raises `SidecarError` on any problem.

    ``checksum``: verify the raw copy with `kvsidecar.core.integrity` (before any layout fix).
    """
    src = registry.buffer_set(cmd.src)
    dst = registry.buffer_set(cmd.dst)
    return move_job(
        registry,
        src,
        dst,
        src_ids,
        dst_ids,
        layers=cmd.layers,
        checksum=checksum,
        events=cmd.events,
    )


def move_job(
    registry: Registry,
    src: BufferSet,
    dst: BufferSet,
    src_ids: IdArray,
    dst_ids: IdArray,
    *,
    layers: list[str] | None = None,
    checksum: bool = False,
    events: MoveEvents | None = None,
) -> Job:
    """Check a copy between two buffer sets (a worker's, or a cache namespace's); its job.

    ``events``: the caller's CUDA events that order the copy (`Move.events`).
    """
    pair = _pair_plan(registry, src, dst, layers)
    ratio = pair.ratio
    # Both sides bounded: a length mismatch must not turn a huge id frame into a list first.
    small = dst_ids.size <= mover.SMALL_MOVE_IDS and src_ids.size <= ratio * mover.SMALL_MOVE_IDS
    src_list = src_ids.tolist() if small else []
    dst_list = dst_ids.tolist() if small else []
    blocks = (pair.src_blocks, pair.dst_blocks)
    same_set = src is dst
    if not (
        small and fine_small(src_list, dst_list, ratio=ratio, blocks=blocks, same_set=same_set)
    ):
        counts = (src.num_blocks, dst.num_blocks)  # raises with the reason, or checks many
        check_ids(src_ids, dst_ids, blocks=counts, ratio=ratio, same_set=same_set)
    fixes = pair.fixes
    verification = integrity.Verification() if checksum else None
    copy: Callable[[], int]
    # A move of a few blocks between CPU buffers: copied straight between cached numpy rows.
    groups = pair.cpu_groups
    inline = False
    if groups is not None and verification is None and small:
        inline = not fixes and pair.block_bytes * src_ids.size <= INLINE_MAX_BYTES
        runs = mover.plan_small(src_list, dst_list)
        copy = functools.partial(copier.copy_small, groups, runs, pair.block_bytes)
    else:
        src_rows, dst_rows = _row_ids(
            src_ids.astype(np.int64), dst_ids.astype(np.int64), ratio, pair.parts
        )
        src_views, dst_views = pair.src_views, pair.dst_views
        plan = mover.plan_runs(src_rows, dst_rows)
        prepared = groups  # the CPU views, stacked once for this pair

        def copy() -> int:
            if verification is None:
                if prepared is not None:
                    return copier.copy_groups(prepared, plan)
                return copier.copy_runs(src_views, dst_views, plan)
            return integrity.verified_copy(
                lambda: int(copier.copy_runs(src_views, dst_views, plan)),
                src_views=src_views,
                src_ids=src_rows,
                dst_views=dst_views,
                dst_ids=dst_rows,
                ratio=pair.parts * ratio,  # destination rows per destination block
                result=verification,
            )

    def run() -> int:  # the copy, then the layout fix of what it wrote
        copied = copy()
        fix_layers(fixes, torch.from_numpy(dst_ids.astype(np.int64)), ratio)
        return copied

    return Job(
        reads={src.key: src_ids},
        writes={dst.key: dst_ids},
        run=on_copy_streams(run if fixes else copy, pair.cuda_devices, events),
        blocks=int(dst_ids.size),
        fixed=bool(fixes),
        workers=frozenset({src.key[0], dst.key[0]}),
        verification=verification,
        inline=inline,
    )


def prepare_fix(registry: Registry, cmd: FixLayout, ids: IdArray) -> Job:
    """Check a fix-layout completely and return its job; raises `SidecarError` on any problem."""
    target = registry.buffer_set(cmd.target)
    names = _select_layers(cmd.layers, target, None)
    if cmd.remote.block_size < 1:
        raise SidecarError("invalid_message", "remote block_size must be >= 1")
    ratio = 0
    for n in names:
        desc = target.layers[n].descriptor
        if desc.block_size % cmd.remote.block_size:
            raise SidecarError(
                "incompatible_buffers",
                f"layer {n!r}: block size {desc.block_size} is not a multiple of the remote "
                f"block size {cmd.remote.block_size}",
            )
        ratio = desc.block_size // cmd.remote.block_size
    check_range(ids, target.num_blocks, "block")
    # A block fixed twice would be scrambled, so duplicates are refused like in a move.
    check_unique(ids, "block", target.num_blocks)
    index = torch.from_numpy(ids.astype(np.int64))
    layers = [target.layers[n] for n in names]
    remote = cmd.remote.memory_order

    def run() -> int:
        fix_layers([(lb, remote) for lb in layers], index, ratio)
        return 0

    devices = tuple(sorted({lb.cache.device.index or 0 for lb in layers if lb.cache.is_cuda}))

    return Job(
        reads={},
        writes={target.key: ids},
        run=on_copy_streams(run, devices, None),
        blocks=int(ids.size),
        fixed=True,
        workers=frozenset({target.key[0]}),
    )
